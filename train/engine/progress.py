"""Training progress that reads well in a terminal and in a log.

In an interactive terminal a tqdm bar is the best display. Through
horovodrun's or torchrun's pipes, in CI and in a platform's log viewer every
redraw of that bar becomes a line (``[0]<stderr>:epoch 4/8:  46%|████▋ ...``
hundreds of times), so there :class:`Progress` prints one plain, flushed line
now and then instead::

    [pksampler] epoch 3/8 step 12/28 loss 0.4312 img/s 152.3 lr 0.0031 eta 0:01:12

Cadence of the plain lines: a line when ``every_steps`` steps or
``every_seconds`` seconds have passed since the last one (whichever comes
first), and always at the last step of an epoch. The ETA is for the whole
run: remaining steps of every epoch, at the rate measured since the first
epoch started here (so time spent evaluating between epochs is included).

Rank 0 creates it with ``enabled=True``; other ranks pass ``enabled=False``
and every call is a no-op, so the loop needs no ``if rank == 0``.

Example::

    progress = Progress(len(sampler), epochs, enabled=backend.rank == 0)
    for epoch in range(start_epoch, epochs):
        progress.start_epoch(epoch, step=resumed_step)
        for step, batch in enumerate(loader, start=resumed_step + 1):
            ...
            progress.update(step, loss=loss, images_per_sec=rate, lr=lr)
        progress.end_epoch()
    progress.close()
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any, Callable, TextIO

__all__ = ["Progress"]

PREFIX = "[pksampler]"


def _positive_int(name: str, value: Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Progress({name}=) must be a positive int{' or None' if allow_none else ''}, got {value!r}")
    return value


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` for a number of seconds (rounded); ``?`` when unknown."""
    if seconds != seconds or seconds == float("inf") or seconds < 0:
        return "?"
    return str(datetime.timedelta(seconds=round(seconds)))


class Progress:
    """Per-epoch progress: a tqdm bar in a terminal, periodic plain lines elsewhere.

    Args:
        steps_per_epoch: steps (batches) in one epoch; the ``/28`` of ``step 12/28``.
        epochs: epochs in the whole run; the ``/8`` of ``epoch 3/8``.
        enabled: False on every rank but 0: all methods do nothing.
        interactive: True for the tqdm bar, False for plain lines; ``None``
            decides by ``sys.stderr.isatty()``.
        every_seconds: plain mode: a line at least this often (``None``: no time trigger).
        every_steps: plain mode: a line every this many steps; ``None`` means
            10 % of an epoch (at least 1).
        stream: where to write; ``None`` is ``sys.stdout`` for plain lines (a
            log) and ``sys.stderr`` for the bar (as tqdm does).
        clock: seconds as a float, monotonic; tests pass a fake one.
        stop_at: the global step the run stops at when that comes before the last epoch's end (``train.max_steps``):
            the eta counts to it, not to the schedule's end; ``None``: the last step of the last epoch.
    """

    def __init__(
        self,
        steps_per_epoch: int,
        epochs: int,
        *,
        enabled: bool = True,
        interactive: bool | None = None,
        every_seconds: float | None = 30.0,
        every_steps: int | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        stop_at: int | None = None,
    ) -> None:
        self.steps_per_epoch = _positive_int("steps_per_epoch", steps_per_epoch)
        self.epochs = _positive_int("epochs", epochs)
        if stop_at is not None and (isinstance(stop_at, bool) or not isinstance(stop_at, int) or stop_at < 0):
            raise ValueError(f"Progress(stop_at=) must be an int >= 0 or None, got {stop_at!r}")
        scheduled = self.epochs * self.steps_per_epoch
        self.last_position = scheduled if stop_at is None else min(stop_at, scheduled)
        if every_seconds is not None and (isinstance(every_seconds, bool) or not every_seconds > 0):
            raise ValueError(f"Progress(every_seconds=) must be a positive number or None, got {every_seconds!r}")
        self.every_seconds = every_seconds
        self.every_steps = _positive_int("every_steps", every_steps, allow_none=True) or max(
            1, -(-self.steps_per_epoch // 10))
        self.enabled = bool(enabled)
        self.interactive = sys.stderr.isatty() if interactive is None else bool(interactive)
        self._stream = stream
        self._clock = clock
        self._bar: Any = None
        self._epoch = 0
        self._step = 0
        self._last: dict[str, float | None] = {}
        self._run_start: tuple[float, int] | None = None  # (time, global position) at the first epoch
        self._printed_at: tuple[float, int] = (0.0, 0)    # (time, step) of the last plain line

    # -- the loop's calls -------------------------------------------------------------

    def start_epoch(self, epoch: int, *, step: int = 0) -> None:
        """Begin epoch ``epoch`` (0-based, shown 1-based); ``step`` = steps already done (a resume)."""
        if not self.enabled:
            return
        self.end_epoch()
        self._epoch, self._step = int(epoch), int(step)
        now = self._clock()
        if self._run_start is None:
            self._run_start = (now, self._position())
        self._printed_at = (now, self._step)
        if self.interactive:
            from tqdm import tqdm

            self._bar = tqdm(total=self.steps_per_epoch, initial=self._step, desc=f"epoch {epoch + 1}/{self.epochs}",
                             unit="batch", dynamic_ncols=True, file=self._stream or sys.stderr, mininterval=1.0)

    def update(self, step: int, *, loss: float | None = None, images_per_sec: float | None = None,
               lr: float | None = None) -> None:
        """Steps done in this epoch are now ``step`` (1-based count); show the latest values."""
        if not self.enabled:
            return
        if self._run_start is None:
            self.start_epoch(self._epoch)
        self._step = int(step)
        self._last = {"loss": _plain(loss), "img/s": _plain(images_per_sec), "lr": _plain(lr)}
        if self._bar is not None:
            postfix = {}
            if loss is not None:
                postfix["loss"] = f"{self._last['loss']:.4f}"
            if images_per_sec is not None:
                postfix["img_s"] = f"{self._last['img/s']:.1f}"
            if lr is not None:
                postfix["lr"] = f"{self._last['lr']:.3g}"
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(self._step - self._bar.n)
            return
        now = self._clock()
        last_time, last_step = self._printed_at
        due = (self._step - last_step >= self.every_steps
               or (self.every_seconds is not None and now - last_time >= self.every_seconds)
               or self._step >= self.steps_per_epoch)
        if due:
            self._print_line(now)

    def end_epoch(self) -> None:
        """Close the epoch's bar; in plain mode print the final state if it was not printed yet."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif not self.interactive and self._last and self._printed_at[1] != self._step:
            self._print_line(self._clock())

    def close(self) -> None:
        """End the run's display (idempotent)."""
        self.end_epoch()

    def write(self, text: str) -> None:
        """A message line (e.g. evaluation results) that does not break a running bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self._stream or sys.stderr)
        else:
            stream = self._stream or sys.stdout
            stream.write(text + "\n")
            stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plain lines --------------------------------------------------------------------

    def line(self, now: float) -> str:
        """The plain progress line for the current state at time ``now``."""
        parts = [PREFIX, f"epoch {self._epoch + 1}/{self.epochs}", f"step {self._step}/{self.steps_per_epoch}"]
        formats = {"loss": "{:.4f}", "img/s": "{:.1f}", "lr": "{:.4g}"}
        parts += [f"{name} {formats[name].format(value)}" for name, value in self._last.items() if value is not None]
        parts.append(f"eta {format_eta(self.eta_seconds(now))}")
        return " ".join(parts)

    def eta_seconds(self, now: float) -> float:
        """Seconds until the run's last step (the last epoch's, or ``stop_at``), at the rate measured so far."""
        if self._run_start is None:
            return float("nan")
        start_time, start_position = self._run_start
        done = self._position() - start_position
        if done <= 0 or now <= start_time:
            return float("nan")
        remaining = self.last_position - self._position()
        return max(0, remaining) * (now - start_time) / done

    def _position(self) -> int:
        return self._epoch * self.steps_per_epoch + self._step

    def _print_line(self, now: float) -> None:
        stream = self._stream or sys.stdout
        stream.write(self.line(now) + "\n")
        stream.flush()
        self._printed_at = (now, self._step)


def _plain(value: Any) -> float | None:
    """A float from a Python number, numpy scalar or one-element tensor (None stays None)."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    return float(value)

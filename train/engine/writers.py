"""One writer hook over many writers: metrics.jsonl, TensorBoard and the progress line read the run's events.

detectron2's ``PeriodicWriter`` over ``EventWriter``s: the loop and the hooks
put their events in one :class:`~.events.EventStorage`; one hook,
:class:`WriterHook`, keeps the only cursor into it (which records and images
are new) and hands each event to every :class:`EventWriter`:

* :class:`JSONWriter` -- ``metrics.jsonl``, one line per step and per record, written at once;
* :class:`CommittedJSONWriter` -- the same lines held until a commit (Horovod
  elastic: a step rolled back by a reset is never written, and whichever
  process is rank 0 at the commit appends them), the buffering policy;
* :class:`TensorBoardEventWriter` -- every numeric scalar of a step, every
  numeric metric of an evaluation record, the images;
* :class:`ProgressWriter` -- the progress bar or plain periodic line.

A writer that only the main rank runs, in a run whose main rank can change
hands, is wrapped in :class:`OnMainRankWriter` (built by whichever process is
rank 0 when it first writes). A new destination is a new writer, not a hook
with a cursor of its own.

Records already in the storage when training starts (a resumed run's
history, read back from ``metrics.jsonl``) are not written again.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any, Callable, Sequence

from pksampler.train.engine.trainer import HookBase
from pksampler.train.runtime.workspace import EventLog, json_line

__all__ = ["CommittedJSONWriter", "EventWriter", "JSONWriter", "OnMainRankWriter", "ProgressWriter",
           "TensorBoardEventWriter", "WriterHook"]

Image = tuple[str, int, Path]

#: fields of a step record that are positions or run constants, not scalars to plot
_NOT_SCALARS = frozenset({"type", "epoch", "step", "global_step", "time", "global_batch"})


class EventWriter:
    """One destination of the run's events; every method is a no-op here, a writer overrides what it uses."""

    def begin_epoch(self, epoch: int, step: int) -> None:
        """An epoch starts (``step``: batches already done in it, a resumed run)."""

    def write_step(self, record: dict[str, Any]) -> None:
        """One optimizer step's record (``type: step``, ``global_step``, the scalars)."""

    def write_records(self, records: list[dict[str, Any]], images: list[Image]) -> None:
        """Records (evaluation, bad images, object store) and images put since the last call."""

    def end_epoch(self) -> None:
        """The epoch is over."""

    def on_world_change(self) -> None:
        """The set of ranks changed: the steps after the last commit are rolled back."""

    def close(self) -> None:
        """Training is over."""


class WriterHook(HookBase):
    """Hands the storage's events to every writer: each step as it is put, records after an epoch and at the end.

    :meth:`flush` hands over the records and images put since the last call
    (a commit calls it, so the records of a commit's steps go with them).
    """

    def __init__(self, writers: Sequence[EventWriter]) -> None:
        self.writers = list(writers)
        self._records = self._images = 0

    def before_train(self) -> None:
        storage = self.trainer.storage
        self._records, self._images = len(storage.records()), storage.images_since(0)[1]

    def before_epoch(self) -> None:
        for writer in self.writers:
            writer.begin_epoch(self.trainer.state.epoch, self.trainer.state.consumed)

    def after_step(self) -> None:
        record = self.trainer.storage.latest_step
        if record is None:
            return
        for writer in self.writers:
            writer.write_step(record)

    def flush(self) -> None:
        """The records and images put since the last flush, to every writer."""
        storage = self.trainer.storage
        records, self._records = storage.records_since(self._records)
        images, self._images = storage.images_since(self._images)
        if records or images:
            for writer in self.writers:
                writer.write_records(records, images)

    def after_epoch(self) -> None:
        self.flush()
        for writer in self.writers:
            writer.end_epoch()

    def after_train(self) -> None:
        self.flush()
        for writer in self.writers:
            writer.close()

    def on_world_change(self) -> None:
        for writer in self.writers:
            writer.on_world_change()


class JSONWriter(EventWriter):
    """``metrics.jsonl`` (the main rank): each step's line and each record's, written at once."""

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def write_step(self, record: dict[str, Any]) -> None:
        self.log.write(**record)

    def write_records(self, records: list[dict[str, Any]], images: list[Image]) -> None:
        for record in records:
            self.log.write(**record)


class CommittedJSONWriter(EventWriter):
    """``metrics.jsonl`` under Horovod elastic: lines held on every rank, appended by rank 0 at each commit.

    After a reset the held lines (the steps after the last commit) are
    dropped, so a step trained again after a rollback is written once, by
    whichever process is rank 0 when it is committed. Every rank keeps the
    last commit's lines (:attr:`flushed`): a process that becomes rank 0
    completes the log with them (:meth:`repair`) when the old rank 0 died
    inside a commit.
    """

    def __init__(self, path: Path, is_main: Callable[[], bool]) -> None:
        self.path, self.is_main = path, is_main
        self.pending: list[str] = []
        self.flushed: list[str] = []

    def write_step(self, record: dict[str, Any]) -> None:
        self.pending.append(json_line(record))

    def write_records(self, records: list[dict[str, Any]], images: list[Image]) -> None:
        self.pending.extend(json_line(record) for record in records)

    def commit(self) -> None:
        """The held lines are final: rank 0 appends them (one write); every rank remembers them."""
        lines, self.pending = self.pending, []
        if lines and self.is_main():
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write("".join(f"{line}\n" for line in lines))
        if lines:
            self.flushed = lines

    def on_world_change(self) -> None:
        self.pending.clear()

    def repair(self) -> None:
        """For a process that has just become rank 0: the log as the last commit left it.

        The old rank 0 may have died inside that commit: before it wrote the
        commit's lines (every rank keeps them, :attr:`flushed`), or in the
        middle of one (a line cut short, dropped here).
        """
        if not self.path.is_file():
            return
        with open(self.path, "rb+") as handle:
            data = handle.read()
            if data and not data.endswith(b"\n"):
                handle.truncate(data.rfind(b"\n") + 1)
                data = data[: data.rfind(b"\n") + 1]
        written = {_line_key(line) for line in data.decode("utf-8").splitlines()[-4 * max(len(self.flushed), 1):]}
        missing = [line for line in self.flushed if _line_key(line) not in written]
        if missing:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write("".join(f"{line}\n" for line in missing))


def _line_key(line: str) -> tuple[Any, ...]:
    """What tells two metrics.jsonl lines apart across ranks (their timings differ): type, step, epoch."""
    try:
        record = json.loads(line)
    except ValueError:
        return (line,)
    return record.get("type"), record.get("global_step"), record.get("epoch")


def _scalars(record: dict[str, Any], skip: frozenset[str]) -> dict[str, Any]:
    """The numeric fields of ``record`` but ``skip`` (whatever keys the events carry)."""
    return {k: v for k, v in record.items()
            if k not in skip and not isinstance(v, bool) and isinstance(v, numbers.Real)}


class TensorBoardEventWriter(EventWriter):
    """TensorBoard (:class:`~.tensorboard.TensorBoardWriter`): every scalar of a step, every metric of an
    evaluation record, every image; flushed after the records of an epoch."""

    def __init__(self, board: Any) -> None:
        self.board = board

    def write_step(self, record: dict[str, Any]) -> None:
        self.board.scalars(record["global_step"], **_scalars(record, _NOT_SCALARS))

    def write_records(self, records: list[dict[str, Any]], images: list[Image]) -> None:
        for record in records:
            if record["type"] == "eval":
                metrics = {k: v for k, v in record.items() if k not in ("type", "epoch", "global_step")}
                self.board.metrics(record["global_step"], metrics, epoch=record["epoch"])
        for tag, step, path in images:
            self.board.image(tag, step, path)
        self.board.flush()

    def close(self) -> None:
        self.board.close()


class ProgressWriter(EventWriter):
    """The progress display (:class:`~.progress.Progress`: a bar on a terminal, plain periodic lines in a log)."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress

    def begin_epoch(self, epoch: int, step: int) -> None:
        self.progress.start_epoch(epoch, step=step)

    def write_step(self, record: dict[str, Any]) -> None:
        """The step on the display; the epoch's last step also closes it, so the hooks that run before the writer
        hook at the epoch's end (evaluation, bad images, object store) print below a finished bar, as when the
        progress display was the first hook."""
        self.progress.update(record["step"], loss=record.get("loss"), images_per_sec=record.get("images_per_sec"),
                             lr=record.get("lr"))
        if record["step"] >= self.progress.steps_per_epoch:
            self.progress.end_epoch()

    def end_epoch(self) -> None:
        self.progress.end_epoch()

    def close(self) -> None:
        self.progress.close()


class OnMainRankWriter(EventWriter):
    """A main-rank writer in a run whose rank 0 can change (Horovod elastic): built and called only while
    ``is_main()``, so a display or an event file is opened only by the process that uses it."""

    def __init__(self, build: Callable[[], EventWriter], is_main: Callable[[], bool]) -> None:
        self.build, self.is_main = build, is_main
        self.writer: EventWriter | None = None

    def _target(self) -> EventWriter | None:
        if not self.is_main():
            return None
        if self.writer is None:
            self.writer = self.build()
        return self.writer

    def begin_epoch(self, epoch: int, step: int) -> None:
        if (writer := self._target()) is not None:
            writer.begin_epoch(epoch, step)

    def write_step(self, record: dict[str, Any]) -> None:
        if (writer := self._target()) is not None:
            writer.write_step(record)

    def write_records(self, records: list[dict[str, Any]], images: list[Image]) -> None:
        if (writer := self._target()) is not None:
            writer.write_records(records, images)

    def end_epoch(self) -> None:
        if (writer := self._target()) is not None:
            writer.end_epoch()

    def close(self) -> None:
        if (writer := self._target()) is not None:
            writer.close()

    def on_world_change(self) -> None:
        """The writer built so far hears of it, whichever rank this process is now; none is built for it."""
        if self.writer is not None:
            self.writer.on_world_change()

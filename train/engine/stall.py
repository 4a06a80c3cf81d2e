"""A classification head seen from outside: its own numbers in every step record, and one line when it stalls.

A margin head that does not learn looks like any other run from outside: the
total loss moves (the pair loss learns), the head's own loss sits at about
ln(sampled classes) and, meanwhile, it can pull every embedding onto one
direction (R@1 0.005 with such a head on the typeface set).

* :class:`HeadScalarsHook` adds the head's loss, the same loss without the
  margin and the margin itself to each step record (``metrics.jsonl``,
  TensorBoard's ``train/head_loss``, ...): the margin's ramp raises the first
  while the second keeps falling when the head learns.
* :class:`HeadStallHook` compares the mean of the head's margin-free loss over
  the last ``window`` steps, at step ``after_steps``, with its mean over the
  first ``window`` steps, and prints one line naming the numbers and the keys
  to look at when it has fallen by less than ``min_drop`` (a fraction of the
  start). It warns once, on rank 0 (every rank holds the same head loss: the
  embeddings are gathered).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from pksampler.train.engine.trainer import HookBase

__all__ = ["HeadScalarsHook", "HeadStallHook"]


class HeadScalarsHook(HookBase):
    """Put ``scalars()`` (the head's :meth:`~pksampler.train.losses.headed.HeadedLoss.step_scalars`) into the
    record of each step, before the writers read it."""

    def __init__(self, scalars: Callable[[], dict[str, float]]) -> None:
        self.scalars = scalars

    def after_step(self) -> None:
        self.trainer.storage.add_to_step(**self.scalars())


class HeadStallHook(HookBase):
    """Warn once when the head's loss, ``after_steps`` steps in, has fallen less than ``min_drop`` of its start.

    Args:
        head_loss: the head's loss of the step just taken, without the margin (``head.last_softmax_loss``: the
            margin's ramp raises the loss that is trained, so that one would read as a stall).
        after_steps: the global step at which it is judged.
        window: steps averaged at the start and at the judgement.
        min_drop: the smallest relative fall that counts as learning (0.05: 5 %).
        emit: where the line goes (``print`` by default).
    """

    def __init__(self, head_loss: Callable[[], torch.Tensor | float], *, after_steps: int = 300, window: int = 20,
                 min_drop: float = 0.05, emit: Callable[[str], None] = print) -> None:
        if window < 1 or after_steps < 2 * window:
            raise ValueError(f"HeadStallHook: after_steps ({after_steps}) must be at least 2 × window ({window}), "
                             "window at least 1")
        self.head_loss, self.after_steps, self.window, self.min_drop, self.emit = (head_loss, after_steps, window,
                                                                                    min_drop, emit)
        self._first: list[float] = []
        self._last: list[float] = []
        self.warned = False

    def after_step(self) -> None:
        step = self.trainer.state.global_step  # steps taken, this one included
        if self.warned or step > self.after_steps:
            return
        value = float(self.head_loss())
        if step <= self.window:
            self._first.append(value)
        if step > self.after_steps - self.window:
            self._last.append(value)
        if step == self.after_steps and self._first and self._last:
            self._judge()

    def _judge(self) -> None:
        start = sum(self._first) / len(self._first)
        now = sum(self._last) / len(self._last)
        if not (math.isfinite(start) and math.isfinite(now)) or start <= 0:
            return
        if now > (1.0 - self.min_drop) * start:
            self.warned = True
            self.emit(f"[pksampler] warning: the head's loss (without its margin) has not left its starting level "
                      f"after {self.after_steps} steps ({start:.3f} over the first {len(self._first)} steps, "
                      f"{now:.3f} over the last {len(self._last)}): its rows may not be learning; check head.lr, head.scale and model.neck, and "
                      "the effective_rank and mean_cosine of the evaluations (docs/sharded-head.md)")

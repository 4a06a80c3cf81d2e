"""Hooks: everything the training loop does besides the step.

The loop (:class:`pksampler.train.trainer.Trainer`) only runs steps and calls
``before_train``, ``before_epoch``, ``after_step``, ``after_epoch`` and
``after_train`` on its hooks, in order (detectron2's ``HookBase`` shape). A
new feature is a new hook. Hooks get the objects they use when they are
built; they read the loop's progress from ``trainer.state``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from pksampler.files import atomic_write_text

from .rules import ConfigError
from .workspace import EventLog

if TYPE_CHECKING:  # pragma: no cover
    from .trainer import Trainer

__all__ = [
    "BadImageHook",
    "CheckpointHook",
    "EvaluationHook",
    "FinalArtifactsHook",
    "HardNegativeHook",
    "HookBase",
    "MetricsLogHook",
    "ProgressHook",
    "TensorBoardHook",
]


class HookBase:
    """A no-op at every point of the loop; subclasses override what they need."""

    trainer: "Trainer"

    def before_train(self) -> None:
        pass

    def before_epoch(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def after_epoch(self) -> None:
        pass

    def after_train(self) -> None:
        pass


class MetricsLogHook(HookBase):
    """One ``metrics.jsonl`` line per optimizer step (rank 0)."""

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def after_step(self) -> None:
        state = self.trainer.state
        self.log.write(type="step", epoch=state.epoch, step=state.consumed, global_step=state.global_step,
                       loss=state.loss, lr=state.lr, images_per_sec=state.images_per_sec,
                       global_batch=self.trainer.global_batch, time=time.time())


class ProgressHook(HookBase):
    """Rank 0's progress display: a bar on a terminal, plain periodic lines in a log."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress

    def before_epoch(self) -> None:
        self.progress.start_epoch(self.trainer.state.epoch, step=self.trainer.state.consumed)

    def after_step(self) -> None:
        state = self.trainer.state
        self.progress.update(state.consumed, loss=state.loss, images_per_sec=state.images_per_sec, lr=state.lr)

    def after_epoch(self) -> None:
        self.progress.end_epoch()

    def after_train(self) -> None:
        self.progress.close()


class CheckpointHook(HookBase):
    """``last.pt`` every ``every`` steps, at ``max_steps`` (then stop) and after each epoch (rank 0 writes).

    ``save`` may return before the file is written (a background writer);
    ``finish``, called after training, waits for the last write and raises a
    failed one's error.
    """

    def __init__(self, save: Callable[[str], None], *, every: int, max_steps: int | None,
                 finish: Callable[[], None] | None = None) -> None:
        self.save, self.every, self.max_steps, self.finish = save, every, max_steps, finish

    def before_train(self) -> None:
        if self.max_steps is not None and self.trainer.state.global_step >= self.max_steps:
            self.save("last.pt")  # e.g. max_steps=0: the initial parameters
            self.trainer.state.stop = True

    def after_step(self) -> None:
        step = self.trainer.state.global_step
        at_limit = self.max_steps is not None and step >= self.max_steps
        if at_limit or (self.every and step % self.every == 0):
            self.save("last.pt")
        if at_limit:
            self.trainer.state.stop = True

    def after_epoch(self) -> None:
        self.save("last.pt")

    def after_train(self) -> None:
        if self.finish is not None:
            self.finish()


class EvaluationHook(HookBase):
    """Held-out retrieval every ``every`` epochs and after the last; keeps ``best.pt`` by Recall@1."""

    def __init__(self, evaluate: Callable[[int], dict[str, float]], save: Callable[[str], None], *,
                 every: int, epochs: int, is_main: bool) -> None:
        self.evaluate, self.save = evaluate, save
        self.every, self.epochs, self.is_main = every, epochs, is_main

    def after_epoch(self) -> None:
        state = self.trainer.state
        if state.epoch % self.every and state.epoch != self.epochs:
            return
        metrics = self.evaluate(state.epoch)
        if not self.is_main:
            return
        state.final_metrics = metrics
        state.history["eval_epochs"].append(state.epoch)
        state.history["recalls"].append(metrics["recall_at_1"])
        state.history["map_at_r"].append(metrics.get("map_at_r", float("nan")))
        if metrics["recall_at_1"] > state.best:
            state.best = metrics["recall_at_1"]
            self.save("best.pt")


class TensorBoardHook(HookBase):
    """Loss, lr and images/s per step; every metric and the result gallery per evaluation (rank 0)."""

    def __init__(self, writer: Any, last_gallery: Callable[[], Path | None]) -> None:
        self.writer, self.last_gallery = writer, last_gallery
        self._logged_epoch = -1

    def after_step(self) -> None:
        state = self.trainer.state
        self.writer.scalars(state.global_step, loss=state.loss, lr=state.lr, images_per_sec=state.images_per_sec)

    def after_epoch(self) -> None:
        state = self.trainer.state
        evaluated = state.history["eval_epochs"]
        if not evaluated or evaluated[-1] != state.epoch or self._logged_epoch == state.epoch:
            return
        self._logged_epoch = state.epoch
        self.writer.metrics(state.global_step, state.final_metrics, epoch=state.epoch)
        gallery = self.last_gallery()
        if gallery is not None:
            self.writer.image("eval/gallery", state.global_step, gallery)
        self.writer.flush()

    def after_train(self) -> None:
        self.writer.close()


class BadImageHook(HookBase):
    """After each epoch: bad images replaced on all ranks, logged; the run stops past ``max_fraction``.

    Each rank's dataset counts the images it could not decode (replaced by
    another member of the class, so batches keep their shape) and the images
    it loaded; the counts are summed over ranks, so every rank takes the same
    decision.
    """

    def __init__(self, dataset: Any, backend: Any, *, max_fraction: float, log: EventLog, is_main: bool) -> None:
        self.dataset, self.backend, self.max_fraction = dataset, backend, max_fraction
        self.log, self.is_main = log, is_main

    def after_epoch(self) -> None:
        local = np.array(self.dataset.bad_image_counts(), dtype=np.int64)
        bad, total = (int(v) for v in self.backend.allgather_numpy(local).sum(axis=0))
        if not bad:
            return
        epoch = self.trainer.state.epoch
        if self.is_main:
            self.log.write(type="bad_images", epoch=epoch, global_step=self.trainer.state.global_step, bad=bad,
                           total=total)
            print(f"[pksampler] epoch {epoch}: {bad} of {total} images could not be decoded and were replaced by "
                  "other images of their class (paths above)", flush=True)
        if bad > self.max_fraction * max(total, 1):
            raise ConfigError(f"data.max_bad_fraction: {bad} of {total} images ({bad / total:.2%}) could not be "
                              f"decoded in epoch {epoch}, more than the allowed {self.max_fraction:.2%}: the data "
                              "looks broken (paths above); fix it or raise data.max_bad_fraction")


class HardNegativeHook(HookBase):
    """Refresh the triplet sampler's class-neighbour table from the current model after each epoch."""

    def __init__(self, refresh: Callable[[], None], *, epochs: int) -> None:
        self.refresh, self.epochs = refresh, epochs

    def after_epoch(self) -> None:
        if self.trainer.state.epoch < self.epochs:
            self.refresh()


class FinalArtifactsHook(HookBase):
    """At the end of a finished run: the curves PNG and ``final_metrics.json`` (rank 0)."""

    def __init__(self, workspace: Path, save_curves: Callable[[Path, dict], None], *, epochs: int) -> None:
        self.workspace, self.save_curves, self.epochs = workspace, save_curves, epochs

    def after_epoch(self) -> None:
        state = self.trainer.state
        if state.epoch == self.epochs:
            self.save_curves(self.workspace / "curves.png", state.history)
            atomic_write_text(self.workspace / "final_metrics.json", json.dumps(_plain(state.final_metrics), indent=2))


def _plain(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in metrics.items()}

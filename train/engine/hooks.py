"""Hooks: everything the training loop does besides the step.

The loop (:class:`pksampler.train.engine.trainer.Trainer`) only runs steps and calls
``before_train``, ``before_epoch``, ``after_step``, ``after_epoch`` and
``after_train`` on its hooks, in order (detectron2's ``HookBase`` shape). A
new feature is a new hook. Hooks get the objects they use when they are
built; they read the loop's progress from ``trainer.state`` and its events
from ``trainer.storage`` (:mod:`.events`): the loop puts each step's scalars
there, :class:`EvaluationHook` and :class:`BadImageHook` put their records,
and the writers read it: one :class:`~.writers.WriterHook` over metrics.jsonl,
TensorBoard and the progress line (:mod:`.writers`), and :class:`FinalArtifactsHook`.

This module imports :class:`HookBase` from the loop, never the reverse.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pksampler.files import atomic_write_text

from pksampler.train.engine.checkpoint import count_non_finite
from pksampler.train.engine.events import EventStorage
from pksampler.train.losses.mining import mine_class_neighbours
from pksampler.train.errors import ConfigError
from pksampler.train.engine.trainer import HookBase, RowWriter, TrainingDiverged, divergence_advice
from pksampler.train.modeling.head_replicas import RangeCopy
from pksampler.train.modeling.range_checkpoint import write_ranges
from pksampler.train.runtime.workspace import writing

__all__ = [
    "BadImageHook",
    "CheckpointHook",
    "EvaluationHook",
    "FinalArtifactsHook",
    "FreezeBackboneHook",
    "HardNegativeHook",
    "HookBase",
    "MainRank",
    "ObjectStoreHook",
    "OnMainRank",
]


#: "this process is the main rank", asked each time (under Horovod elastic rank 0 can change hands when its host
#: leaves); the run mode gives it (:meth:`~.mode.RunMode.is_main`)
MainRank = Callable[[], bool]


class OnMainRank(HookBase):
    """A rank-0 hook in a run whose rank 0 can change (Horovod elastic): built and called only while ``is_main()``.

    ``build()`` makes the hook the first time this process is the main rank,
    so a display or an event file is opened only by the process that uses
    it; after a reset that made this process rank 0 the loop starts again
    with ``before_train``, and the hook from then on.
    """

    def __init__(self, build: Callable[[], HookBase], is_main: Callable[[], bool]) -> None:
        self.build, self.is_main = build, is_main
        self.hook: HookBase | None = None

    def _forward(self, point: str) -> None:
        if not self.is_main():
            return
        if self.hook is None:
            self.hook = self.build()
            self.hook.trainer = self.trainer
        getattr(self.hook, point)()

    def before_train(self) -> None:
        self._forward("before_train")

    def before_epoch(self) -> None:
        self._forward("before_epoch")

    def after_step(self) -> None:
        self._forward("after_step")

    def after_epoch(self) -> None:
        self._forward("after_epoch")

    def after_train(self) -> None:
        self._forward("after_train")

    def on_world_change(self) -> None:
        """The hook built so far hears of it, whichever rank this process is now; none is built for it."""
        if self.hook is not None:
            self.hook.on_world_change()


class CheckpointHook(HookBase):
    """``last.pt`` every ``every`` steps, at ``max_steps`` (then stop) and after each epoch.

    A checkpoint is :meth:`Trainer.state_dict` plus ``metadata`` (format,
    config), handed to ``write(name, checkpoint)``; only the main rank
    (``is_main``) builds and writes it. Registered before evaluation, the
    epoch's checkpoint exists before evaluation runs, so a failure there
    never costs the epoch's training. ``write`` may return before the file
    is on disk (:class:`~.checkpoint.CheckpointWriter`); ``finish``, called
    after training, waits for the last write and raises a failed one's error.

    ``commit``, when set (Horovod elastic, :class:`~.elastic.commit.Commits`),
    is called on every rank before each ``last.pt`` is built: ``last.pt`` is
    then taken only at a commit, so it is never ahead of the step lines in
    ``metrics.jsonl`` (written at commits) nor of the state a reset rolls
    back to. A resume cuts ``metrics.jsonl`` back to ``last.pt``'s step; a
    checkpoint ahead of the log would lose the steps in between for good.
    ``best.pt`` (never resumed from; saved by rank 0 alone) takes no commit.

    ``folder`` (the checkpoints' folder): a sharded head's rows are not
    gathered to rank 0; every rank writes its own range beside the
    checkpoint (``last.shared/``, :mod:`~pksampler.train.modeling.range_checkpoint`)
    and the checkpoint refers to their manifest. None: the whole head inside.
    """

    def __init__(self, write: Callable[[str, dict[str, Any]], None], *, every: int, max_steps: int | None,
                 metadata: dict[str, Any] | None = None, is_main: MainRank = lambda: True,
                 finish: Callable[[], None] | None = None, commit: Callable[[], None] | None = None,
                 folder: Path | None = None) -> None:
        self.write, self.every, self.max_steps, self.folder = write, every, max_steps, folder
        self.metadata, self.is_main, self.finish = dict(metadata or {}), is_main, finish
        self.commit = commit

    def save(self, name: str) -> None:
        """Write the trainer's state as ``name`` (the main rank; a no-op elsewhere).

        Parameters that are NaN or infinite are never written: every rank holds
        the same ones, so every rank raises :class:`TrainingDiverged` together.
        """
        self._check_finite(name)
        self._build_and_write(name)

    def save_last(self) -> None:
        """``last.pt`` (on every rank): finite parameters checked, then ``commit`` if set, then the write."""
        self._check_finite("last.pt")
        if self.commit is not None:
            self.commit()
        self._build_and_write("last.pt")

    def _check_finite(self, name: str) -> None:
        bad = count_non_finite(self.trainer.parts.model.state_dict())
        if bad:
            raise TrainingDiverged(f"the model holds {bad} NaN or infinite parameter value(s) at global step "
                                   f"{self.trainer.state.global_step}; {name} was not written (the last good one is "
                                   f"kept): {divergence_advice(self.trainer.parts.optimizer)}")

    def _build_and_write(self, name: str) -> None:
        # on every rank: each writes its range of a sharded head's rows beside the checkpoint (``folder``)
        state = self.trainer.state_dict(write_rows=self._row_writer(name))
        if self.is_main():
            self.write(name, {**self.metadata, **state})

    def _row_writer(self, name: str) -> RowWriter | None:
        """Each rank's writer of its rows of a shared part, beside checkpoint ``name`` in :attr:`folder`."""
        if self.folder is None:
            return None
        checkpoint, step, backend = self.folder / name, self.trainer.state.global_step, self.trainer.parts.backend

        def write_rows(part: str, rows: int, own: RangeCopy) -> dict[str, Any]:
            # a full disk on any rank: one line on every rank (the files of the checkpoint on disk are untouched)
            with writing(checkpoint.with_suffix(".shared"), f"; the previous {name} is intact"):
                return write_ranges(checkpoint, part, own, num_rows=rows, step=step, collectives=backend)

        return write_rows

    def before_train(self) -> None:
        if self.max_steps is not None and self.trainer.state.global_step >= self.max_steps:
            self.save_last()  # e.g. max_steps=0: the initial parameters
            self.trainer.state.stop = True

    def after_step(self) -> None:
        step = self.trainer.state.global_step
        at_limit = self.max_steps is not None and step >= self.max_steps
        if at_limit or (self.every and step % self.every == 0):
            self.save_last()
        if at_limit:
            self.trainer.state.stop = True

    def after_epoch(self) -> None:
        self.save_last()

    def after_train(self) -> None:
        if self.finish is not None:
            self.finish()


class EvaluationHook(HookBase):
    """Held-out retrieval every ``every`` epochs and after the last; keeps ``best.pt`` by Recall@1.

    ``evaluate(epoch)`` runs on every rank and returns the metrics on the
    main rank; they go to the storage as an ``eval`` record, with the result
    gallery (``gallery()``, a PNG path or None) as an image. ``at_start``: also
    before the first step of a run that starts at step 0 (a run continued from
    another run's model: where it starts is the first point of its curves).
    """

    def __init__(self, evaluate: Callable[[int], dict[str, float]], save: Callable[[str], None], *,
                 every: int, epochs: int, is_main: MainRank, gallery: Callable[[], Path | None] = lambda: None,
                 share: Callable[[bool], bool] = lambda flag: flag, at_start: bool = False) -> None:
        self.evaluate, self.save, self.gallery = evaluate, save, gallery
        self.every, self.epochs, self.is_main = every, epochs, is_main
        self.share = share  # the main rank's "a new best" given to every rank (building best.pt may be collective)
        self.at_start = at_start

    def before_epoch(self) -> None:
        # in before_epoch, not before_train: the writer hook counts the records it finds at its before_train as
        # written already
        state = self.trainer.state
        if self.at_start and state.global_step == 0 and state.consumed == 0:
            self.at_start = False
            metrics = self.evaluate(0)
            if self.is_main():
                self.trainer.storage.put_record("eval", epoch=0, global_step=0, **metrics)

    def after_epoch(self) -> None:
        state = self.trainer.state
        if state.epoch % self.every and state.epoch != self.epochs:
            return
        metrics = self.evaluate(state.epoch)
        improved = self._record(metrics) if self.is_main() else False
        # Every rank saves together: a sharded head gathers its rows from all ranks to build the checkpoint.
        if self.share(improved):
            self.save("best.pt")

    def _record(self, metrics: dict[str, float]) -> bool:
        """The main rank: the eval record and gallery; whether Recall@1 beat the best so far."""
        state, storage = self.trainer.state, self.trainer.storage
        state.final_metrics = metrics
        storage.put_record("eval", epoch=state.epoch, global_step=state.global_step, **metrics)
        gallery = self.gallery()
        if gallery is not None:
            storage.put_image("eval/gallery", state.global_step, gallery)
        if metrics["recall_at_1"] <= state.best:
            return False
        state.best = metrics["recall_at_1"]
        return True


class BadImageHook(HookBase):
    """After each epoch: bad images replaced on all ranks, logged; the run stops past ``max_fraction``.

    Each rank's dataset counts the images it could not decode (replaced by
    another member of the class, so batches keep their shape) and the images
    it loaded; the counts are summed over ranks, so every rank takes the same
    decision.
    """

    def __init__(self, dataset: Any, backend: Any, *, max_fraction: float, is_main: MainRank) -> None:
        self.dataset, self.backend, self.max_fraction = dataset, backend, max_fraction
        self.is_main = is_main

    def after_epoch(self) -> None:
        local = np.array(self.dataset.bad_image_counts(), dtype=np.int64)
        bad, total = (int(v) for v in self.backend.allgather_numpy(local).sum(axis=0))
        if not bad:
            return
        epoch = self.trainer.state.epoch
        if self.is_main():
            self.trainer.storage.put_record("bad_images", epoch=epoch, global_step=self.trainer.state.global_step,
                                            bad=bad, total=total)
            print(f"[pksampler] epoch {epoch}: {bad} of {total} images could not be decoded and were replaced by "
                  "other images of their class (paths above)", flush=True)
        if bad > self.max_fraction * max(total, 1):
            raise ConfigError(f"data.max_bad_fraction: {bad} of {total} images ({bad / total:.2%}) could not be "
                              f"decoded in epoch {epoch}, more than the allowed {self.max_fraction:.2%}: the data "
                              "looks broken (paths above); fix it or raise data.max_bad_fraction")


class ObjectStoreHook(HookBase):
    """After each epoch: the object store's GETs, bytes, GET/s and their cost, summed over ranks and workers.

    Read from the store's shared counters (:meth:`pksampler.datasets.objectstore.ObjectStore.counts`), written to
    ``metrics.jsonl`` as an ``objectstore`` record (run totals) and printed by rank 0. No credential is involved.
    """

    def __init__(self, store: Any, backend: Any, *, is_main: MainRank) -> None:
        self.store, self.backend, self.is_main = store, backend, is_main
        self.started = time.monotonic()

    def after_step(self) -> None:
        if self.trainer.state.stop:  # the run ends here (max_steps): the totals now
            self.after_epoch()

    def after_epoch(self) -> None:
        from pksampler.datasets.objectstore import cost_usd

        local = np.array(self.store.counts(), dtype=np.int64)
        gets, size = (int(v) for v in self.backend.allgather_numpy(local).sum(axis=0))
        seconds = max(time.monotonic() - self.started, 1e-9)
        if self.is_main():
            state = self.trainer.state
            self.trainer.storage.put_record("objectstore", epoch=state.epoch, global_step=state.global_step, gets=gets,
                                            bytes=size, gets_per_s=gets / seconds, cost_usd=cost_usd(gets))
            print(f"[pksampler] object store after epoch {state.epoch}: {gets:,} GETs, {size / 2**20:,.1f} MiB, "
                  f"{gets / seconds:,.1f} GET/s, ${cost_usd(gets):.4f} at $0.0004 per 1,000 GETs", flush=True)


class HardNegativeHook(HookBase):
    """After each epoch but the last: mine a fresh class-neighbour table and give it to the triplet sampler.

    1. ``embed()`` returns the current model's embeddings of the training
       images and their labels, the same on every rank (a collective);
    2. rank 0 mines the table (:func:`pksampler.train.losses.mining.mine_class_neighbours`:
       faiss k-NN of class centroids);
    3. the backend broadcasts it, and every rank hands it to
       ``sampler.set_class_neighbours`` (it applies from the next epoch).

    Registered before the checkpoint hook, so the epoch's checkpoint holds
    the table the next epoch uses.
    """

    def __init__(self, embed: Callable[[], tuple[np.ndarray, np.ndarray]], sampler: Any, backend: Any, *,
                 epochs: int) -> None:
        self.embed, self.sampler, self.backend, self.epochs = embed, sampler, backend, epochs

    def after_epoch(self) -> None:
        if self.trainer.state.epoch >= self.epochs:
            return
        embeddings, labels = self.embed()
        table = None
        if self.backend.rank == 0:
            table = mine_class_neighbours(embeddings, labels, self.sampler.index, self.sampler.hard_classes)
        table = self.backend.broadcast_object(table, name="pksampler.class_neighbours")
        if table is None:
            raise RuntimeError("HardNegativeHook: no class-neighbour table was received from rank 0")
        self.sampler.set_class_neighbours(table)


class FinalArtifactsHook(HookBase):
    """At the end of a finished run (rank 0): the curves PNG, drawn from the storage, and ``final_metrics.json``."""

    def __init__(self, workspace: Path, save_curves: Callable[[Path, EventStorage], None], *, epochs: int) -> None:
        self.workspace, self.save_curves, self.epochs = workspace, save_curves, epochs

    def after_epoch(self) -> None:
        state = self.trainer.state
        if state.epoch == self.epochs:
            self.save_curves(self.workspace / "curves.png", self.trainer.storage)
            atomic_write_text(self.workspace / "final_metrics.json", json.dumps(_plain(state.final_metrics), indent=2))


def _plain(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in metrics.items()}


class FreezeBackboneHook(HookBase):
    """The backbone group's learning rate is 0 while fewer than ``steps`` optimizer steps are done.

    Checked before training (so a run resumed at step s < N stays frozen) and
    after every step, after the schedule has set the next step's rates: the
    steps numbered 0 .. N-1 leave the backbone as it was; step N trains it at
    the schedule's rate. The groups are :func:`~pksampler.train.solver.finetune.parameter_groups`'
    (the backbone's is named ``backbone``).
    """

    def __init__(self, optimizer: Any, *, steps: int) -> None:
        self.optimizer, self.steps = optimizer, steps

    def _apply(self) -> None:
        if self.trainer.state.global_step < self.steps:
            for group in self.optimizer.param_groups:
                if group.get("name") == "backbone":
                    group["lr"] = 0.0

    def before_train(self) -> None:
        self._apply()

    def after_step(self) -> None:
        self._apply()

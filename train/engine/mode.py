"""How a run is driven, chosen once in ``main``: a static world here, Horovod elastic as a subclass.

detectron2's variant by subclass (``AMPTrainer(SimpleTrainer)``) applied to
the application: :func:`pksampler.train.run_setup.assemble` asks the mode
and never branches on the launcher. The questions, each one method:

* :meth:`RunMode.is_main` -- is this process the main rank now (always a
  callable: under Horovod elastic rank 0 can change hands);
* :meth:`RunMode.raise_together` -- a rank's configuration error raised on
  every rank (static), or on its own (elastic: nothing collective runs before
  ``hvd.elastic.run``, a joiner would meet the survivors' state sync);
* :meth:`RunMode.agree` -- a collective check run now (static) or in every
  new world before its first step (elastic);
* :meth:`RunMode.resume` -- rank 0's checkpoint broadcast and the state
  synced now (static), or left to the elastic state sync;
* :meth:`RunMode.metrics_writer`, :meth:`RunMode.main_writers`,
  :meth:`RunMode.writer_hooks` -- metrics.jsonl written directly (static) or
  held until a commit (elastic), and where the one writer hook goes;
* :meth:`RunMode.checkpoints` -- the checkpoint gate: who builds and writes
  ``last.pt``, and the commit it waits for (elastic);
* :meth:`RunMode.run` -- the loop, or the loop inside ``hvd.elastic.run``.

The Horovod elastic mode is :class:`pksampler.train.engine.elastic.run.HorovodElasticMode`;
:func:`pksampler.train.engine.elastic.choose_run_mode` picks one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from pksampler.train.config.agreement import raise_together
from pksampler.train.engine.checkpoint import CheckpointWriter
from pksampler.train.modeling.range_checkpoint import drop_older
from pksampler.train.engine.hooks import CheckpointHook
from pksampler.train.engine.trainer import HookBase, Trainer, TrainState
from pksampler.train.engine.writers import EventWriter, JSONWriter, WriterHook
from pksampler.train.runtime.distributed import Backend
from pksampler.train.runtime.workspace import EventLog, WorkspaceLock

__all__ = ["RunMode"]


class RunMode:
    """A run whose world is fixed from start to end (one process, Horovod, torchrun): the static mode."""

    #: whether each rank keeps in-memory commits of its state (the sharded head's memory check counts them)
    keeps_commits = False

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def is_main(self) -> bool:
        """Whether this process is rank 0 now."""
        return self.backend.rank == 0

    def raise_together(self, error: Exception | None) -> None:
        """Any rank's ``error`` raised on every rank (a collective)."""
        raise_together(self.backend, error)

    def agree(self, check: Callable[[], None]) -> None:
        """A collective check of the ranks' agreement (config, labels): now."""
        check()

    def resume(self, state: dict[str, Any] | None) -> dict[str, Any] | None:
        """Rank 0's checkpoint (or None), given to every rank."""
        if self.backend.size == 1:
            return state
        return self.backend.broadcast_object(state, name="pksampler.resume_state")

    def broadcast_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every rank starts from rank 0's parameters and optimizer state."""
        self.backend.broadcast_state(model, optimizer)

    def share_main(self) -> Callable[[bool], bool]:
        """Rank 0's yes or no, given to every rank (the others say no; a no-op in one process)."""
        def share(flag: bool) -> bool:
            if self.backend.size == 1:
                return flag
            total = self.backend.allreduce_sum(torch.tensor([float(flag)], device=self.backend.device))
            return bool(total.item() > 0)
        return share

    def main_only(self, builders: Sequence[Callable[[], HookBase]]) -> list[HookBase]:
        """Rank-0 hooks from their builders: built now on rank 0, none elsewhere."""
        return [build() for build in builders] if self.is_main() else []

    def main_writers(self, builders: Sequence[Callable[[], EventWriter]]) -> list[EventWriter]:
        """Rank-0 writers (progress, TensorBoard) from their builders: built now on rank 0, none elsewhere."""
        return [build() for build in builders] if self.is_main() else []

    def metrics_writer(self, log: EventLog) -> EventWriter | None:
        """metrics.jsonl: written line by line by rank 0."""
        return JSONWriter(log) if self.is_main() else None

    def writer_hooks(self, hooks: list[HookBase], writers: Sequence[EventWriter]) -> list[HookBase]:
        """The hooks with the one writer hook appended (after evaluation: its records are written with the epoch)."""
        return [*hooks, WriterHook(writers)] if writers else list(hooks)

    def workspace_lock(self, lock: WorkspaceLock | None, workspace: Path) -> WorkspaceLock | None:
        """The workspace's lock (rank 0 holds it)."""
        return lock

    def checkpoints(self, workspace: Path, *, every: int, max_steps: int | None,
                    metadata: dict[str, Any]) -> CheckpointHook:
        """The checkpoint hook: rank 0 builds ``last.pt`` and writes it in a background thread."""
        writer = CheckpointWriter() if self.is_main() else None
        return self._checkpoint_hook(writer, workspace, every=every, max_steps=max_steps, metadata=metadata)

    def _checkpoint_hook(self, writer: CheckpointWriter | None, workspace: Path, *, every: int,
                         max_steps: int | None, metadata: dict[str, Any],
                         commit: Callable[[], None] | None = None) -> CheckpointHook:
        folder = workspace / "checkpoints"

        def write(name: str, checkpoint: dict[str, Any]) -> None:
            if writer is not None and self.is_main():
                # once the file is durable, the range folders of earlier steps are no longer referenced
                step = int(checkpoint["state"]["global_step"])
                writer.save(folder / name, checkpoint, then=lambda: drop_older(folder / name, step))

        return CheckpointHook(write, every=every, max_steps=max_steps, metadata=metadata, is_main=self.is_main,
                              finish=writer.close if writer is not None else None, commit=commit, folder=folder)

    def run(self, trainer: Trainer) -> TrainState:
        """Train to the end."""
        return trainer.train()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world={self.backend.world})"


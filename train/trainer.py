"""The training loop: a short loop that runs steps and calls hooks.

:class:`Trainer` owns the step (forward under autocast, all-gather of the
embeddings so the loss sees the global batch, backward, the optimizer step
through the backend's allreduce) and calls its hooks around it; checkpoints,
the metrics log, progress, evaluation and hard-negative refresh are hooks
(:mod:`.hooks`). :func:`train` assembles a run from a config, once, through
the builders (:mod:`.builders`) and :mod:`.run_setup`.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from .distributed import Backend
from .hooks import HookBase

__all__ = ["StepParts", "TrainResult", "TrainState", "Trainer", "TrainingDiverged", "gather_batch", "main", "train"]


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step (the last good checkpoint stays)."""


@dataclass
class TrainState:
    """Where the run is: read and written by the loop and its hooks, saved in checkpoints."""

    epoch: int = 0  # epochs finished
    global_step: int = 0  # optimizer steps taken
    consumed: int = 0  # batches finished in the current epoch
    best: float = -1.0
    loss: float = math.nan
    lr: float = 0.0
    images_per_sec: float = 0.0
    history: dict[str, list] = field(default_factory=lambda: {"loss_steps": [], "losses": [], "eval_epochs": [],
                                                              "recalls": [], "map_at_r": []})
    final_metrics: dict[str, float] = field(default_factory=dict)
    stop: bool = False


@dataclass
class TrainResult:
    global_step: int
    epochs_done: int
    final_metrics: dict[str, float]
    workspace: Path


@dataclass
class StepParts:
    """What one optimizer step needs, built once by :func:`train`."""

    backend: Backend
    model: torch.nn.Module  # the bare model (state dicts, evaluation)
    train_model: torch.nn.Module  # the model wrapped for data parallelism
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    sampler: Any
    train_set: Any
    epochs: int
    global_batch: int
    workers: int = 0
    gather: bool = True
    passes: int = 1
    scaler: torch.amp.GradScaler | None = None
    loader: Any = None  # a TrainLoader yielding (model inputs, labels) per epoch; None: a DataLoader per epoch


def gather_batch(backend: Backend, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather embeddings (keeping gradients) and labels in one collective.

    Labels travel as an extra float64 column (exact below 2**53), so a step
    pays for one negotiation instead of two.
    """
    packed = torch.cat([embeddings.double(), labels.to(embeddings.device).double()[:, None]], dim=1)
    gathered = backend.allgather(packed)
    return gathered[:, :-1].to(embeddings.dtype), gathered[:, -1].round().long()


class Trainer:
    """Runs epochs of steps and calls hooks; everything else is a hook."""

    def __init__(self, parts: StepParts, hooks: Sequence[HookBase], state: TrainState | None = None) -> None:
        self.parts = parts
        self.state = state if state is not None else TrainState()
        self.resume_sampler_state: dict[str, Any] | None = None
        self._last_loss = torch.zeros(())
        self.hooks: list[HookBase] = []
        self.register(hooks)

    def register(self, hooks: Iterable[HookBase]) -> None:
        """Append ``hooks``; each is called after those registered before it."""
        for hook in hooks:
            hook.trainer = self
            self.hooks.append(hook)

    @property
    def global_batch(self) -> int:
        return self.parts.global_batch

    def train(self) -> TrainState:
        self._call("before_train")
        try:
            while self.state.epoch < self.parts.epochs and not self.state.stop:
                self._call("before_epoch")
                finished = self._run_epoch()
                if not finished:
                    break
                self.state.epoch += 1
                self.state.consumed = 0
                self._call("after_epoch")
        finally:
            self._call("after_train")
        return self.state

    def _call(self, point: str) -> None:
        for hook in self.hooks:
            getattr(hook, point)()

    def _run_epoch(self) -> bool:
        """Steps until the epoch ends (True) or a hook asks to stop (False)."""
        parts, state = self.parts, self.state
        parts.sampler.set_epoch(state.epoch)
        parts.train_set.set_epoch(state.epoch)
        if self.resume_sampler_state is not None and self.resume_sampler_state["epoch"] == state.epoch:
            parts.sampler.load_state_dict(self.resume_sampler_state)  # continue mid-epoch
        self.resume_sampler_state = None
        if parts.loader is not None:  # built once: persistent workers, augmentation on the device
            loader = parts.loader.epoch(state.epoch)
        else:
            loader = torch.utils.data.DataLoader(parts.train_set, batch_sampler=parts.sampler,
                                                 num_workers=parts.workers, pin_memory=parts.backend.setup.pin_memory)
        batches, started, done = parts.sampler.num_batches, time.perf_counter(), 0
        for images, labels in loader:
            last_of_window = (state.consumed + 1) % parts.passes == 0 or state.consumed + 1 == batches
            self.forward_backward(images, labels, reduce=last_of_window)
            state.consumed += 1
            done += 1
            if not last_of_window:
                continue
            self.optimizer_step()
            state.images_per_sec = done * parts.global_batch / max(time.perf_counter() - started, 1e-9)
            self._call("after_step")
            if state.stop:
                return False
        return True

    def sampler_position(self) -> dict[str, Any]:
        """The sampler's resumable position: the next global step of this epoch, or the next epoch's start."""
        position = self.parts.sampler.state_dict(batches_consumed=0)
        position.update(epoch=self.state.epoch, step=self.state.consumed)
        return position

    def forward_backward(self, images: torch.Tensor, labels: torch.Tensor, *, reduce: bool) -> None:
        """Loss on the (gathered) global batch and its backward pass; gradients reduced when ``reduce``."""
        parts, setup = self.parts, self.parts.backend.setup
        parts.train_model.train()
        context = contextlib.nullcontext() if reduce else parts.backend.accumulating(parts.train_model)
        with context:
            with setup.autocast():
                embeddings = parts.train_model(setup.to_device(images))
            embeddings = embeddings.float()
            labels = labels.to(setup.device, non_blocking=True)
            scale = 1.0
            if parts.gather:
                embeddings, labels = gather_batch(parts.backend, embeddings, labels)
                scale = parts.backend.gathered_loss_scale
            loss = parts.loss_fn(embeddings, labels)
            scaled = loss * (scale / parts.passes)
            (parts.scaler.scale(scaled) if parts.scaler is not None else scaled).backward()
        self._last_loss = loss.detach()

    def optimizer_step(self) -> None:
        """Apply the reduced gradients (through the GradScaler in fp16), advance the schedule, check the loss."""
        parts, backend, state = self.parts, self.parts.backend, self.state
        if parts.scaler is None:
            parts.optimizer.step()
        else:
            # Horovod's way: finish the allreduce, unscale, then step without a second synchronize.
            backend.synchronize(parts.optimizer)
            parts.scaler.unscale_(parts.optimizer)
            with backend.skip_synchronize(parts.optimizer):
                parts.scaler.step(parts.optimizer)
            parts.scaler.update()
        parts.optimizer.zero_grad()
        parts.scheduler.step()
        state.global_step += 1
        # Gathered embeddings give every rank the same loss; otherwise average it.
        loss = self._last_loss if parts.gather or backend.size == 1 else backend.allreduce_mean(self._last_loss.reshape(1))[0]
        state.loss = float(loss)
        state.lr = float(parts.scheduler.get_last_lr()[0])
        state.history["loss_steps"].append(state.global_step)
        state.history["losses"].append(state.loss)
        if not math.isfinite(state.loss):
            raise TrainingDiverged(
                f"the loss is {state.loss} at global step {state.global_step} (epoch {state.epoch + 1}); training "
                "stopped. The last good checkpoint is kept: lower optim.lr, raise optim.warmup_steps or check "
                "the data, then resume or start afresh"
            )


def train(config, backend: Backend, extra_hooks: Iterable[HookBase] = ()) -> TrainResult:
    """Run training as ``config`` says on ``backend``; ``extra_hooks`` run after the standard ones."""
    from .run_setup import assemble

    run = assemble(config, backend, extra_hooks)
    try:
        state = run.trainer.train()
    finally:
        run.close()
    return TrainResult(state.global_step, state.epoch, state.final_metrics, run.workspace)


def main(config, extra_hooks: Iterable[HookBase] = ()) -> TrainResult:
    """Initialise the backend chosen by the config and train."""
    from .distributed import make_backend

    backend = make_backend(config.distributed.backend, device=config.train.device, precision=config.train.precision)
    try:
        result = train(config, backend, extra_hooks)
        # Leave together: a rank that exits while another still uses the group
        # (rank 0 writing the last checkpoint) would abort it.
        backend.barrier()
    finally:
        backend.shutdown()
    return result

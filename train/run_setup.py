"""Assemble a training run from its config, in the Horovod order, once.

1. threads and seed; rank 0 takes the workspace (lock, folders, stale temporaries);
2. data and the sampler (P = G / W), failures raised together on every rank;
3. every rank's config and labels compared (a mismatch fails fast, named);
4. model on the rank's device, optimizer (lr scaled with the global batch),
   wrapped for allreduce before any state is loaded, schedule, loss;
5. resume: rank 0 reads ``last.pt`` (tensors and plain data only), checks what
   changed, everyone receives it; parameters and optimizer state broadcast;
6. hooks: metrics log, progress, evaluation, hard negatives, checkpoints,
   final artifacts, then the caller's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from pksampler.files import atomic_write_text

from .agreement import check_ranks_agree, check_resume_compatible, raise_together
from .builders import DataParts, build_data, build_optimizer, build_sampler, build_schedule
from .checkpoint import load_checkpoint, save_checkpoint, to_numpy
from .distributed import Backend
from .heldout import HeldOutEvaluator, embed
from .hooks import (
    BadImageHook,
    CheckpointHook,
    EvaluationHook,
    FinalArtifactsHook,
    HardNegativeHook,
    HookBase,
    MetricsLogHook,
    ProgressHook,
    TensorBoardHook,
)
from .loader import TrainLoader
from .losses import build_loss
from .memory import build_memory
from .model import build_model
from .plots import save_curves_png
from .progress import Progress
from .rules import ConfigError
from .schema import RunConfig
from .tensorboard import TensorBoardWriter
from .trainer import StepParts, Trainer, TrainState
from .workspace import EventLog, WorkspaceLock, prepare_workspace, writing

__all__ = ["Run", "assemble"]


@dataclass
class Run:
    trainer: Trainer
    workspace: Path
    log: EventLog
    lock: WorkspaceLock | None

    def close(self) -> None:
        if self.trainer.parts.loader is not None:
            self.trainer.parts.loader.close()
        self.log.close()
        if self.lock is not None:
            self.lock.release()


def _prepare(config: RunConfig, backend: Backend) -> tuple[WorkspaceLock | None, DataParts, Any]:
    """Workspace (rank 0), data and sampler; any rank's ConfigError is raised on every rank."""
    lock, error, data, sampler = None, None, None, None
    try:
        if backend.rank == 0:
            lock = prepare_workspace(Path(config.workspace))
        data = build_data(config)
        sampler = build_sampler(config.sampler, data.train.labels, backend.size, backend.rank, config.seed)
    except ConfigError as caught:
        error = caught
    try:
        raise_together(backend, error)
    except ConfigError:
        if lock is not None:
            lock.release()
        raise
    return lock, data, sampler


def _step_parts(config: RunConfig, backend: Backend, data: DataParts, sampler: Any) -> StepParts:
    global_batch = sampler.batch_size * backend.size
    if config.model.norm == "sync_batch" and not backend.setup.is_cuda:
        raise ConfigError("model.norm: 'sync_batch' needs GPUs (Horovod's and torch's SyncBatchNorm refuse CPU "
                          f"tensors; this run is on {backend.device}); use 'group' or 'batch' on the CPU")
    norm_class = backend.sync_batch_norm() if config.model.norm == "sync_batch" else None
    model = backend.setup.prepare_model(build_model(config.model, norm_class))
    try:
        memory = build_memory(config.loss.memory, device=backend.device)
        loss_fn = build_loss(config.loss.name, config.loss.args, miner=config.loss.miner, memory=memory)
    except (ValueError, TypeError, ImportError) as error:
        raise ConfigError(str(error)) from None
    loss_fn.to(backend.device)
    # Proxy and classifier losses (pml.ArcFaceLoss, ...) train parameters of their own.
    optimizer = build_optimizer(config.optim, model, global_batch, extra_parameters=loss_fn.parameters())
    # Wrap before loading any state: Horovod's DistributedOptimizer is a new
    # optimizer built from the param groups and does not carry state over.
    train_model, optimizer = backend.wrap(model, optimizer, fp16_allreduce=config.train.fp16_allreduce,
                                          backward_passes_per_step=config.train.backward_passes_per_step)
    passes = config.train.backward_passes_per_step
    total_steps = config.train.epochs * -(-sampler.num_batches // passes)
    return StepParts(
        backend=backend, model=model, train_model=train_model, optimizer=optimizer,
        scheduler=build_schedule(optimizer, config.optim.warmup_steps, total_steps), loss_fn=loss_fn,
        sampler=sampler, train_set=data.train, epochs=config.train.epochs, global_batch=global_batch,
        workers=config.data.workers, gather=config.train.gather_embeddings and backend.size > 1, passes=passes,
        scaler=backend.setup.grad_scaler(),
        loader=TrainLoader(data.train, sampler, data.augment, workers=config.data.workers, setup=backend.setup),
    )


def _checkpoint_state(trainer: Trainer, config: RunConfig) -> dict[str, Any]:
    parts, state = trainer.parts, trainer.state
    saved = {k: v for k, v in asdict(state).items() if k not in ("stop",)}
    return {
        "format": 2,
        "model": parts.model.state_dict(),
        "optimizer": parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "loss": parts.loss_fn.state_dict(),
        "state": saved,
        "sampler": trainer.sampler_position(),
        "world_size": parts.backend.size,
        "config": config.to_dict(),
    }


def _load_resume_state(config: RunConfig, backend: Backend) -> dict[str, Any] | None:
    """Rank 0 reads and checks ``last.pt``; every rank receives it (or the same error)."""
    path = Path(config.workspace) / "checkpoints" / "last.pt"
    state, error = None, None
    if config.train.resume and backend.rank == 0 and path.is_file():
        try:
            state = load_checkpoint(path)
            if state.get("format") != 2:
                raise ConfigError(f"checkpoint {path} was written by another version of pksampler; "
                                  "start afresh with --no-resume or another WORKSPACE")
            check_resume_compatible(state["config"], config.to_dict(), str(path))
        except ConfigError as caught:
            error, state = caught, None
    raise_together(backend, error)
    return backend.broadcast_object(state, name="pksampler.resume_state") if backend.size > 1 else state


def _restore(trainer: Trainer, saved: dict[str, Any]) -> None:
    parts = trainer.parts
    parts.model.load_state_dict(saved["model"])
    parts.optimizer.load_state_dict(saved["optimizer"])
    parts.scheduler.load_state_dict(saved["scheduler"])
    parts.loss_fn.load_state_dict(saved["loss"])
    if parts.scaler is not None and saved.get("scaler"):
        parts.scaler.load_state_dict(saved["scaler"])
    trainer.state = TrainState(**saved["state"])
    trainer.resume_sampler_state = to_numpy(saved["sampler"])


def _hooks(config: RunConfig, trainer: Trainer, data: DataParts, log: EventLog, save) -> list[HookBase]:
    backend, parts = trainer.parts.backend, trainer.parts
    is_main = backend.rank == 0
    workspace = Path(config.workspace)
    evaluator = HeldOutEvaluator(parts.model, data.dataset, data.test, backend, galleries=workspace / "galleries",
                                 gallery_queries=config.train.gallery_queries, log=log, view=data.view)
    hooks: list[HookBase] = [
        EvaluationHook(lambda epoch: evaluator(epoch, trainer.state.global_step), save,
                       every=config.train.eval_every, epochs=config.train.epochs, is_main=is_main),
    ]
    if is_main:
        progress = Progress(parts.sampler.num_batches, config.train.epochs,
                            every_seconds=config.train.progress_every_seconds)
        hooks = [MetricsLogHook(log), ProgressHook(progress), *hooks,
                 FinalArtifactsHook(workspace, _save_curves, epochs=config.train.epochs)]
        if _tensorboard_wanted(config.train.tensorboard):
            hooks.append(TensorBoardHook(TensorBoardWriter(workspace), lambda: evaluator.last_gallery))
    if hasattr(data.train, "bad_image_counts"):
        hooks.append(BadImageHook(data.train, backend, max_fraction=config.data.max_bad_fraction, log=log,
                                  is_main=is_main))
    if getattr(parts.sampler, "negatives", None) == "hard":
        hooks.append(HardNegativeHook(lambda: _refresh_hard_negatives(parts, data, config.data.image_size),
                                      epochs=config.train.epochs))
    hooks.append(CheckpointHook(save, every=config.train.checkpoint_every, max_steps=config.train.max_steps))
    return hooks


def _tensorboard_wanted(setting: bool | None) -> bool:
    """``train.tensorboard``: true, false, or null = on when the tensorboard package is installed."""
    from . import tensorboard

    return tensorboard.available() if setting is None else setting


def _save_curves(path: Path, history: dict[str, list]) -> None:
    save_curves_png(path, history["loss_steps"], history["losses"], history["eval_epochs"], history["recalls"],
                    history.get("map_at_r"))


def _refresh_hard_negatives(parts: StepParts, data: DataParts, image_size: int) -> None:
    """Embed the training images (no augmentation) and give the sampler a fresh class-neighbour table."""
    from pksampler.datasets import LabelledSubset

    # The test subset's uint8 path and device view: no augmentation.
    plain = LabelledSubset(data.dataset, data.train.indices, transform=data.test.transform)
    embeddings = embed(parts.model, plain, parts.backend, view=data.view)
    parts.sampler.update_class_neighbours(embeddings, plain.labels, broadcast=lambda table: parts.backend.broadcast_object(
        table, name="pksampler.class_neighbours"))


def assemble(config: RunConfig, backend: Backend, extra_hooks: Iterable[HookBase] = ()) -> Run:
    """Build every part of a run; the config is read here and nowhere else."""
    torch.set_num_threads(config.train.threads)
    torch.manual_seed(config.seed)
    lock, data, sampler = _prepare(config, backend)
    try:
        # Every input of the sampler's plan (labels, G, K, seed, policies) is in the config and the
        # labels compared here, so the sampler's own consistency check would only repeat it.
        check_ranks_agree(config.to_dict(), data.dataset.labels, backend)
        parts = _step_parts(config, backend, data, sampler)
        trainer = Trainer(parts, [])
        saved = _load_resume_state(config, backend)
        if saved is not None:
            _restore(trainer, saved)
        backend.broadcast_state(parts.model, parts.optimizer)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    workspace = Path(config.workspace)
    is_main = backend.rank == 0
    log = EventLog(workspace / "metrics.jsonl", is_main)
    if saved is not None:
        log.truncate_after(trainer.state.global_step)
    if is_main:
        with writing(workspace / "config.json"):
            atomic_write_text(workspace / "config.json", json.dumps(config.to_dict(), indent=2))
        _announce(config, backend, data, trainer, resumed=saved is not None)

    def save(name: str) -> None:
        if not is_main:
            return
        path = workspace / "checkpoints" / name
        with writing(path, "; the previous checkpoint is intact"):
            save_checkpoint(path, _checkpoint_state(trainer, config))

    trainer.register([*_hooks(config, trainer, data, log, save), *extra_hooks])
    return Run(trainer, workspace, log, lock)


def _announce(config: RunConfig, backend: Backend, data: DataParts, trainer: Trainer, *, resumed: bool) -> None:
    parts, state = trainer.parts, trainer.state
    lr = parts.optimizer.param_groups[0].get("initial_lr", parts.optimizer.param_groups[0]["lr"])
    setup = backend.setup
    print(f"[pksampler] backend={backend.name} world={backend.size} device={setup.device} precision={setup.precision} "
          f"train={len(data.train)} images ({parts.sampler.index.num_classes} classes) test={len(data.test)} images "
          f"({np.count_nonzero(np.bincount(data.test.labels))} classes) batch/rank={parts.sampler.batch_size} "
          f"global={parts.global_batch} lr={lr:.4g} steps/epoch={parts.sampler.num_batches}"
          + (f" resumed at epoch {state.epoch} step {state.consumed}" if resumed else ""), flush=True)
    if state.epoch >= config.train.epochs:
        print(f"[pksampler] {config.workspace} holds a finished run ({state.epoch} epochs); "
              "pass --no-resume (or another WORKSPACE) to train again", flush=True)

"""The application layer: assemble a training run from its config, in the Horovod order, once.

:func:`train` and :func:`main` live here (detectron2's ``defaults.py`` over
``train_loop.py``): this module knows the config and imports the loop
(:mod:`.trainer`) and the hooks, never the other way round. ``main`` chooses
how the run is driven once (:class:`~.engine.mode.RunMode`: static, or
Horovod elastic); every step below asks that mode and none branches on it.

1. threads and seed; rank 0 takes the workspace (lock, folders, stale temporaries);
2. data and the sampler (P = G / W, or its ceil/floor), a rank's failure raised as the mode says;
3. every rank's config and labels compared (a mismatch fails fast, named), now or in each new world;
4. model on the rank's device, optimizer (lr scaled with the global batch),
   wrapped for allreduce before any state is loaded, schedule, loss;
5. resume: rank 0 reads ``last.pt`` (tensors and plain data only), checks what
   changed, the mode hands it to every rank (a broadcast, or the elastic state
   sync) and it is loaded (:meth:`Trainer.load_state_dict`); rank 0 reads the
   run's events back from ``metrics.jsonl``;
6. hooks: hard negatives, bad images, checkpoints (before evaluation; the mode's
   gate), evaluation, final artifacts, the one writer hook (metrics.jsonl, the
   progress line, TensorBoard) where the mode puts it, then the caller's.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from pksampler.datasets import LabelledSubset
from pksampler.files import atomic_write_text

from pksampler.train.config.agreement import check_ranks_agree, check_resume_compatible
from pksampler.train.builders import (DataParts, build_data, build_optimizer, build_sampler, build_schedule,
                                      heldout_note, shard_ids_of, split_gaps, warmup_length)
from pksampler.train.engine.checkpoint import (CheckpointError, check_training_checkpoint, count_non_finite,
                                              load_checkpoint)
from pksampler.train.engine.datacheck import IndexDigestHook
from pksampler.train.runtime.device import make_deterministic
from pksampler.train.runtime.distributed import Backend, make_backend
from pksampler.train.engine.events import EventStorage
from pksampler.train.engine.norm_stats import NormStatisticsHook, running_statistics
from pksampler.train.engine.stall import HeadScalarsHook, HeadStallHook
from pksampler.train.evaluation.collapse import COLLAPSE_KEYS
from pksampler.train.evaluation.heldout import HeldOutEvaluator, embed
from pksampler.train.evaluation.image_level import ImageLevelEvaluator
from pksampler.train.engine.continuation import Continuation, class_record, continue_from, recorded_known
from pksampler.train.engine.hooks import (
    ObjectStoreHook,
    BadImageHook,
    CheckpointHook,
    EvaluationHook,
    FinalArtifactsHook,
    FreezeBackboneHook,
    HardNegativeHook,
    HookBase,
)
from pksampler.train.engine.mode import RunMode
from pksampler.train.engine.writers import EventWriter, ProgressWriter, TensorBoardEventWriter
from pksampler.train.runtime.loader import TrainLoader
from pksampler.train.losses.pair import build_loss
from pksampler.train.losses.memory import build_memory
from pksampler.train.modeling.model import build_model
from pksampler.train.engine.plots import save_curves_png
from pksampler.train.modeling.pretrained import load_pretrained
from pksampler.train.modeling.range_checkpoint import located
from pksampler.train.engine.progress import Progress
from pksampler.train.errors import ConfigError
from pksampler.train.config.schema import RunConfig, TrainConfig
from pksampler.train.engine.tensorboard import TensorBoardWriter, available as tensorboard_available
from pksampler.train.engine.elastic import choose_run_mode
from pksampler.train.engine.cached_step import CachedTrainer, check_chunkable
from pksampler.train.engine.global_neck import GlobalNeck, per_rank_norms
from pksampler.train.losses.headed import HeadedLoss
from pksampler.train.modeling.head_memory import check_head_memory
from pksampler.train.solver.sparse_rows import SparseRowSGD
from pksampler.train.engine.trainer import StepParts, Trainer, TrainState, replay_history
from pksampler.train.runtime.workspace import EventLog, WorkspaceLock, prepare_workspace, writing

__all__ = ["CHECKPOINT_FORMAT", "Run", "TrainResult", "assemble", "main", "train"]

#: the layout of ``last.pt``/``best.pt``: :meth:`Trainer.state_dict` plus ``format`` and ``config``
CHECKPOINT_FORMAT = 2


@dataclass
class TrainResult:
    global_step: int
    epochs_done: int
    final_metrics: dict[str, float]
    workspace: Path


@dataclass
class Run:
    trainer: Trainer
    workspace: Path
    log: EventLog
    lock: WorkspaceLock | None
    #: how the run is driven (static, or Horovod elastic: :mod:`.engine.mode`)
    mode: RunMode

    def train(self) -> TrainState:
        return self.mode.run(self.trainer)

    def close(self) -> None:
        if self.trainer.parts.loader is not None:
            self.trainer.parts.loader.close()
        self.log.close()
        if self.lock is not None:
            self.lock.release()


def _prepare(config: RunConfig, backend: Backend, mode: RunMode) -> tuple[WorkspaceLock | None, DataParts, Any]:
    """Workspace (rank 0), data and sampler; a rank's ConfigError raised as the run mode says (on every rank)."""
    lock, error, data, sampler = None, None, None, None
    try:
        if backend.rank == 0:
            lock = prepare_workspace(Path(config.workspace))
        data = build_data(config)
        try:
            sampler = build_sampler(config.sampler, data.train.labels, backend.size, backend.rank, config.seed,
                                    shard_ids=shard_ids_of(data.train))
        except ConfigError as refused:
            raise ConfigError(f"{refused}{heldout_note(data, config.data)}") from None
    except ConfigError as caught:
        error = caught
    try:
        mode.raise_together(error)
    except ConfigError:
        if lock is not None:
            lock.release()
        raise
    return lock, data, sampler


def _model(config: RunConfig, backend: Backend, model: torch.nn.Module | None) -> torch.nn.Module:
    """The caller's model, or the one ``model:`` configures; on the rank's device either way."""
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"train(model=) expects a torch.nn.Module mapping images to embeddings, "
                            f"got {type(model).__name__}")
        return backend.setup.prepare_model(model)
    if config.model.norm == "sync_batch" and not backend.setup.is_cuda:
        raise ConfigError("model.norm: 'sync_batch' needs GPUs (Horovod's and torch's SyncBatchNorm refuse CPU "
                          f"tensors; this run is on {backend.device}); use 'group' or 'batch' on the CPU")
    norm_class = backend.sync_batch_norm() if config.model.norm == "sync_batch" else None
    return backend.setup.prepare_model(build_model(config.model, norm_class, image_size=config.data.image_size))


def _headed_loss(config: RunConfig, backend: Backend, mode: RunMode, pair: Any, *, num_classes: int,
                 global_batch: int) -> tuple[HeadedLoss, SparseRowSGD]:
    """The pair loss with the sharded head of ``head:`` in this rank's world, and the rows' optimizer; the host's
    memory planned first, as the run mode says (Horovod elastic: its committed copies counted, and no collective,
    since a joiner builds its head before it meets the survivors; otherwise every rank agrees in one)."""
    elastic = mode.keeps_commits
    check_head_memory(num_classes, config.model.embedding_dim, config.head.subcentres, world=backend.size,
                      local_ranks=backend.local_size, elastic=elastic, collectives=None if elastic else backend)
    loss_fn = HeadedLoss.from_config(config, backend, pair, num_classes=num_classes, world=backend.world,
                                     gathered=config.train.gather_embeddings, elastic=elastic)
    return loss_fn, SparseRowSGD.from_config(config, loss_fn.head, global_batch=global_batch)


def _step_parts(config: RunConfig, backend: Backend, mode: RunMode, data: DataParts, sampler: Any,
                model: torch.nn.Module | None = None) -> StepParts:
    global_batch = sampler.global_batch_size  # per-rank sizes differ when W does not divide G
    model = _model(config, backend, model)
    try:
        memory = build_memory(config.loss.memory, device=backend.device)
        loss_fn = build_loss(config.loss.name, config.loss.args, miner=config.loss.miner, memory=memory)
    except (ValueError, TypeError, ImportError) as error:
        raise ConfigError(str(error)) from None
    loss_fn.to(backend.device)
    row_optimizers, shared = (), ()
    if config.head.name is not None:
        classes = int(np.asarray(data.dataset.labels).max()) + 1
        loss_fn, rows = _headed_loss(config, backend, mode, loss_fn, num_classes=classes, global_batch=global_batch)
        row_optimizers, shared = (rows,), (loss_fn,)  # the head's rows: a share of the world
        loss_fn.to(backend.device)
    # Proxy and classifier losses (pml.ArcFaceLoss, ...) train parameters of their own.
    optimizer = build_optimizer(config.optim, model, global_batch,
                                extra_parameters=[p for p in loss_fn.parameters() if p.requires_grad],
                                freeze_backbone_steps=config.model.freeze_backbone_steps)
    # A BatchNorm neck normalises the gathered global batch, when the step gathers (the same model at any W).
    neck = GlobalNeck.of(model, lambda: backend.gathered_loss_scale) if config.train.gather_embeddings else None
    # Wrap before loading any state: Horovod's DistributedOptimizer is a new
    # optimizer built from the param groups and does not carry state over.
    train_model, optimizer = backend.wrap(model, optimizer, fp16_allreduce=config.train.fp16_allreduce,
                                          backward_passes_per_step=config.train.backward_passes_per_step,
                                          replicated=neck.names if neck is not None else ())
    passes = config.train.backward_passes_per_step
    steps_per_epoch = optimizer_steps(sampler.num_batches, passes)
    epochs = run_epochs(config.train, steps_per_epoch)
    total_steps = epochs * steps_per_epoch
    return StepParts(
        backend=backend, model=model, train_model=train_model, optimizer=optimizer,
        scheduler=build_schedule(optimizer, warmup_length(config.optim, total_steps), total_steps), loss_fn=loss_fn,
        sampler=sampler, train_set=data.train, epochs=epochs, global_batch=global_batch,
        workers=config.data.workers, gather=config.train.gather_embeddings, passes=passes,
        scaler=backend.setup.grad_scaler(), seed=config.seed,
        loader=TrainLoader(data.train, sampler, data.augment, workers=config.data.workers, setup=backend.setup),
        row_optimizers=row_optimizers, shared=shared, clip_grad_norm=config.optim.clip_grad_norm, neck=neck,
    )


def world_size_note(config: RunConfig, parts: StepParts) -> str | None:
    """The start-up line for a run whose config trains another model at another world size, or None.

    Per-rank statistics do that: BatchNorm in the backbone trained from scratch
    (``model.norm: batch``), and any loss or neck that sees only its rank's rows
    (``train.gather_embeddings: false``). docs/trainer.md lists what is invariant.
    """
    reasons = []
    layers = per_rank_norms(parts.model, apart=_neck_module(parts))
    if layers:
        reasons.append(f"{len(layers)} BatchNorm layer(s) normalise each rank's own images ({layers[0]}, ...: "
                       f"model.norm={config.model.norm!r}; model.freeze_norm: true or model.norm: group is invariant)")
    if not config.train.gather_embeddings:
        reasons.append("train.gather_embeddings: false (the loss sees each rank's rows, not the global batch)")
    if not reasons:
        return None
    return ("[pksampler] note: this config trains a different model at each world size: " + "; ".join(reasons)
            + " (docs/trainer.md, 'The same model at any world size')")


def _neck_module(parts: StepParts) -> torch.nn.Module | None:
    """The model's neck when the step applies it to the gathered batch (:class:`GlobalNeck`), else None."""
    return parts.neck.module if isinstance(parts.neck, GlobalNeck) else None


def _trainer(config: RunConfig, parts: StepParts) -> Trainer:
    """The loop: the plain step, or the gradient-cached one when ``train.chunk_size`` is set."""
    chunk_size = config.train.chunk_size
    if chunk_size is None:
        return Trainer(parts, [])
    check_chunkable(parts.model, chunk_size, apart=_neck_module(parts))
    return CachedTrainer(parts, [], chunk_size=chunk_size)


def run_epochs(train: TrainConfig, steps_per_epoch: int) -> int:
    """Epochs of the run: ``train.epochs``, or ``train.steps`` rounded to whole epochs (at least one)."""
    if train.steps is None:
        return train.epochs
    return max(1, round(train.steps / steps_per_epoch))


def _load_resume_state(config: RunConfig, backend: Backend, mode: RunMode) -> dict[str, Any] | None:
    """Rank 0 reads and checks ``last.pt``; the run mode hands it (or the error) to every rank."""
    path = Path(config.workspace) / "checkpoints" / "last.pt"
    state, error = None, None
    if config.train.resume and backend.rank == 0 and path.is_file():
        try:
            state = located(load_checkpoint(path), path)  # its range files' manifest, for every rank
            if state.get("format") != CHECKPOINT_FORMAT:
                raise ConfigError(f"checkpoint {path} was written by another version of pksampler; "
                                  "start afresh with --no-resume or another WORKSPACE")
            check_training_checkpoint(state, path)
            check_resume_compatible(state["config"], config.to_dict(), str(path))
            bad = count_non_finite(state["model"])
            if bad:
                raise CheckpointError(f"checkpoint {path} holds {bad} NaN or infinite parameter value(s) (a run that "
                                      "diverged); resume from an earlier copy or start afresh with --no-resume")
        except ConfigError as caught:
            error, state = caught, None
    mode.raise_together(error)
    return mode.resume(state)


def _evaluation(config: RunConfig, parts: StepParts, data: DataParts,
                known: np.ndarray | None) -> tuple[HeldOutEvaluator, Callable[[int, int], dict[str, float]]]:
    """The held-out classes' evaluator, and the evaluation the hook runs: it, then (``data.heldout_images``) the
    image-level one inside the training classes, ``known`` and new apart for a continued run (or its resume)."""
    search = {"index": config.eval.index, "nprobe": config.eval.nprobe, "check_queries": config.eval.check_queries}
    common = dict(queries=config.eval.queries, seed=config.seed, search=search,
                  max_bad_fraction=config.data.max_bad_fraction, view=data.view)
    evaluator = HeldOutEvaluator(parts.model, data.dataset, data.test, parts.backend,
                                 galleries=Path(config.workspace) / "galleries",
                                 gallery_queries=config.train.gallery_queries, **common)
    if not data.heldout.size:
        return evaluator, evaluator
    images = ImageLevelEvaluator(parts.model, data.dataset, data.train.indices, data.heldout, parts.backend,
                                 transform=data.test.transform,
                                 known=known, **common)
    return evaluator, lambda epoch, step: {**evaluator(epoch, step), **images(epoch, step)}


def _hooks(config: RunConfig, trainer: Trainer, data: DataParts, log: EventLog, checkpoints: CheckpointHook,
           mode: RunMode, continuation: Continuation | None = None,
           known: np.ndarray | None = None) -> list[HookBase]:
    """The standard hooks in their order: the epoch's checkpoint is written before evaluation; the one writer
    hook (metrics.jsonl, progress, TensorBoard) where the run mode puts it."""
    backend, parts = trainer.parts.backend, trainer.parts
    workspace = Path(config.workspace)
    evaluator, evaluate = _evaluation(config, parts, data, known)
    hooks: list[HookBase] = []
    if getattr(parts.sampler, "needs_class_neighbours", False):
        hooks.append(HardNegativeHook(lambda: _embed_training_set(parts, data, config.data.image_size),
                                      parts.sampler, backend, epochs=parts.epochs))
    hooks.append(BadImageHook(data.train, backend, max_fraction=config.data.max_bad_fraction,
                              is_main=mode.is_main))
    if data.dataset.verifiable:  # shard sets: the full index digest, once per host
        hooks.append(IndexDigestHook(data.dataset, backend))
    # they add to the step's record, so they run before the writer hook wherever the mode puts it (Horovod
    # elastic: first, and its log holds the line as it sees it)
    recorders: list[HookBase] = []
    if isinstance(parts.loss_fn, HeadedLoss):
        headed = parts.loss_fn  # every rank records the head's numbers (the elastic log buffers on each)
        recorders.append(HeadScalarsHook(headed.step_scalars))
        hooks += mode.main_only([lambda: HeadStallHook(lambda: headed.head.last_softmax_loss)])
    if config.model.freeze_backbone_steps:
        hooks.append(FreezeBackboneHook(parts.optimizer, steps=config.model.freeze_backbone_steps))
    apart = _neck_module(parts)  # the neck on the gathered batch: its statistics agree already
    # before the epoch's checkpoint and evaluation; built at any W (at W = 1 the mean is the statistics themselves)
    if running_statistics(parts.model, apart=apart):
        hooks.append(NormStatisticsHook(parts.model, backend.allreduce_mean, lambda: backend.world, apart=apart))
    hooks += [
        checkpoints,
        EvaluationHook(lambda epoch: evaluate(epoch, trainer.state.global_step), checkpoints.save,
                       every=config.train.eval_every, epochs=parts.epochs, is_main=mode.is_main,
                       gallery=lambda: evaluator.last_gallery, share=mode.share_main(),
                       at_start=continuation is not None),
    ]
    if data.dataset.store is not None:  # after the checkpoint hook: it sees a max_steps stop at the same step
        hooks.append(ObjectStoreHook(data.dataset.store, backend, is_main=mode.is_main))
    hooks += mode.main_only([lambda: FinalArtifactsHook(workspace, _save_curves, epochs=parts.epochs)])
    return [*recorders, *mode.writer_hooks(hooks, _writers(config, parts.sampler.num_batches, parts.epochs, log, mode))]


def optimizer_steps(batches: int, passes: int) -> int:
    """Optimizer steps in an epoch of ``batches``, each step ``passes`` batches (the last perhaps fewer)."""
    return -(-batches // passes)


def stop_batch(max_steps: int | None, batches_per_epoch: int, passes: int) -> int | None:
    """The batch position (epochs × batches + batch) at which ``train.max_steps`` optimizer steps are done, each
    step ``passes`` batches and an epoch's last step perhaps fewer; None: no such stop."""
    if max_steps is None:
        return None
    epochs, steps = divmod(max_steps, optimizer_steps(batches_per_epoch, passes))
    return epochs * batches_per_epoch + min(steps * passes, batches_per_epoch)


def _writers(config: RunConfig, steps_per_epoch: int, epochs: int, log: EventLog, mode: RunMode) -> list[EventWriter]:
    """The run's event writers: the progress line (in batches, its eta to ``train.max_steps`` when that comes
    first), metrics.jsonl, TensorBoard (when wanted)."""
    workspace = Path(config.workspace)
    stop = stop_batch(config.train.max_steps, steps_per_epoch, config.train.backward_passes_per_step)
    shown = mode.main_writers([lambda: ProgressWriter(Progress(steps_per_epoch, epochs, stop_at=stop,
                                                               every_seconds=config.train.progress_every_seconds))])
    metrics = mode.metrics_writer(log)
    board = mode.main_writers([lambda: TensorBoardEventWriter(TensorBoardWriter(workspace))]
                              if _tensorboard_wanted(config.train.tensorboard) else [])
    return [*shown, *([metrics] if metrics is not None else []), *board]


def _start_afresh(workspace: Path, log: EventLog, is_main: bool) -> None:
    """A run that starts from step 0 owns the workspace's history: an earlier run's step lines, checkpoints and
    results would otherwise sit beside its own (a restart before the first checkpoint logged its steps twice)."""
    log.truncate_after(-1)
    if is_main:
        for stale in (workspace / "checkpoints" / "last.pt", workspace / "checkpoints" / "best.pt",
                      workspace / "final_metrics.json"):
            stale.unlink(missing_ok=True)
            shutil.rmtree(stale.with_suffix(".shared"), ignore_errors=True)


def _tensorboard_wanted(setting: bool | None) -> bool:
    """``train.tensorboard``: true, false, or null = on when the tensorboard package is installed."""
    return tensorboard_available() if setting is None else setting


def _save_curves(path: Path, storage: EventStorage) -> None:
    """The curves PNG from the run's events: loss per step, retrieval per evaluation."""
    steps, losses = storage.series("loss")
    evaluations = storage.records("eval")
    save_curves_png(path, steps, losses, [r["epoch"] for r in evaluations], [r["recall_at_1"] for r in evaluations],
                    [r.get("map_at_r", float("nan")) for r in evaluations],
                    collapse={key: [r.get(key, float("nan")) for r in evaluations] for key in COLLAPSE_KEYS})


def _embed_training_set(parts: StepParts, data: DataParts, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Embeddings of the training images (no augmentation) and their labels, the same on every rank."""
    # The test subset's uint8 path and device view: no augmentation.
    plain = LabelledSubset(data.dataset, data.train.indices, transform=data.test.transform)
    return embed(parts.model, plain, parts.backend, view=data.view), plain.labels


def assemble(config: RunConfig, backend: Backend, extra_hooks: Iterable[HookBase] = (), *,
             model: torch.nn.Module | None = None, mode: RunMode | None = None) -> Run:
    """Build every part of a run; the config is read here and nowhere else.

    ``mode``: how the run is driven (:mod:`.engine.mode`); by default the one :func:`main` would choose.
    """
    mode = mode if mode is not None else choose_run_mode(backend, commit_every=config.train.commit_every)
    torch.set_num_threads(config.train.threads)
    torch.manual_seed(config.seed)
    lock, data, sampler = _prepare(config, backend, mode)
    try:
        # Every input of the sampler's plan (labels, G, K, seed, policies) is in the config and the
        # labels compared here, so the sampler's own consistency check would only repeat it.
        mode.agree(lambda: check_ranks_agree(config.to_dict(), data.dataset.labels, backend))
        parts = _step_parts(config, backend, mode, data, sampler, model)
        trainer = _trainer(config, parts)
        saved = _load_resume_state(config, backend, mode)
        continuation = None
        if saved is not None:  # a rank that cannot read its range files fails every rank
            mode.raise_together(_load_into(lambda: trainer.load_state_dict(saved), Path(config.workspace)))
        elif config.train.init_from:
            continuation = _continue(config, parts, data, mode)
        elif config.model.pretrained:
            load_pretrained(parts.model, config.model.pretrained, backend, name=config.model.backbone)
        mode.broadcast_state(parts.model, parts.optimizer)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    workspace = Path(config.workspace)
    # a continued run's known classes: from the run it continued, or (a resume of it) from its own checkpoint
    known = continuation.known if continuation is not None else recorded_known(saved, len(data.dataset.classes))
    log = _open_log(config, backend, data, trainer, resumed=saved is not None, continuation=continuation)
    checkpoints = mode.checkpoints(workspace, every=config.train.checkpoint_every, max_steps=config.train.max_steps,
                                   metadata={"format": CHECKPOINT_FORMAT, "config": config.to_dict(),
                                             "classes": class_record(data.dataset.classes, data.train.labels, known)})
    trainer.register([*_hooks(config, trainer, data, log, checkpoints, mode, continuation, known), *extra_hooks])
    if saved is not None:  # the parts the hooks share, from the checkpoint (each rank its range's files)
        mode.raise_together(_load_into(trainer.load_saved_shares, workspace))
    return Run(trainer, workspace, log, mode.workspace_lock(lock, workspace), mode)


def _continue(config: RunConfig, parts: StepParts, data: DataParts, mode: RunMode) -> Continuation:
    """``train.init_from``: the model and the head's rows of another run, matched to this run's classes by name."""
    return continue_from(config.train.init_from, model=parts.model, loss_fn=parts.loss_fn,
                         names=data.dataset.classes, train_labels=data.train.labels, test_labels=data.test.labels,
                         plain_train=LabelledSubset(data.dataset, data.train.indices, transform=data.test.transform),
                         view=data.view, backend=parts.backend, rows=config.train.init_rows,
                         agree=mode.raise_together)


def _load_into(load: Callable[[], None], workspace: Path) -> CheckpointError | None:
    """``load()`` (the resumed state into the trainer); a checkpoint that does not fit this run: the error naming
    it."""
    try:
        load()
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        reason = " ".join(line.strip() for line in str(error).splitlines()[:2])[:300] or type(error).__name__
        return CheckpointError(f"checkpoint {workspace / 'checkpoints' / 'last.pt'} does not fit this run "
                               f"({type(error).__name__}: {reason}); start afresh with --no-resume or another "
                               "WORKSPACE")
    return None


def _open_log(config: RunConfig, backend: Backend, data: DataParts, trainer: Trainer, *, resumed: bool,
              continuation: Continuation | None = None) -> EventLog:
    """metrics.jsonl cut back to the checkpoint (its history replayed) or started afresh; config.json; the
    start line (rank 0)."""
    workspace = Path(config.workspace)
    is_main = backend.rank == 0
    log = EventLog(workspace / "metrics.jsonl", is_main)
    if resumed:
        log.truncate_after(trainer.state.global_step)
        if is_main:
            replay_history(trainer, workspace / "metrics.jsonl")
    else:
        _start_afresh(workspace, log, is_main)
    if is_main:
        with writing(workspace / "config.json"):
            atomic_write_text(workspace / "config.json", json.dumps(config.to_dict(), indent=2))
        _announce(config, backend, data, trainer, resumed=resumed)
        if continuation is not None:
            print(continuation.line(), flush=True)
    return log


def train(config: RunConfig, backend: Backend, extra_hooks: Iterable[HookBase] = (), *,
          model: torch.nn.Module | None = None, mode: RunMode | None = None) -> TrainResult:
    """Run training as ``config`` says on ``backend``; ``extra_hooks`` run after the standard ones.

    ``model`` replaces the configured one (``model:`` is then not read): any
    ``torch.nn.Module`` that maps an image batch ``(B, 3, H, W)`` to
    embeddings ``(B, D)``. It is moved to the rank's device, wrapped for
    allreduce, checkpointed and evaluated like the built-in model; the
    losses expect L2-normalised rows, so end it with a normalisation. A
    resumed run must be given the same architecture.

    Example::

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.AdaptiveAvgPool2d(1),
                                                torch.nn.Flatten(), torch.nn.Linear(16, 32))

            def forward(self, images):
                return torch.nn.functional.normalize(self.body(images), dim=1)

        result = train(load_config("configs/demo.yaml"), Backend(), model=Net())
    """
    run = assemble(config, backend, extra_hooks, model=model, mode=mode)
    try:
        state = run.train()
    finally:
        run.close()
    return TrainResult(state.global_step, state.epoch, state.final_metrics, run.workspace)


def main(config: RunConfig, extra_hooks: Iterable[HookBase] = (), *,
         model: torch.nn.Module | None = None) -> TrainResult:
    """Initialise the backend chosen by the config, choose the run mode (static or Horovod elastic), train."""
    if config.train.deterministic:
        make_deterministic()  # before hvd.init, which reads the fusion settings once
    backend = make_backend(config.distributed.backend, device=config.train.device, precision=config.train.precision,
                           collective_timeout=config.train.collective_timeout,
                           horovod_wait=config.distributed.horovod_wait)
    try:
        mode = choose_run_mode(backend, commit_every=config.train.commit_every)
        try:
            result = train(config, backend, extra_hooks, model=model, mode=mode)
        except RuntimeError as error:
            backend.raise_if_timed_out(error)  # a rank stopped responding: one message naming it
            raise
        # Leave together: a rank that exits while another still uses the group
        # (rank 0 writing the last checkpoint) would abort it.
        backend.barrier()
    finally:
        backend.shutdown()
    return result


def _announce(config: RunConfig, backend: Backend, data: DataParts, trainer: Trainer, *, resumed: bool) -> None:
    parts, state = trainer.parts, trainer.state
    lr = parts.optimizer.param_groups[0].get("initial_lr", parts.optimizer.param_groups[0]["lr"])
    setup = backend.setup
    print(f"[pksampler] backend={backend.name} world={backend.size} device={setup.device} precision={setup.precision} "
          + (f"process_group={backend.process_group} " if backend.process_group else "")
          + f"train={len(data.train)} images ({parts.sampler.index.num_classes} classes) test={len(data.test)} images "
          f"({np.count_nonzero(np.bincount(data.test.labels))} classes)"
          + (f" +{data.heldout.size} held-out images of training classes" if data.heldout.size else "")
          + f" batch/rank={parts.sampler.batch_size} "
          f"global={parts.global_batch} lr={lr:.4g} epochs={parts.epochs} steps/epoch={parts.sampler.num_batches}"
          + (f" chunk={trainer.chunk_size}" if isinstance(trainer, CachedTrainer) else "")
          + (f" head={config.head.name} classes={parts.loss_fn.head.num_classes} rows/rank={parts.loss_fn.head.rows.shape[0]}"
             if isinstance(parts.loss_fn, HeadedLoss) else "")
          + (f" resumed at epoch {state.epoch} step {state.consumed}" if resumed else ""), flush=True)
    if data.dataset.sources():
        print("[pksampler] datasets: " + ", ".join(f"{name} {images} images {classes} classes"
                                                   for name, images, classes in data.dataset.sources())
              + f"; trained as one set of {len(data.dataset)} images, {data.dataset.num_classes} classes named "
              "<dataset>/<class>", flush=True)
    for warning in split_gaps(data, config.data):
        print(f"[pksampler] warning: {warning}", flush=True)
    note = world_size_note(config, parts)
    if note:
        print(note, flush=True)
    if state.epoch >= parts.epochs:
        print(f"[pksampler] {config.workspace} holds a finished run ({state.epoch} epochs); "
              "pass --no-resume (or another WORKSPACE) to train again", flush=True)

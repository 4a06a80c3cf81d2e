"""The training loop: a short loop that runs steps and calls hooks.

:class:`Trainer` owns the step (forward under autocast, all-gather of the
embeddings so the loss sees the global batch, backward, the optimizer step
through the backend's allreduce) and calls its hooks around it; checkpoints,
the metrics log, progress, evaluation and hard-negative refresh are hooks
(:mod:`.hooks`), which import :class:`HookBase` from here. The loop and the
hooks put their scalars in one :class:`~.events.EventStorage`. The trainer
owns its state (:meth:`Trainer.state_dict`); checkpoints save what it gives.

This module knows no config: :func:`pksampler.train.run_setup.train` (the
application layer) assembles a run from a config, once, through the
builders, and imports this loop, never the other way round.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from pksampler.world import World

from pksampler.train.engine.checkpoint import to_numpy
from pksampler.train.modeling.head_replicas import RangeCopy
from pksampler.train.modeling.range_checkpoint import load_part
from pksampler.train.modeling.sharded_head import row_range
from pksampler.train.runtime.device import loader_generator
from pksampler.train.runtime.distributed import Backend
from pksampler.train.engine.events import EventStorage

__all__ = ["HookBase", "StepParts", "TrainState", "Trainer", "TrainingDiverged", "clip_gradients", "divergence_advice",
           "gather_batch", "replay_history"]


class HookBase:
    """A no-op at every point of the loop; subclasses override what they need.

    The loop calls ``before_train``, ``before_epoch``, ``after_step``,
    ``after_epoch`` and ``after_train`` on its hooks in the order they were
    registered (detectron2's ``HookBase`` shape); ``self.trainer`` is set on
    registration. ``on_world_change`` is called when the set of ranks changes
    (:meth:`Trainer.set_world`, a Horovod elastic reset), after every part that
    owns a share has taken the new world and before the loop starts again with
    ``before_train``; a loop left by such a change does not call ``after_train``.
    """

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

    def on_world_change(self) -> None:
        pass

    def shares(self) -> Sequence[Any]:
        """Parts this hook owns that hold a share of the world (a sharded table it keeps): added to
        :attr:`StepParts.shared` when the hook is registered, so they take every new world, are checkpointed
        (each rank its range, under the hook's class name: :meth:`Trainer.shared_parts`) and, under Horovod
        elastic, are committed and re-assembled like the sharded head (docs/sharded-head.md)."""
        return ()


#: what a part of :attr:`StepParts.shared` implements, the sharded-state protocol (docs/sharded-head.md)
SHARED_PROTOCOL = ("num_rows", "set_world", "range_state", "load_range", "load_initial")


def share_keys(hook: HookBase, count: int, taken: Sequence[str]) -> list[str]:
    """The keys ``hook``'s ``count`` shared parts are saved under: its class name (``Name.1``, ``Name.2`` for
    its further parts), ``Name-2`` ... for a second hook of the class; none of ``taken``. Stable from run to
    run (hooks register in one order), so a resume finds each part's rows, and a folder name as they are."""
    base, taken = type(hook).__name__, set(taken)
    for copy in range(1, len(taken) + 2):
        name = base if copy == 1 else f"{base}-{copy}"
        keys = [name if index == 0 else f"{name}.{index}" for index in range(count)]
        if taken.isdisjoint(keys):
            return keys
    raise AssertionError("unreachable: one of len(taken) + 1 names is free")


def checked_shares(hook: HookBase, shared: Sequence[Any]) -> tuple[Any, ...]:
    """``hook.shares()``, each part checked for the sharded-state protocol and against ``shared`` (the parts
    shared so far): a part lacking a member would fail only inside a Horovod elastic commit, and one shared twice
    would get two handlers that each assemble it. Refused in one line naming the hook and the part."""
    shares = hook.shares()
    name = type(hook).__name__
    if isinstance(shares, (str, bytes)) or not isinstance(shares, Iterable):
        raise TypeError(f"{name}.shares() must return a sequence of parts, got {shares!r}")
    shares = tuple(shares)
    for index, part in enumerate(shares):
        if any(part is other for other in (*shared, *shares[:index])):
            raise ValueError(f"{name}.shares(): shares {type(part).__name__} twice (it is already a shared part; "
                             "one handler per part assembles it)")
        missing = [member for member in SHARED_PROTOCOL if not hasattr(part, member)
                   or member != "num_rows" and not callable(getattr(part, member))]
        if missing:
            raise TypeError(f"{name}.shares(): {type(part).__name__} lacks {', '.join(missing)} (the sharded-state "
                            f"protocol: {', '.join(SHARED_PROTOCOL)}, docs/sharded-head.md)")
    return shares


class TrainingDiverged(RuntimeError):
    """The loss, the embeddings or the parameters became NaN or infinite; the message names the step.

    The last good checkpoint stays: parameters that are not finite are never written.
    """


#: a peak step that removes this share of every decayed weight (lr × decay) is the likely cause of a divergence
_DECAY_SHARE = 0.1


def divergence_advice(optimizer: torch.optim.Optimizer) -> str:
    """What to change after a non-finite stop: the weight decay when each step removes a large share of every
    weight (SGD's and AdamW's 1 − lr × decay; the trust ratio bounds LAMB's and LARS's), else the rate."""
    shrink = 0.0
    if isinstance(optimizer, (torch.optim.SGD, torch.optim.AdamW)):
        shrink = max(group.get("initial_lr", group["lr"]) * group["weight_decay"] for group in optimizer.param_groups)
    if shrink >= _DECAY_SHARE:
        return (f"each step scales the weights by 1 − lr × decay = {1 - shrink:.3g} at the peak rate: lower "
                "optim.weight_decay (or optim.lr), then resume or start afresh")
    return "lower optim.lr, raise optim.warmup_steps or check the data, then resume or start afresh"


@dataclass
class TrainState:
    """Where the run is: read and written by the loop and its hooks, saved in checkpoints.

    The per-step history is not here: it lives in the run's
    :class:`~.events.EventStorage` (and ``metrics.jsonl``).
    """

    epoch: int = 0  # epochs finished
    global_step: int = 0  # optimizer steps taken
    consumed: int = 0  # batches finished in the current epoch
    best: float = -1.0
    loss: float = math.nan
    lr: float = 0.0
    images_per_sec: float = 0.0
    final_metrics: dict[str, float] = field(default_factory=dict)
    stop: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint (``stop`` is a request to the running loop, not state)."""
        return {k: v for k, v in asdict(self).items() if k != "stop"}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> "TrainState":
        """The inverse of :meth:`to_dict`; keys of older checkpoints (a loss history) are ignored."""
        known = {f.name for f in fields(cls)} - {"stop"}
        return cls(**{k: v for k, v in saved.items() if k in known})


@dataclass
class StepParts:
    """What one optimizer step needs, built once by the application layer (or a test, from stub parts)."""

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
    gather: bool = True  # all-gather the embeddings when the world has more than one rank
    passes: int = 1
    scaler: torch.amp.GradScaler | None = None
    seed: int = 0  # keys the loader workers' seeds (with epoch and rank)
    loader: Any = None  # a TrainLoader yielding (model inputs, labels) per epoch; None: a DataLoader per epoch
    # optimizers of parameters no data-parallel wrapper may average (a row-sharded head): scheduled_step(f) after
    # the dense optimizer, f the schedule's factor now (the first parameter group's lr over its initial lr)
    row_optimizers: Sequence[Any] = ()
    # parts that own a share of the world besides the backend and the sampler (the sharded head's loss): each
    # takes a new world with set_world(world) (:meth:`Trainer.set_world`)
    shared: Sequence[Any] = ()
    # optim.clip_grad_norm: the dense gradients' global L2 norm is clipped to this after they are reduced
    clip_grad_norm: float | None = None
    # the model's BatchNorm neck and L2 norm, applied to the gathered batch (the model's train-mode forward
    # stops before them); None: the model's output is the embedding
    neck: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def gathers(self) -> bool:
        """Whether this step all-gathers the embeddings: wanted, and more than one rank in the current world."""
        return self.gather and self.backend.size > 1


#: a checkpoint's writer of a shared part's rows: ``(name, rows of the whole table, this rank's range)`` -> the
#: reference the checkpoint keeps (:func:`pksampler.train.modeling.range_checkpoint.write_ranges`)
RowWriter = Callable[[str, int, RangeCopy], dict[str, Any]]


def _saved_share(key: str, part: Any, write_rows: RowWriter) -> dict[str, Any]:
    """A shared part's checkpoint state: its dense state and ``ranges``, the reference ``write_rows`` returns
    after this rank wrote its range (every rank calls it together)."""
    dense, own = part.range_state(copy=False)  # written now, before the loop moves them: no host copy
    return {**dense, "ranges": write_rows(key, part.num_rows, own)}


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

    def __init__(self, parts: StepParts, hooks: Sequence[HookBase], state: TrainState | None = None, *,
                 storage: EventStorage | None = None) -> None:
        self.parts = parts
        self.state = state if state is not None else TrainState()
        self.storage = storage if storage is not None else EventStorage()
        self._iteration_done = 0  # batches finished since the sampler's iterator was created (or loaded)
        self._last_loss = torch.zeros(())
        self._embeddings_finite = torch.ones((), dtype=torch.bool)
        self.hooks: list[HookBase] = []
        self._share_keys: dict[int, str] = {}  # id of a part a hook shares -> the key it is saved under
        self._saved_shares: dict[str, Any] = {}  # a loaded checkpoint's shared parts not loaded yet, by key
        self._resumed_shares: dict[str, Any] = {}  # every shared part's state in the loaded checkpoint, by key
        self.register(hooks)

    def register(self, hooks: Iterable[HookBase]) -> None:
        """Append ``hooks``; each is called after those registered before it. The parts each one
        :meth:`~HookBase.shares` join :attr:`StepParts.shared`."""
        added = list(hooks)
        shared = tuple(self.parts.shared) if self.parts is not None else ()
        for hook in added:
            hook.trainer = self  # before shares(): a hook's parts may come from the trainer (its loss, its world)
            parts = checked_shares(hook, shared)
            keys = share_keys(hook, len(parts), [self._key_of(i, part) for i, part in enumerate(shared)])
            self._share_keys.update((id(part), key) for part, key in zip(parts, keys))
            shared += parts
        if self.parts is not None and len(shared) > len(self.parts.shared):  # most hooks share nothing
            self.parts.shared = shared
        self.hooks.extend(added)

    @property
    def global_batch(self) -> int:
        return self.parts.global_batch

    def shared_parts(self) -> list[tuple[str, Any]]:
        """Every item of :attr:`StepParts.shared` with the key it is checkpointed under: ``loss`` for the run's
        loss, the sharing hook's (:func:`share_keys`) for a hook's part, ``shared<i>`` for any other."""
        if self.parts is None:
            return []
        return [(self._key_of(index, part), part) for index, part in enumerate(self.parts.shared)]

    def _key_of(self, index: int, part: Any) -> str:
        return self._share_keys.get(id(part), "loss" if part is self.parts.loss_fn else f"shared{index}")

    def train(self, *, interrupted_by: tuple[type[BaseException], ...] = ()) -> TrainState:
        """Run the epochs; ``after_train`` follows, unless one of ``interrupted_by`` (a change of world, after
        which the loop is entered again) leaves the loop: a hook then keeps its writer open."""
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
        except interrupted_by:
            raise
        except BaseException:
            self._call("after_train")
            raise
        self._call("after_train")
        return self.state

    def set_world(self, world: World) -> None:
        """A new world (a membership change): every part that owns a share takes it, then every hook is told.

        The backend first (rank, size and the loss scale follow from the world; the others get the backend's
        world, which carries that scale), then the sampler (the same object: the loader's reference stays valid,
        and no label is grouped again), then :attr:`StepParts.shared`; the embeddings are gathered from here on
        when the new world has more than one rank.
        """
        parts = self.parts
        parts.backend.set_world(world)
        world = parts.backend.world
        parts.sampler.set_world(world)
        for part in parts.shared:
            part.set_world(world)
        self._call("on_world_change")

    def _call(self, point: str) -> None:
        for hook in self.hooks:
            getattr(hook, point)()

    def _run_epoch(self) -> bool:
        """Steps until the epoch ends (True) or a hook asks to stop (False)."""
        parts, state = self.parts, self.state
        # A sampler loaded mid-epoch keeps its position for the same epoch; another epoch starts afresh.
        parts.sampler.set_epoch(state.epoch)
        parts.train_set.set_epoch(state.epoch)
        loader = self.make_loader()
        self._iteration_done = 0
        batches, started = parts.sampler.num_batches, time.perf_counter()
        for images, labels in loader:
            last_of_window = (state.consumed + 1) % parts.passes == 0 or state.consumed + 1 == batches
            self.forward_backward(images, labels, reduce=last_of_window)
            state.consumed += 1
            self._iteration_done += 1
            if not last_of_window:
                continue
            self.optimizer_step()
            state.images_per_sec = self._iteration_done * parts.global_batch / max(time.perf_counter() - started, 1e-9)
            self.storage.put_step(epoch=state.epoch, step=state.consumed, global_step=state.global_step,
                                  loss=state.loss, lr=state.lr, images_per_sec=state.images_per_sec,
                                  global_batch=parts.global_batch, time=time.time())
            self._call("after_step")
            if state.stop:
                return False
        return True

    def make_loader(self) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches: the loader built once (persistent workers, augmentation on the device), else
        a DataLoader over the training set driven by the batch sampler."""
        parts = self.parts
        if parts.loader is not None:
            return parts.loader.epoch(self.state.epoch)
        return torch.utils.data.DataLoader(parts.train_set, batch_sampler=parts.sampler, num_workers=parts.workers,
                                           pin_memory=parts.backend.setup.pin_memory,
                                           generator=loader_generator(parts.seed, self.state.epoch, parts.backend.rank))

    def state_dict(self, *, write_rows: RowWriter | None = None) -> dict[str, Any]:
        """Everything a run needs to continue: model, optimizer, schedule, scaler, loss, loop and sampler state.

        Cheap: the tensors are the live ones (no copies), so a caller that
        keeps a snapshot while training goes on copies it (``torch.save``
        does). The sampler's part is its own ``state_dict`` at the loop's
        position, in global steps, so :meth:`load_state_dict` works at
        another world size. ``write_rows`` (a checkpoint; every rank calls
        it): a loss that owns rows of a row-sharded table (one of
        :attr:`StepParts.shared`) gives its dense state
        (``range_state``) and ``ranges``, what ``write_rows(name, rows,
        own)`` returns after writing this rank's range, instead of its
        whole table (:mod:`~pksampler.train.modeling.range_checkpoint`).
        """
        parts = self.parts
        return {
            "model": parts.model.state_dict(),
            "optimizer": parts.optimizer.state_dict(),
            "scheduler": parts.scheduler.state_dict(),
            "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
            "loss": self._loss_state(write_rows),
            **self._shares_state(write_rows),
            "state": self.state.to_dict(),
            "sampler": parts.sampler.state_dict(batches_consumed=self._iteration_done),
            "world_size": parts.backend.size,
        }

    def _loss_state(self, write_rows: RowWriter | None) -> dict[str, Any]:
        """The loss's checkpoint state: whole, or (``write_rows``, a shared part) dense with its ranges apart. A
        shared loss without ``write_rows`` gives its ``whole_state()`` (a collective; the sharded head whole, any
        world size loads it): its ``state_dict()`` is nn.Module's, this rank's range alone."""
        loss = self.parts.loss_fn
        if not any(part is loss for part in self.parts.shared):
            return loss.state_dict()
        if write_rows is None:
            return loss.whole_state()
        return _saved_share("loss", loss, write_rows)

    def _shares_state(self, write_rows: RowWriter | None) -> dict[str, Any]:
        """``{"shared": {key: state}}`` for every shared part but the loss (a hook's table), each written as the
        loss is; nothing without ``write_rows`` (a part of the protocol has no whole state) or such parts."""
        shares = {key: _saved_share(key, part, write_rows) for key, part in self.shared_parts()
                  if part is not self.parts.loss_fn} if write_rows is not None else {}
        return {"shared": shares} if shares else {}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (maybe of another world size); the next ``train()`` resumes there."""
        parts = self.parts
        parts.model.load_state_dict(saved["model"])
        parts.optimizer.load_state_dict(saved["optimizer"])
        parts.scheduler.load_state_dict(saved["scheduler"])
        parts.loss_fn.load_state_dict(saved["loss"])
        if parts.scaler is not None and saved.get("scaler"):
            parts.scaler.load_state_dict(saved["scaler"])
        self.state = TrainState.from_dict(saved["state"])
        parts.sampler.load_state_dict(to_numpy(saved["sampler"]))
        self._iteration_done = 0
        self._saved_shares = dict(saved.get("shared") or {})
        loss_shared = any(part is parts.loss_fn for part in parts.shared)
        self._resumed_shares = {**({"loss": saved["loss"]} if loss_shared else {}), **self._saved_shares}
        self.load_saved_shares(registered=False)

    def load_saved_shares(self, *, registered: bool = True) -> None:
        """Each shared part of the loaded checkpoint (its ``shared`` section) that is shared now and not loaded
        yet: its state, this rank's range read from the range files that overlap it
        (:func:`~pksampler.train.modeling.range_checkpoint.load_part`). :meth:`load_state_dict` calls it
        (``registered=False``: hooks may follow), and the application again once every hook that shares parts is
        registered (they come after the resume): a saved part that no hook claims then is refused in one line,
        since its table would be lost without a word (a hook renamed or removed since: its key changed)."""
        backend = self.parts.backend
        for key, part in self.shared_parts():
            saved = self._saved_shares.pop(key, None)
            if saved is not None:
                load_part(part, saved, *row_range(part.num_rows, backend.size, backend.rank), key=key)
        if registered and self._saved_shares:
            now = [key for key, _ in self.shared_parts()]
            raise ValueError(f"the checkpoint holds the table of shared part(s) {sorted(self._saved_shares)}, which "
                             f"no hook of this run shares (this run's shared parts: {now}): a hook renamed or "
                             "removed since would lose it (a part's key is its hook's class name)")

    def resumed_share(self, key: str) -> Any:
        """What shared part ``key`` resumes from, for Horovod elastic's handler on the rank that loaded the
        checkpoint: its saved state, whose rows every rank reads from the range files overlapping its own range
        (a dict with ``ranges``), or, for a loss saved whole inside an older checkpoint, its ``saved_copy``
        (the dense state and one copy of every row); None when nothing of it was loaded."""
        saved = self._resumed_shares.get(key)
        if saved is None or "ranges" in saved:
            return saved
        return self.parts.loss_fn.saved_copy(saved) if key == "loss" else None

    def forward_backward(self, images: torch.Tensor, labels: torch.Tensor, *, reduce: bool) -> None:
        """Loss on the (gathered) global batch and its backward pass; gradients reduced when ``reduce``."""
        parts, setup = self.parts, self.parts.backend.setup
        parts.train_model.train()
        context = contextlib.nullcontext() if reduce else parts.backend.accumulating(parts.train_model)
        with context:
            with setup.autocast():
                embeddings = parts.train_model(setup.to_device(images))
            self.loss_backward(embeddings.float(), labels.to(setup.device, non_blocking=True))

    def loss_backward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """The loss of the (gathered) global batch, backpropagated into this rank's ``embeddings``.

        With :attr:`StepParts.neck`, ``embeddings`` are the model's pre-neck
        output and the neck normalises the gathered global batch. Scaled for the
        all-gather's backward (``gathered_loss_scale``), the accumulation window
        and the fp16 GradScaler; keeps the loss and whether the embeddings were
        finite for :meth:`optimizer_step`.
        """
        parts = self.parts
        scale = 1.0
        if parts.gathers:
            embeddings, labels = gather_batch(parts.backend, embeddings, labels)
            scale = parts.backend.gathered_loss_scale
        if parts.neck is not None:
            embeddings = parts.neck(embeddings)
        loss = parts.loss_fn(embeddings, labels)
        scaled = loss * (scale / parts.passes)
        (parts.scaler.scale(scaled) if parts.scaler is not None else scaled).backward()
        self._last_loss = loss.detach()
        # A loss can stay finite on NaN embeddings (multi_similarity compares them: every comparison is False).
        self._embeddings_finite = torch.isfinite(embeddings.detach()).all()

    def optimizer_step(self) -> None:
        """Apply the reduced gradients (clipped, through the GradScaler in fp16), advance the schedule, check the loss."""
        parts, backend, state = self.parts, self.parts.backend, self.state
        # the factor this step's backward carried, read before update() changes it: the rows unscale by it (read
        # only for rows: get_scale() waits for the device)
        scaled_rows = parts.scaler is not None and bool(parts.row_optimizers)
        grad_scale = parts.scaler.get_scale() if scaled_rows else 1.0
        if parts.scaler is None and parts.clip_grad_norm is None:
            parts.optimizer.step()
        else:
            # Horovod's way: finish the allreduce, unscale and clip the reduced gradients, then step without a
            # second synchronize (a no-op elsewhere: DDP and one process have reduced them in backward)
            backend.synchronize(parts.optimizer)
            if parts.scaler is not None:
                parts.scaler.unscale_(parts.optimizer)
            if parts.clip_grad_norm is not None:
                clip_gradients(parts.optimizer, parts.clip_grad_norm)
            with backend.skip_synchronize(parts.optimizer):
                if parts.scaler is not None:
                    parts.scaler.step(parts.optimizer)
                else:
                    parts.optimizer.step()
            if parts.scaler is not None:
                parts.scaler.update()
        group = parts.optimizer.param_groups[0]
        factor = group["lr"] / group["initial_lr"] if group.get("initial_lr") else 1.0
        # GradScaler.update() lowers the scale exactly when it skipped the step for an overflow (every rank alike)
        skipped = scaled_rows and parts.scaler.get_scale() < grad_scale
        for rows in parts.row_optimizers:
            rows.scheduled_step(factor, grad_scale=grad_scale, skipped=skipped)
        parts.optimizer.zero_grad()
        parts.scheduler.step()
        state.global_step += 1
        # Gathered embeddings give every rank the same loss; otherwise average it (and the finiteness flag).
        loss, finite = self._last_loss, self._embeddings_finite
        if not parts.gathers and backend.size > 1:
            both = backend.allreduce_mean(torch.stack([loss.float(), finite.float()]))
            loss, finite = both[0], both[1] == 1
        state.loss = float(loss)
        state.lr = float(parts.scheduler.get_last_lr()[0])
        if not bool(finite):
            raise TrainingDiverged(
                f"the embeddings hold NaN or infinite values at global step {state.global_step} (epoch "
                f"{state.epoch + 1}; the loss is {state.loss}); training stopped. The last good checkpoint is kept: "
                + divergence_advice(parts.optimizer)
            )
        if not math.isfinite(state.loss):
            raise TrainingDiverged(
                f"the loss is {state.loss} at global step {state.global_step} (epoch {state.epoch + 1}); training "
                "stopped. The last good checkpoint is kept: " + divergence_advice(parts.optimizer)
            )


def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clip the global L2 norm of every gradient the optimizer holds to ``max_norm``; the norm before clipping.

    Called on reduced gradients (after Horovod's ``synchronize()``, after DDP's backward), so every rank clips
    by the same norm and the ranks stay in step. A group at rate 0 (the backbone under
    ``model.freeze_backbone_steps``) is left out: its gradient moves nothing and would shrink the others'.
    """
    params = [p for group in optimizer.param_groups if group["lr"] > 0 for p in group["params"] if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def replay_history(trainer: Trainer, path: Path) -> None:
    """A run's history from its ``metrics.jsonl`` into a fresh event storage, with the best and latest evaluation.

    Used by a resumed run (the file already cut back to the checkpoint's
    step) and by a process that becomes rank 0 under Horovod elastic (the
    file holds the committed steps). The epoch's checkpoint is written before
    its evaluation, so an evaluation logged after the checkpoint also sets
    ``best`` and the latest metrics.
    """
    trainer.storage = EventStorage()
    trainer.storage.replay(path)
    evaluations = trainer.storage.records("eval")
    if evaluations:
        state = trainer.state
        state.best = max(state.best, *(float(r["recall_at_1"]) for r in evaluations))
        state.final_metrics = {k: v for k, v in evaluations[-1].items() if k not in ("type", "epoch", "global_step")}

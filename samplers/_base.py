"""The protocol every pksampler sampler follows.

``__init__`` validates; ``__iter__`` is deterministic for (seed, epoch, rank);
``__len__`` is exact and counts the whole epoch (as torch's
``DistributedSampler`` and torchdata's samplers do: frameworks such as
Lightning take it as the epoch's length and count a resumed position
themselves); ``set_epoch``, ``state_dict`` and ``load_state_dict`` make a run
resumable at the next global step, and a resumed iterator starts there.
Subclasses supply the plan.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import numpy as np

from pksampler.world import World

from ._guard import check_not_resharded, check_world_still_holds
from ._validate import SEED_LIMIT, check_int
from ._world import rank_share, resolve_world, step_total

__all__ = ["BatchForm", "FlatForm", "StepPlanSampler"]

_STATE_VERSION = 1


class StepPlanSampler:
    """Epoch, resume position and state handling shared by the step-plan samplers.

    A subclass defines ``plan_identity()`` (values a resumed run must share),
    ``_count_steps(epoch)`` (global steps of an epoch, cheap) and
    ``_rank_steps(epoch, start, stop)`` (this rank's batches as a 2-D array).
    """

    _owner = "StepPlanSampler"
    #: attribute names of the global step's size and of this rank's share of it
    _step_names = ("classes_per_step", "classes_per_batch")
    #: steps computed per block while streaming, bounds memory of the iterator
    _block_indices = 1 << 16

    def __init__(self, *, num_replicas: int, rank: int, seed: int, detected: bool = False) -> None:
        self.num_replicas = num_replicas
        self.rank = rank
        #: whether rank or world size came from auto-detection (checked again when iterated)
        self._detected_world = detected
        self.seed = check_int("seed", seed, minimum=0, below=SEED_LIMIT, owner=self._owner)
        self.epoch = 0
        self._resume_step = 0
        self._iter_start = 0
        self._yielded = 0
        self._steps_cache: tuple[int, int] | None = None

    # --- to be provided by subclasses -------------------------------------
    def plan_identity(self) -> dict[str, Any]:  # pragma: no cover - abstract
        """What fixes the global plan, apart from seed and epoch: labels digest, step size, policies.

        Two samplers with equal identities, seeds and epochs produce the same
        global steps at any world size. It is part of :meth:`state_dict` (a
        resumed run must match it) and of the cross-rank fingerprint of
        :func:`pksampler.samplers.sampler_fingerprint`. Plain values only.
        """
        raise NotImplementedError

    def _count_steps(self, epoch: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _rank_steps(self, epoch: int, start: int, stop: int) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def batch_size(self) -> int:  # pragma: no cover - abstract
        """Indices in this rank's batch."""
        raise NotImplementedError

    @property
    def rank_batch_sizes(self) -> tuple[int, ...]:  # pragma: no cover - abstract
        """Indices in every rank's batch, in rank order (they differ when W does not divide the step)."""
        raise NotImplementedError

    @property
    def global_batch_size(self) -> int:
        """Indices in one global step, summed over the ranks."""
        return sum(self.rank_batch_sizes)

    # --- protocol ---------------------------------------------------------
    def set_world(self, num_replicas: World | int | None, rank: int | None = None) -> None:
        """Take this rank's share of every global step for another world size (an elastic reset).

        ``set_world(world)`` takes a :class:`pksampler.world.World` (the
        trainer's protocol: every part that owns a share gets the new world);
        ``set_world(num_replicas, rank)`` the two numbers.

        The global plan does not depend on the world size, so the labels'
        grouping, the cached epoch layout, the epoch and the resume step are
        kept; only the rank's run of slots changes (``ceil`` or ``floor`` of
        the step size over ``num_replicas``, which may be at most the step
        size). ``None`` detects the value as the constructor does. An
        iterator created before keeps its old share; load the committed
        ``state_dict`` and create a new one.
        """
        owner = f"{self._owner}.set_world"
        if isinstance(num_replicas, World):
            if rank is not None:
                raise TypeError(f"{owner}(rank=) must be None when num_replicas is a World (it holds the rank), "
                                f"got rank={rank!r}")
            num_replicas, rank = num_replicas.size, num_replicas.rank
        self._detected_world = num_replicas is None or rank is None
        num_replicas, rank = resolve_world(num_replicas, rank, owner=owner)
        total_name, share_name = self._step_names
        total = step_total(None, getattr(self, total_name), num_replicas, owner=owner, names=(share_name, total_name))
        first, count = rank_share(total, num_replicas, rank)
        self.num_replicas, self.rank, self.first_slot = num_replicas, rank, first
        setattr(self, share_name, count)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose plan the next ``__iter__`` yields.

        Call it before every epoch (as with torch's DistributedSampler);
        otherwise every epoch repeats the same order. Starting a new epoch
        clears a pending mid-epoch resume position.
        """
        epoch = check_int("epoch", epoch, minimum=0, below=SEED_LIMIT, owner=f"{self._owner}.set_epoch")
        check_not_resharded(self._owner)  # Accelerate's dispatcher calls this on every rank, iterates on rank 0 only
        if epoch != self.epoch:
            self._resume_step = 0
        self.epoch = epoch

    @property
    def num_batches(self) -> int:
        """Global steps (batches per rank) in the current epoch."""
        if self._steps_cache is None or self._steps_cache[0] != self.epoch:
            self._steps_cache = (self.epoch, self._count_steps(self.epoch))
        return self._steps_cache[1]

    def _iter_batches(self) -> Iterator[np.ndarray]:
        """This rank's batches from the resume step to the end of the epoch.

        The position counters are reset here, when the iterator is created
        (not at its first ``next``), so ``state_dict`` is right at any time.
        Here too, once per iterator, the sampler refuses to run under a
        framework's re-sharding wrapper or with a world size that the live
        process group contradicts (see :mod:`._guard`).
        """
        check_not_resharded(self._owner, len(self))  # type: ignore[arg-type]
        if self._detected_world:
            check_world_still_holds(self.num_replicas, self.rank, owner=self._owner)
        epoch, start, stop = self.epoch, self._resume_step, self.num_batches
        self._iter_start, self._yielded = start, 0
        return self._generate(epoch, start, stop)

    def _generate(self, epoch: int, start: int, stop: int) -> Iterator[np.ndarray]:
        block = max(1, self._block_indices // max(self.batch_size, 1))
        for first in range(start, stop, block):
            batches = self._rank_steps(epoch, first, min(first + block, stop))
            for row in batches:
                self._yielded += 1
                yield row

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """The position of this run: epoch, seed and the next global step.

        Args:
            batches_consumed: batches the training loop has finished in the
                current iteration. Default: the number this sampler has yielded,
                which a DataLoader with workers runs ahead of by its prefetch
                depth, so trainers should pass their own count.
        """
        consumed = self._yielded if batches_consumed is None else check_int(
            "batches_consumed", batches_consumed, minimum=0, owner=f"{self._owner}.state_dict"
        )
        step = min(self._iter_start + consumed, self.num_batches)
        return {
            "version": _STATE_VERSION,
            "sampler": type(self).__name__,
            "epoch": self.epoch,
            "seed": self.seed,
            "step": step,
            **self.plan_identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved run at its next global step (possibly with another world size).

        The saved seed replaces this sampler's seed; the plan identity (labels,
        classes per global step, samples per class, policies) must match.
        """
        owner = f"{self._owner}.load_state_dict"
        if not isinstance(state, dict):
            raise TypeError(f"{owner}(state=) expects a dict from state_dict(), got {type(state).__name__}")
        required = {"version", "epoch", "seed", "step"} | set(self.plan_identity())
        missing = sorted(required - set(state))
        if missing:
            raise ValueError(f"{owner}(state=) is missing keys {missing}; was it written by state_dict()?")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"{owner}(state=) has version {state['version']!r}, this sampler reads {_STATE_VERSION}")
        self._check_identity(state, owner)
        self.seed = check_int("state['seed']", state["seed"], minimum=0, below=SEED_LIMIT, owner=owner)
        self.epoch = check_int("state['epoch']", state["epoch"], minimum=0, below=SEED_LIMIT, owner=owner)
        step = check_int("state['step']", state["step"], minimum=0, owner=owner)
        self._steps_cache = None
        if step > self.num_batches:
            raise ValueError(f"{owner}: state['step']={step} is past the end of epoch {self.epoch} ({self.num_batches} steps)")
        self._resume_step = step
        self._iter_start, self._yielded = step, 0

    def _check_identity(self, state: dict[str, Any], owner: str) -> None:
        mine = self.plan_identity()
        for key, value in mine.items():
            if state[key] != value:
                raise ValueError(
                    f"{owner}: the saved run has {key}={state[key]!r} but this sampler has {key}={value!r}; "
                    "a resumed run must use the same labels and plan settings"
                )


class _EpochHandle:
    """What frameworks reach as ``loader.batch_sampler.sampler``: forwards ``set_epoch`` to the batch sampler.

    Lightning (``_set_sampler_epoch``) and Accelerate (``DataLoaderShard.set_epoch``)
    look for ``set_epoch`` on the batch sampler's ``.sampler``, as torch's
    ``BatchSampler`` has it. A separate small object, not the batch sampler
    itself, so code that walks ``.sampler`` chains never loops.
    """

    def __init__(self, owner: "BatchForm") -> None:
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        """``set_epoch`` of the batch sampler that owns this handle."""
        self._owner.set_epoch(epoch)

    def __len__(self) -> int:
        """Indices in the owner's epoch (a whole number of batches)."""
        return len(self._owner) * self._owner.batch_size

    def __repr__(self) -> str:
        return f"<set_epoch handle of {type(self._owner).__name__}>"


class BatchForm(StepPlanSampler):
    """The batch form of a step-plan sampler: one list of indices per global step (``batch_sampler=``)."""

    def __iter__(self) -> Iterator[list[int]]:
        return (batch.tolist() for batch in self._iter_batches())

    def __len__(self) -> int:
        """Batches in the current epoch, a resumed one included (its iterator starts at the saved step)."""
        return self.num_batches

    @property
    def sampler(self) -> _EpochHandle:
        """A handle whose ``set_epoch`` reaches this sampler, where frameworks look for it (``batch_sampler.sampler``)."""
        return _EpochHandle(self)


class FlatForm(BatchForm):
    """The flat form: the batch form's lists, concatenated (``sampler=``, ``batch_size=s.batch_size``)."""

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(BatchForm.__iter__(self))

    def __len__(self) -> int:
        """Indices in the current epoch: whole batches of ``batch_size`` (a resumed iterator yields the rest)."""
        return self.num_batches * self.batch_size

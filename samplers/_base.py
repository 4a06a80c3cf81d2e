"""The protocol every pksampler sampler follows.

``__init__`` validates; ``__iter__`` is deterministic for (seed, epoch, rank);
``__len__`` is exact; ``set_epoch``, ``state_dict`` and ``load_state_dict``
make a run resumable at the next global step. Subclasses supply the plan.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ._validate import SEED_LIMIT, check_int

__all__ = ["StepPlanSampler"]

_STATE_VERSION = 1


class StepPlanSampler:
    """Epoch, resume position and state handling shared by the step-plan samplers.

    A subclass defines ``_plan_identity()`` (values a resumed run must share),
    ``_count_steps(epoch)`` (global steps of an epoch, cheap) and
    ``_rank_steps(epoch, start, stop)`` (this rank's batches as a 2-D array).
    """

    _owner = "StepPlanSampler"
    #: steps computed per block while streaming, bounds memory of the iterator
    _block_indices = 1 << 16

    def __init__(self, *, num_replicas: int, rank: int, seed: int) -> None:
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = check_int("seed", seed, minimum=0, below=SEED_LIMIT, owner=self._owner)
        self.epoch = 0
        self._resume_step = 0
        self._iter_start = 0
        self._yielded = 0
        self._steps_cache: tuple[int, int] | None = None

    # --- to be provided by subclasses -------------------------------------
    def _plan_identity(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _count_steps(self, epoch: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _rank_steps(self, epoch: int, start: int, stop: int) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def batch_size(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    # --- protocol ---------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose plan the next ``__iter__`` yields.

        Call it before every epoch (as with torch's DistributedSampler);
        otherwise every epoch repeats the same order. Starting a new epoch
        clears a pending mid-epoch resume position.
        """
        epoch = check_int("epoch", epoch, minimum=0, below=SEED_LIMIT, owner=f"{self._owner}.set_epoch")
        if epoch != self.epoch:
            self._resume_step = 0
        self.epoch = epoch

    @property
    def num_batches(self) -> int:
        """Global steps (batches per rank) in the current epoch."""
        if self._steps_cache is None or self._steps_cache[0] != self.epoch:
            self._steps_cache = (self.epoch, self._count_steps(self.epoch))
        return self._steps_cache[1]

    def _remaining_steps(self) -> int:
        return max(self.num_batches - self._resume_step, 0)

    def _iter_batches(self) -> Iterator[np.ndarray]:
        """This rank's batches from the resume step to the end of the epoch.

        The position counters are reset here, when the iterator is created
        (not at its first ``next``), so ``state_dict`` is right at any time.
        """
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
            **self._plan_identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved run at its next global step (possibly with another world size).

        The saved seed replaces this sampler's seed; the plan identity (labels,
        classes per global step, samples per class, policies) must match.
        """
        owner = f"{self._owner}.load_state_dict"
        if not isinstance(state, dict):
            raise TypeError(f"{owner}(state=) expects a dict from state_dict(), got {type(state).__name__}")
        required = {"version", "epoch", "seed", "step"} | set(self._plan_identity())
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
        mine = self._plan_identity()
        for key, value in mine.items():
            if state[key] != value:
                raise ValueError(
                    f"{owner}: the saved run has {key}={state[key]!r} but this sampler has {key}={value!r}; "
                    "a resumed run must use the same labels and plan settings"
                )

"""DistributedTripletSampler: (anchor, positive, negative) triples with random or hard negatives."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from ._base import BatchForm, FlatForm, StepPlanSampler
from ._labels import ClassIndex, group_labels
from ._validate import check_choice, check_int, check_real
from ._world import rank_share, rank_shares, resolve_world, step_total
from .triplet_plan import TripletOptions, anchor_index, check_neighbour_table, count_triplet_steps, triplet_batches

__all__ = ["DistributedTripletBatchSampler", "DistributedTripletSampler"]

NEGATIVE_POLICIES = ("random", "hard")


class _TripletPlan(StepPlanSampler):
    _owner = "DistributedTripletSampler"
    _step_names = ("triplets_per_step", "triplets_per_batch")

    def __init__(
        self,
        labels: Any,
        triplets_per_batch: int | None = None,
        *,
        triplets_per_step: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        negatives: str = "random",
        hard_classes: int = 10,
        hard_fraction: float = 0.5,
    ) -> None:
        owner = self._owner
        self.negatives = check_choice("negatives", negatives, NEGATIVE_POLICIES, owner=owner)
        hard_classes = check_int("hard_classes", hard_classes, minimum=1, owner=owner)
        self.hard_fraction = check_real("hard_fraction", hard_fraction, low=0.0, high=1.0, owner=owner)
        detected = num_replicas is None or rank is None
        num_replicas, rank = resolve_world(num_replicas, rank, owner=owner)
        #: triplets in one global step (over all ranks)
        self.triplets_per_step = step_total(triplets_per_batch, triplets_per_step, num_replicas, owner=owner,
                                            names=("triplets_per_batch", "triplets_per_step"))
        #: this rank's triplet slots of every step: [first_slot, first_slot + triplets_per_batch)
        self.first_slot, self.triplets_per_batch = rank_share(self.triplets_per_step, num_replicas, rank)
        super().__init__(num_replicas=num_replicas, rank=rank, seed=seed, detected=detected)
        self.index: ClassIndex = labels if isinstance(labels, ClassIndex) else group_labels(labels, owner=owner)
        if self.index.num_classes < 2:
            raise ValueError(f"{owner}(labels=) needs at least 2 classes for negatives, got {self.index.num_classes}")
        if self.negatives == "hard" and hard_classes > self.index.num_classes - 1:
            raise ValueError(
                f"{owner}(hard_classes=) must be at most the number of other classes, num_classes - 1 = "
                f"{self.index.num_classes - 1}, with negatives='hard'; got {hard_classes}"
            )
        self.hard_classes = hard_classes
        self.anchors = anchor_index(self.index)
        per_step = self.triplets_per_step
        if self.anchors.size < per_step:
            raise ValueError(
                f"not enough anchors: a global step needs triplets_per_step = {per_step} anchors "
                f"(samples of classes with at least 2 samples), but the labels have {self.anchors.size}"
            )
        #: (first epoch it applies to, table) pairs, newest last
        self._tables: list[tuple[int, np.ndarray]] = []

    @property
    def batch_size(self) -> int:
        """3 * triplets_per_batch indices in this rank's batch."""
        return 3 * self.triplets_per_batch

    @property
    def rank_batch_sizes(self) -> tuple[int, ...]:
        """Every rank's 3 * T, in rank order (T = ceil or floor of triplets_per_step / W)."""
        return tuple(3 * t for t in rank_shares(self.triplets_per_step, self.num_replicas))

    @property
    def needs_class_neighbours(self) -> bool:
        """True when the plan draws hard negatives, so a trainer should mine tables for it."""
        return self.negatives == "hard"

    def plan_identity(self) -> dict[str, Any]:
        """Labels digest, triplets per step and the negative policy (see the base class)."""
        return {
            "labels_fingerprint": self.index.fingerprint,
            "triplets_per_step": self.triplets_per_step,
            "negatives": self.negatives,
            "hard_classes": self.hard_classes,
            "hard_fraction": self.hard_fraction,
        }

    def consistency_extra(self) -> str:
        """Digest of the class-neighbour table in force: part of the cross-rank fingerprint."""
        table = self.neighbours(self.epoch)
        return "none" if table is None else hashlib.blake2b(table.tobytes(), digest_size=8).hexdigest()

    def _count_steps(self, epoch: int) -> int:
        return count_triplet_steps(self.anchors, self.triplets_per_step)

    def neighbours(self, epoch: int | None = None) -> np.ndarray | None:
        """The class-neighbour table used in ``epoch`` (None before the first update)."""
        epoch = self.epoch if epoch is None else epoch
        table = None
        for first_epoch, candidate in self._tables:
            if first_epoch <= epoch:
                table = candidate
        return table

    def set_class_neighbours(self, table: Any) -> np.ndarray:
        """Set the hard-negative table; it applies from the next epoch.

        ``table`` is ``(C, hard_classes)`` integer class codes of the sampler's
        class index, nearest first, ``-1`` for none (e.g. from
        :func:`pksampler.train.losses.mining.class_neighbours`). It must be the same
        on every rank: it is part of the cross-rank fingerprint and of
        ``state_dict``. Returns the validated int64 copy.
        """
        table = check_neighbour_table(table, self.index.num_classes, self.hard_classes,
                                      owner=f"{self._owner}.set_class_neighbours")
        self._tables = [t for t in self._tables if t[0] <= self.epoch][-1:] + [(self.epoch + 1, table)]
        return table

    def _rank_steps(self, epoch: int, start: int, stop: int) -> np.ndarray:
        hard = self.negatives == "hard"
        options = TripletOptions(seed=self.seed, epoch=epoch, neighbours=self.neighbours(epoch) if hard else None,
                                 hard_fraction=self.hard_fraction if hard else 0.0, start_step=start, stop_step=stop)
        triples = triplet_batches(self.index, self.anchors, self.triplets_per_batch, self.num_replicas, self.rank,
                                  options, triplets_per_step=self.triplets_per_step)
        return triples.reshape(triples.shape[0], self.batch_size)

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        state = super().state_dict(batches_consumed)
        state["neighbour_tables"] = [(first, table.copy()) for first, table in self._tables]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume a saved run; every saved neighbour table is validated like :meth:`set_class_neighbours`."""
        owner = f"{self._owner}.load_state_dict"
        saved = state.get("neighbour_tables", []) if isinstance(state, dict) else []
        if not isinstance(saved, (list, tuple)):
            raise TypeError(f"{owner}: state['neighbour_tables'] must be a list of (epoch, table) pairs, got {type(saved).__name__}")
        tables = []
        for position, entry in enumerate(saved):
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise ValueError(f"{owner}: state['neighbour_tables'][{position}] must be an (epoch, table) pair")
            first = check_int(f"state['neighbour_tables'][{position}][0]", entry[0], minimum=0, owner=owner)
            table = check_neighbour_table(entry[1], self.index.num_classes, self.hard_classes,
                                          owner=f"{owner}(state['neighbour_tables'][{position}])")
            tables.append((first, table))
        super().load_state_dict(state)
        self._tables = tables


class DistributedTripletSampler(FlatForm, _TripletPlan, Sampler[int]):
    """Triplet sampler for distributed metric learning: a flat stream of (anchor, positive, negative).

    Every sample of a class with at least two samples is an anchor once per
    epoch; its positive is another sample of its class; its negative is from
    another class, at random or (``negatives="hard"``) with probability
    ``hard_fraction`` from the anchor class's nearest classes under the
    current model (a table given with :meth:`set_class_neighbours`). Global steps of
    ``triplets_per_step`` (or ``num_replicas * triplets_per_batch``) triplets
    are split by rank, as evenly as possible when W does not divide them; the
    plan does not depend on the world size. See
    :mod:`pksampler.samplers.triplet_plan`.

    Use ``DataLoader(dataset, sampler=s, batch_size=s.batch_size)``: every
    batch holds whole triplets as consecutive rows a, p, n.

    Args:
        labels: labels per sample, or a dataset exposing ``labels``/``targets``.
        triplets_per_batch: T, triplets per rank batch (3T indices), every
            rank the same. Give this or ``triplets_per_step``.
        triplets_per_step: triplets per global step, split over the ranks
            as evenly as possible (a contiguous run of ``ceil`` or ``floor``
            of it / W per rank); at least ``num_replicas``.
        num_replicas, rank: world size and rank; detected when None.
        seed: base seed (randomness keyed by seed and epoch).
        negatives: ``"random"`` or ``"hard"``.
        hard_classes: nearest classes kept per class for hard negatives, at
            most ``num_classes - 1`` with ``negatives="hard"`` (unused otherwise).
        hard_fraction: share of negatives drawn from them.

    Corner cases: classes with one sample are never anchors (they can be
    negatives); before the first table update, hard negatives fall back to random.

    Example::

        sampler = DistributedTripletSampler(dataset, 32, negatives="hard")
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            train_one_epoch(DataLoader(dataset, sampler=sampler, batch_size=sampler.batch_size))
            sampler.set_class_neighbours(table)  # e.g. from pksampler.train.losses.mining
    """


class DistributedTripletBatchSampler(BatchForm, _TripletPlan, Sampler[list[int]]):
    """The batch form of :class:`DistributedTripletSampler`: one list of 3T indices per step."""

    _owner = "DistributedTripletBatchSampler"

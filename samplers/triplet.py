"""DistributedTripletSampler: (anchor, positive, negative) triples with random or hard negatives."""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Callable, Iterator

import numpy as np
from torch.utils.data import Sampler

from ._base import StepPlanSampler
from ._labels import ClassIndex, group_labels
from ._validate import check_choice, check_int, check_real
from ._world import initialised_horovod, initialised_torch_distributed, resolve_world
from .triplet_plan import anchor_index, count_triplet_steps, triplet_batches

__all__ = ["DistributedTripletBatchSampler", "DistributedTripletSampler", "class_neighbours"]

NEGATIVE_POLICIES = ("random", "hard")


def class_neighbours(embeddings: Any, labels: Any, index: ClassIndex, hard_classes: int) -> np.ndarray:
    """The ``hard_classes`` nearest other classes of every class, by cosine between class centroids.

    Args:
        embeddings: ``(n, d)`` embeddings (numpy or torch) of samples whose
            labels are ``labels``; any subset of the sampler's data.
        labels: ``(n,)`` labels in the same label space as the sampler's.
        index: the sampler's class index (maps labels to class codes).
        hard_classes: neighbours per class.

    Returns:
        int64 ``(C, hard_classes)`` class codes, nearest first; ``-1`` where a
        class had no embeddings or too few other classes exist.
    """
    import faiss  # only the hard-negative path needs faiss

    if hasattr(embeddings, "detach"):
        embeddings = embeddings.detach().cpu().numpy()
    x = np.asarray(embeddings, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"update_class_neighbours(embeddings=) must be a non-empty 2-D array, got shape {x.shape}")
    if not np.isfinite(x).all():
        row = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0])
        raise ValueError(f"update_class_neighbours(embeddings=) contains NaN or Inf (first in row {row})")
    if hasattr(labels, "detach"):
        labels = labels.detach().cpu().numpy()
    labels = np.asarray(labels)
    if labels.shape != (x.shape[0],):
        raise ValueError(f"update_class_neighbours(labels=) must have shape ({x.shape[0]},), got {labels.shape}")
    codes, known = index.codes_of(labels)
    if not known.all():
        unknown = labels[~known][:3].tolist()
        raise ValueError(
            f"update_class_neighbours(labels=) has labels the sampler does not know, e.g. {unknown}: "
            "the class-neighbour table must come from the sampler's labels"
        )
    num_classes = index.num_classes
    sums = np.zeros((num_classes, x.shape[1]), dtype=np.float64)
    np.add.at(sums, codes, x)
    present = np.bincount(codes, minlength=num_classes) > 0
    centroids = sums[present]
    centroids /= np.maximum(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-12)
    centroids = np.ascontiguousarray(centroids, dtype=np.float32)
    present_codes = np.flatnonzero(present)
    table = np.full((num_classes, hard_classes), -1, dtype=np.int64)
    k = min(hard_classes + 1, present_codes.size)
    search = faiss.IndexFlatIP(centroids.shape[1])
    search.add(centroids)
    _, ids = search.search(centroids, k)
    # Drop each class itself (moved last by a stable sort), keep the nearest-first order.
    drop = (ids == np.arange(ids.shape[0])[:, None]) | (ids < 0)
    order = np.argsort(drop, axis=1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=1)[:, :hard_classes]
    valid = ~np.take_along_axis(drop, order, axis=1)[:, :hard_classes]
    table[present_codes, : ids.shape[1]] = np.where(valid, present_codes[np.maximum(ids, 0)], -1)
    return table


def _default_broadcast() -> Callable[[Any], Any]:
    hvd = initialised_horovod()
    if hvd is not None:
        # explicit name: the default (the type name) differs between sender and receivers
        return lambda value: hvd.broadcast_object(value, root_rank=0, name="pksampler.class_neighbours")
    dist = initialised_torch_distributed()
    if dist is not None:
        def broadcast(value: Any) -> Any:
            holder = [value]
            dist.broadcast_object_list(holder, src=0)
            return holder[0]

        return broadcast
    return lambda value: value


class _TripletPlan(StepPlanSampler):
    _owner = "DistributedTripletSampler"

    def __init__(
        self,
        labels: Any,
        triplets_per_batch: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        negatives: str = "random",
        hard_classes: int = 10,
        hard_fraction: float = 0.5,
    ) -> None:
        owner = self._owner
        self.triplets_per_batch = check_int("triplets_per_batch", triplets_per_batch, minimum=1, owner=owner)
        self.negatives = check_choice("negatives", negatives, NEGATIVE_POLICIES, owner=owner)
        self.hard_classes = check_int("hard_classes", hard_classes, minimum=1, owner=owner)
        self.hard_fraction = check_real("hard_fraction", hard_fraction, low=0.0, high=1.0, owner=owner)
        num_replicas, rank = resolve_world(num_replicas, rank, owner=owner)
        super().__init__(num_replicas=num_replicas, rank=rank, seed=seed)
        self.index: ClassIndex = labels if isinstance(labels, ClassIndex) else group_labels(labels, owner=owner)
        if self.index.num_classes < 2:
            raise ValueError(f"{owner}(labels=) needs at least 2 classes for negatives, got {self.index.num_classes}")
        self.anchors = anchor_index(self.index)
        per_step = self.num_replicas * self.triplets_per_batch
        if self.anchors.size < per_step:
            raise ValueError(
                f"not enough anchors: a global step needs num_replicas * triplets_per_batch = {per_step} anchors "
                f"(samples of classes with at least 2 samples), but the labels have {self.anchors.size}"
            )
        #: (first epoch it applies to, table) pairs, newest last
        self._tables: list[tuple[int, np.ndarray]] = []

    @property
    def batch_size(self) -> int:
        """3 * triplets_per_batch indices per rank batch."""
        return 3 * self.triplets_per_batch

    @property
    def triplets_per_step(self) -> int:
        return self.num_replicas * self.triplets_per_batch

    def _plan_identity(self) -> dict[str, Any]:
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

    def update_class_neighbours(self, embeddings: Any, labels: Any, *,
                                broadcast: Callable[[Any], Any] | None = None) -> np.ndarray:
        """Refresh the hard-negative table from current embeddings; it applies from the next epoch.

        Rank 0 computes the table with faiss (class centroids, L2-normalised,
        k-NN) and ``broadcast`` (default: Horovod's or torch.distributed's
        ``broadcast_object`` when initialised) gives every rank the same table,
        so the plan stays rank-consistent. Every rank must call this together.
        """
        send = broadcast if broadcast is not None else _default_broadcast()
        table = class_neighbours(embeddings, labels, self.index, self.hard_classes) if self.rank == 0 else None
        table = send(table)
        if table is None:
            raise RuntimeError("update_class_neighbours: no table was received from rank 0")
        table = np.asarray(table, dtype=np.int64)
        if table.shape != (self.index.num_classes, self.hard_classes):
            raise ValueError(f"update_class_neighbours: table of shape {table.shape}, expected "
                             f"({self.index.num_classes}, {self.hard_classes})")
        self._tables = [t for t in self._tables if t[0] <= self.epoch][-1:] + [(self.epoch + 1, table)]
        return table

    def _rank_steps(self, epoch: int, start: int, stop: int) -> np.ndarray:
        hard = self.negatives == "hard"
        triples = triplet_batches(
            self.index, self.anchors, self.triplets_per_batch, self.num_replicas, self.rank,
            seed=self.seed, epoch=epoch, neighbours=self.neighbours(epoch) if hard else None,
            hard_fraction=self.hard_fraction if hard else 0.0, start_step=start, stop_step=stop,
        )
        return triples.reshape(triples.shape[0], self.batch_size)

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        state = super().state_dict(batches_consumed)
        state["neighbour_tables"] = [(first, table.copy()) for first, table in self._tables]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._tables = [(int(first), np.asarray(table, dtype=np.int64)) for first, table in state.get("neighbour_tables", [])]


class DistributedTripletSampler(_TripletPlan, Sampler[int]):
    """Triplet sampler for distributed metric learning: a flat stream of (anchor, positive, negative).

    Every sample of a class with at least two samples is an anchor once per
    epoch; its positive is another sample of its class; its negative is from
    another class, at random or (``negatives="hard"``) with probability
    ``hard_fraction`` from the anchor class's nearest classes under the
    current model (see :meth:`update_class_neighbours`). Global steps of
    ``num_replicas * triplets_per_batch`` triplets are split by rank; the plan
    does not depend on the world size. See :mod:`pksampler.samplers.triplet_plan`.

    Use ``DataLoader(dataset, sampler=s, batch_size=s.batch_size)``: every
    batch holds whole triplets as consecutive rows a, p, n.

    Args:
        labels: labels per sample, or a dataset exposing ``labels``/``targets``.
        triplets_per_batch: T, triplets per rank batch (3T indices).
        num_replicas, rank: world size and rank; detected when None.
        seed: base seed (randomness keyed by seed and epoch).
        negatives: ``"random"`` or ``"hard"``.
        hard_classes: nearest classes kept per class for hard negatives.
        hard_fraction: share of negatives drawn from them.

    Corner cases: classes with one sample are never anchors (they can be
    negatives); before the first table update, hard negatives fall back to random.

    Example::

        sampler = DistributedTripletSampler(dataset, 32, negatives="hard")
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            train_one_epoch(DataLoader(dataset, sampler=sampler, batch_size=sampler.batch_size))
            sampler.update_class_neighbours(embed(train_set), train_set.labels)
    """

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(batch.tolist() for batch in self._iter_batches())

    def __len__(self) -> int:
        return self._remaining_steps() * self.batch_size


class DistributedTripletBatchSampler(_TripletPlan, Sampler[list[int]]):
    """The batch form of :class:`DistributedTripletSampler`: one list of 3T indices per step."""

    _owner = "DistributedTripletBatchSampler"

    def __iter__(self) -> Iterator[list[int]]:
        return (batch.tolist() for batch in self._iter_batches())

    def __len__(self) -> int:
        return self._remaining_steps()

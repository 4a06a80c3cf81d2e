"""The triplet epoch plan as pure numpy functions.

Vocabulary: T = triplets per rank batch, W = world size, G = W*T triplets per
global step, A = number of anchors (samples of classes with at least two
samples), S = floor(A / G) global steps.

1. Anchors: every sample of a class with at least two samples is an anchor
   once per epoch, in the order of a keyed pseudo-random permutation of
   ``[0, A)`` (a Feistel bijection evaluated only at the rank's positions);
   the last ``A - S*G`` anchors of that order (fewer than one step) wait for
   another epoch.
2. Global position ``s*G + g`` holds triplet slot g of step s; rank r takes
   slots ``[r*T, (r+1)*T)``, or, when W does not divide G, a contiguous run
   of ``ceil(G/W)`` (first ``G % W`` ranks) or ``floor(G/W)`` slots. The plan
   never depends on W: the same global triplets for any world size.
3. Positive: another sample of the anchor's class, chosen by a hash of
   (epoch key, position), never the anchor itself.
4. Negative class: with probability ``hard_fraction`` (when a neighbour
   table is set) one of the anchor class's nearest classes, else any other
   class uniformly; then a sample of it chosen by hash.

Work and memory per rank are O(N/W) beyond the one-off O(N) anchor list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._labels import ClassIndex
from ._permute import keyed_permute, mix64
from ._world import rank_share
from .pk_plan import epoch_rng

__all__ = ["AnchorIndex", "TripletOptions", "anchor_index", "check_neighbour_table", "count_triplet_steps", "triplet_batches"]

_SALT_POSITIVE = np.uint64(0x243F6A8885A308D3)
_SALT_NEG_CLASS = np.uint64(0x13198A2E03707344)
_SALT_NEG_MEMBER = np.uint64(0xA4093822299F31D0)
_SALT_HARD = np.uint64(0x082EFA98EC4E6C89)


@dataclass(frozen=True)
class AnchorIndex:
    """Samples that can be anchors: those of classes with at least two samples.

    Attributes:
        members: anchor sample indices (A,), grouped by class.
        classes: class code of each anchor (A,).
        within: position of each anchor inside its class's member list (A,).
    """

    members: np.ndarray
    classes: np.ndarray
    within: np.ndarray

    @property
    def size(self) -> int:
        return int(self.members.shape[0])


def anchor_index(index: ClassIndex) -> AnchorIndex:
    """Build the anchor list once (O(N))."""
    eligible = np.flatnonzero(index.sizes >= 2)
    sizes = index.sizes[eligible]
    code_dtype = np.int32 if index.num_classes < 2**31 else np.int64
    classes = np.repeat(eligible.astype(code_dtype), sizes)
    starts = np.repeat(index.offsets[eligible], sizes)
    flat = np.arange(classes.size, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    members = index.members[starts + flat]
    return AnchorIndex(members=members, classes=classes, within=flat.astype(index.members.dtype))


def check_neighbour_table(table: Any, num_classes: int, hard_classes: int, *, owner: str) -> np.ndarray:
    """Return ``table`` as int64 ``(C, hard_classes)`` or raise naming the rule it breaks.

    Rules: shape ``(num_classes, hard_classes)``; integer dtype; values in
    ``[-1, num_classes)`` (``-1``: no neighbour); a row never names its own
    class (that would make negatives from the anchor's class).
    """
    from pksampler.arrays import as_numpy

    array = as_numpy(table, name=owner, kinds=None, contiguous=False)
    if array.shape != (num_classes, hard_classes):
        raise ValueError(f"{owner}: the neighbour table must have shape (num_classes, hard_classes) = "
                         f"({num_classes}, {hard_classes}), got {array.shape}")
    if array.dtype.kind not in "iu":
        raise TypeError(f"{owner}: the neighbour table must hold integer class codes, got dtype {array.dtype}")
    if array.size and (array.min() < -1 or array.max() >= num_classes):
        raise ValueError(f"{owner}: neighbour table values must lie in [-1, num_classes={num_classes}), "
                         f"got [{array.min()}, {array.max()}]")
    array = array.astype(np.int64)
    own = array == np.arange(num_classes)[:, None]
    if own.any():
        row = int(np.flatnonzero(own.any(axis=1))[0])
        raise ValueError(f"{owner}: neighbour table row {row} names its own class {row}; "
                         "a row must list other classes only (negatives come from other classes)")
    return array


def count_triplet_steps(anchors: AnchorIndex, triplets_per_step: int) -> int:
    """S = floor(A / G), the global steps of every epoch."""
    return anchors.size // triplets_per_step


def _uniform_below(hashes: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """Map 64-bit hashes to integers in [0, bound) (multiply-shift on the top 32 bits)."""
    top = (hashes >> np.uint64(32)).astype(np.uint64)
    with np.errstate(over="ignore"):
        return ((top * np.asarray(bound, dtype=np.uint64)) >> np.uint64(32)).astype(np.int64)


@dataclass(frozen=True)
class TripletOptions:
    """Seed, epoch, hard negatives and step range of one triplet plan.

    Attributes:
        seed: base seed; the epoch's key comes from ``(seed, epoch)``.
        epoch: the epoch to plan.
        neighbours: ``(C, h)`` nearest class codes per class (``-1`` where unknown), or None.
        hard_fraction: share of negatives drawn from ``neighbours``.
        start_step: the first global step returned.
        stop_step: one past the last global step returned (None: the epoch's end).
    """

    seed: int = 0
    epoch: int = 0
    neighbours: np.ndarray | None = None
    hard_fraction: float = 0.0
    start_step: int = 0
    stop_step: int | None = None


def triplet_batches(
    index: ClassIndex,
    anchors: AnchorIndex,
    triplets_per_batch: int | None,
    num_replicas: int,
    rank: int,
    options: TripletOptions = TripletOptions(),
    *,
    triplets_per_step: int | None = None,
) -> np.ndarray:
    """One rank's triplets, shape ``(steps, T_r, 3)`` of (anchor, positive, negative).

    Give ``triplets_per_batch`` (T, equal shares, ``G = W * T``) or
    ``triplets_per_step`` (G, split as evenly as possible: rank r takes the
    contiguous run of slots given by :func:`pksampler.samplers.rank_share`);
    ``triplets_per_batch`` is ignored when ``triplets_per_step`` is given.

    ``neighbours`` is a ``(C, h)`` table of nearest class codes per class
    (``-1`` where unknown); with ``hard_fraction > 0`` that share of
    negatives comes from it.
    """
    per_step = num_replicas * triplets_per_batch if triplets_per_step is None else triplets_per_step
    first, triplets_per_batch = rank_share(per_step, num_replicas, rank)
    num_steps = count_triplet_steps(anchors, per_step)
    start_step, stop_step = options.start_step, options.stop_step
    stop_step = num_steps if stop_step is None else min(stop_step, num_steps)
    neighbours, hard_fraction = options.neighbours, options.hard_fraction
    rng = epoch_rng(options.seed, options.epoch, stream=1)
    key = np.uint64(rng.integers(0, 2**63, dtype=np.int64))
    steps = np.arange(start_step, stop_step, dtype=np.int64)
    slots = first + np.arange(triplets_per_batch, dtype=np.int64)
    position = (steps[:, None] * per_step + slots[None, :]).reshape(-1)
    if position.size == 0:
        return np.zeros((0, triplets_per_batch, 3), dtype=np.int64)
    order = keyed_permute(position[None, :], np.array([anchors.size]), np.array([key], dtype=np.uint64))[0]

    anchor = anchors.members[order].astype(np.int64)
    cls = anchors.classes[order].astype(np.int64)
    size = index.sizes[cls]
    hashed = mix64(position.astype(np.uint64) ^ key)
    with np.errstate(over="ignore"):
        shift = 1 + _uniform_below(mix64(hashed ^ _SALT_POSITIVE), size - 1)  # in [1, n_c)
    positive = index.members[index.offsets[cls] + (anchors.within[order] + shift) % size].astype(np.int64)

    num_classes = index.num_classes
    other = _uniform_below(mix64(hashed ^ _SALT_NEG_CLASS), np.full(cls.shape, num_classes - 1))
    negative_class = (cls + 1 + other) % num_classes  # uniform over the other classes
    if neighbours is not None and hard_fraction > 0.0:
        hard_draw = (mix64(hashed ^ _SALT_HARD) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        width = neighbours.shape[1]
        pick = neighbours[cls, _uniform_below(mix64(hashed ^ _SALT_HARD ^ _SALT_NEG_CLASS), np.full(cls.shape, width))]
        use_hard = (hard_draw < hard_fraction) & (pick >= 0)
        negative_class = np.where(use_hard, pick, negative_class)
    member = _uniform_below(mix64(hashed ^ _SALT_NEG_MEMBER), index.sizes[negative_class])
    negative = index.members[index.offsets[negative_class] + member].astype(np.int64)
    triples = np.stack([anchor, positive, negative], axis=1)
    return triples.reshape(steps.size, triplets_per_batch, 3)

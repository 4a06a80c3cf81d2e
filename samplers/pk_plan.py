"""The P x K epoch plan as pure numpy functions (numpy in, numpy out).

Vocabulary: P = classes per rank batch, K = samples per class, W = world size,
G = W*P classes per global step, S = global steps per epoch. A *chunk* is K
indices of one class.

The plan is built in two layers so that every rank's share can be computed
(and tested) in one process:

1. :func:`epoch_layout` -- global and rank-independent, O(C + S + G) work:
   how many chunks each class gets this epoch, the shuffled class order and
   the random keys that place chunks into steps. It depends only on
   ``(labels, G, K, seed, epoch, small_classes, class_weighting)``, never on W
   or the rank; that is what makes the plan world-size invariant.
2. :func:`rank_batches` -- one rank's ``(steps, P, K)`` array of sample
   indices, O(N/W) work and memory: it evaluates only the rank's own slots.

How chunks are placed (all steps of the algorithm are vectorised):

1. Chunk counts: class c gets ``m_c = ceil(n_c / K)`` chunks (one pass), or,
   with ``class_weighting = a != 1``, a share of the same total proportional to
   ``n_c ** a`` (systematic rounding, at least one chunk).
2. Cap: a class can occur at most once per step, so counts are capped at the
   largest ``t`` with ``G * t <= sum(min(m_c, t))``; then ``S = floor(sum / G)``
   and the fewer-than-G chunks left over are dropped, one chunk from each of
   the last classes in this epoch's shuffled class order.
3. The classes are shuffled and their chunks laid out class by class in a
   sequence of length ``S * G``, cut into G columns of S positions; a class
   occupies a contiguous run of at most S positions, so at most two columns.
4. Column j maps its position o to step ``sigma^-1((o + c_j) mod S)`` with a
   random step permutation ``sigma`` and a random rotation ``c_j`` per column.
   The rotation of a column that continues a class from the previous column is
   drawn from the window that keeps that class's two parts in different steps.
   Each column is a bijection onto the steps, so a step holds G distinct classes.
5. Within step s, the G columns are rotated by a random ``rho_s`` into slots;
   rank r takes slots ``[r*P, (r+1)*P)``, so every rank meets every class.
6. Chunk q of class c holds positions ``q*K .. q*K+K-1`` (mod ``n_c``) of the
   class's members under a keyed pseudo-random permutation (Feistel, see
   :mod:`._permute`), so indices of a class are used evenly: within an epoch
   their counts differ by at most one.

Corner cases: classes smaller than K are filled by repetition
(``small_classes="repeat"``) or excluded (``"drop"``); classes too large for the
epoch are capped, a different random subset each epoch; fewer than G eligible
classes is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._labels import ClassIndex
from ._permute import keyed_permute, mix64

__all__ = [
    "SMALL_CLASS_POLICIES",
    "EpochLayout",
    "balanced_plan",
    "chunk_counts",
    "cap_counts",
    "eligible_classes",
    "epoch_layout",
    "epoch_rng",
    "rank_batches",
]

SMALL_CLASS_POLICIES = ("repeat", "drop")


def epoch_rng(seed: int, epoch: int, stream: int = 0) -> np.random.Generator:
    """The private generator of one epoch: keyed by (seed, epoch), never the global RNG."""
    return np.random.default_rng([seed, epoch, stream])


def eligible_classes(sizes: np.ndarray, samples_per_class: int, small_classes: str) -> np.ndarray:
    """Class codes that may appear in batches under the small-class policy."""
    if small_classes == "drop":
        return np.flatnonzero(sizes >= samples_per_class)
    return np.flatnonzero(sizes >= 1)


def chunk_counts(
    sizes: np.ndarray, samples_per_class: int, class_weighting: float, uniform: float
) -> np.ndarray:
    """Chunks per class for one epoch (before the cap).

    ``class_weighting == 1`` gives one pass, ``ceil(n / K)``. Otherwise the same
    total is shared in proportion to ``n ** class_weighting`` by systematic
    rounding with offset ``uniform`` in [0, 1): each count is the floor or the
    ceiling of its exact share, the total is fixed, and which classes round up
    changes with the offset (so from epoch to epoch).
    """
    passes = -(-sizes // samples_per_class)
    if class_weighting == 1.0:
        return passes.astype(np.int64)
    total = int(passes.sum())
    weights = sizes.astype(np.float64) ** class_weighting
    cumulative = np.cumsum(weights)
    cumulative *= total / cumulative[-1]
    cumulative[-1] = total
    upper = np.floor(cumulative + uniform)
    lower = np.floor(np.concatenate(([0.0], cumulative[:-1])) + uniform)
    return np.maximum(upper - lower, 1).astype(np.int64)


def cap_counts(counts: np.ndarray, classes_per_step: int) -> tuple[np.ndarray, int]:
    """Cap chunk counts so that no class needs to appear twice in a step.

    Returns ``(capped_counts, num_steps)`` with ``capped <= num_steps`` for
    every class and ``num_steps = floor(sum(capped) / G)``.
    """
    top = int(counts.max())
    if top * classes_per_step <= int(counts.sum()):
        capped = counts
    else:
        low, high = 0, top  # invariant: low is feasible, high + 1 is not
        while low < high:
            mid = (low + high + 1) // 2
            if mid * classes_per_step <= int(np.minimum(counts, mid).sum()):
                low = mid
            else:
                high = mid - 1
        capped = np.minimum(counts, low)
    return capped, int(capped.sum()) // classes_per_step


@dataclass(frozen=True)
class EpochLayout:
    """The global, rank-independent part of one epoch's plan.

    Attributes:
        num_steps: S, global steps in the epoch.
        classes_per_step: G.
        class_order: shuffled class codes (only classes with chunks this epoch).
        starts: ``len(class_order) + 1`` run boundaries in the chunk sequence.
        run_of: the run index of every chunk position (S*G,).
        column_shift: ``c_j`` per column (G,).
        step_key: ``sigma`` as an array: column position ``(o + c_j) mod S`` of step s is ``step_key[s]``.
        slot_shift: ``rho_s`` per step (S,).
        member_key: base key of the per-class member permutations.
    """

    num_steps: int
    classes_per_step: int
    class_order: np.ndarray
    starts: np.ndarray
    run_of: np.ndarray
    column_shift: np.ndarray
    step_key: np.ndarray
    slot_shift: np.ndarray
    member_key: np.uint64


def _counts_for_epoch(
    index: ClassIndex,
    classes_per_step: int,
    samples_per_class: int,
    rng: np.random.Generator,
    small_classes: str,
    class_weighting: float,
) -> tuple[np.ndarray, np.ndarray, int]:
    uniform = float(rng.random())  # always drawn, so later draws do not depend on the weighting
    memo_key = ("counts", classes_per_step, samples_per_class, small_classes)
    if class_weighting == 1.0 and memo_key in index.memo:  # epoch-independent: computed once
        return index.memo[memo_key]
    eligible = eligible_classes(index.sizes, samples_per_class, small_classes)
    if eligible.size < classes_per_step:
        raise ValueError(_too_few_classes_message(index, eligible.size, classes_per_step, samples_per_class, small_classes))
    counts = chunk_counts(index.sizes[eligible], samples_per_class, class_weighting, uniform)
    capped, num_steps = cap_counts(counts, classes_per_step)
    if eligible.size == index.num_classes:
        eligible = None  # all classes: spare a gather later
    if class_weighting == 1.0:
        index.memo[memo_key] = (eligible, capped, num_steps)
    return eligible, capped, num_steps


def _too_few_classes_message(
    index: ClassIndex, found: int, needed: int, samples_per_class: int, small_classes: str
) -> str:
    rule = (
        f"classes with at least samples_per_class={samples_per_class} samples (small_classes='drop')"
        if small_classes == "drop"
        else "non-empty classes"
    )
    return (
        f"not enough classes: a global step needs num_replicas * classes_per_batch = {needed} distinct "
        f"classes, but the labels have {found} eligible ({rule}) out of {index.num_classes}; "
        "lower classes_per_batch, use fewer ranks, or use small_classes='repeat'"
    )


def count_steps(
    index: ClassIndex,
    classes_per_step: int,
    samples_per_class: int,
    *,
    seed: int,
    epoch: int,
    small_classes: str = "repeat",
    class_weighting: float = 1.0,
) -> int:
    """S for one epoch in O(C), without building the plan."""
    rng = epoch_rng(seed, epoch)
    return _counts_for_epoch(index, classes_per_step, samples_per_class, rng, small_classes, class_weighting)[2]


def epoch_layout(
    index: ClassIndex,
    classes_per_step: int,
    samples_per_class: int,
    *,
    seed: int,
    epoch: int,
    small_classes: str = "repeat",
    class_weighting: float = 1.0,
) -> EpochLayout:
    """Build the global layout of one epoch (steps 1-5 of the module docstring)."""
    rng = epoch_rng(seed, epoch)
    eligible, counts, num_steps = _counts_for_epoch(
        index, classes_per_step, samples_per_class, rng, small_classes, class_weighting
    )
    shuffle = rng.permutation(counts.size)
    class_order = shuffle if eligible is None else eligible[shuffle]
    run_lengths = counts[shuffle]
    # The remainder (fewer than G chunks) is taken one chunk each from the last
    # classes of the shuffled order: distinct classes, different every epoch.
    remainder = int(run_lengths.sum()) - num_steps * classes_per_step
    if remainder:
        run_lengths[-remainder:] -= 1
        present = run_lengths > 0
        class_order, run_lengths = class_order[present], run_lengths[present]
    starts = np.zeros(class_order.size + 1, dtype=np.int64)
    np.cumsum(run_lengths, out=starts[1:])
    # run_of[i]: the run (class in class_order) holding chunk position i; O(S*G)
    run_dtype = np.int32 if class_order.size < 2**31 else np.int64
    run_of = np.repeat(np.arange(class_order.size, dtype=run_dtype), run_lengths)

    column_shift = _column_shifts(starts, num_steps, classes_per_step, rng.random(classes_per_step))
    step_key = rng.permutation(num_steps)
    slot_shift = rng.integers(0, classes_per_step, size=num_steps)
    member_key = np.uint64(rng.integers(0, 2**63, dtype=np.int64))
    return EpochLayout(
        num_steps=num_steps,
        classes_per_step=classes_per_step,
        class_order=class_order,
        starts=starts,
        run_of=run_of,
        column_shift=column_shift,
        step_key=step_key,
        slot_shift=slot_shift,
        member_key=member_key,
    )


def _column_shifts(starts: np.ndarray, num_steps: int, columns: int, uniforms: np.ndarray) -> np.ndarray:
    """Rotation per column; a class split across a column boundary keeps distinct steps.

    A class with ``a`` chunks at the end of column j-1 and ``b`` at the start of
    column j occupies rotated positions ``[c_{j-1} - a, c_{j-1})`` and
    ``[c_j, c_j + b)`` (mod S); they are disjoint iff
    ``c_j - c_{j-1}`` lies in ``[0, S - a - b]``.
    """
    boundaries = np.arange(1, columns, dtype=np.int64) * num_steps
    run = np.searchsorted(starts, boundaries, side="right") - 1  # class run holding the first position of column j
    before = boundaries - starts[run]  # a: chunks of that run in column j-1
    after = np.minimum(starts[run + 1], boundaries + num_steps) - boundaries  # b
    split = before > 0
    window = num_steps - before - after + 1
    shifts = np.empty(columns, dtype=np.int64)
    shifts[0] = int(uniforms[0] * num_steps)
    for j in range(1, columns):  # G iterations of scalar work
        if split[j - 1]:
            shifts[j] = (shifts[j - 1] + int(uniforms[j] * window[j - 1])) % num_steps
        else:
            shifts[j] = int(uniforms[j] * num_steps)
    return shifts


def rank_batches(
    layout: EpochLayout,
    index: ClassIndex,
    classes_per_batch: int,
    samples_per_class: int,
    rank: int,
    *,
    start_step: int = 0,
    stop_step: int | None = None,
) -> np.ndarray:
    """Sample indices of one rank, shape ``(steps, classes_per_batch, samples_per_class)``.

    Rank ``r`` takes slots ``[r*P, (r+1)*P)`` of every global step in
    ``[start_step, stop_step)``. Work and memory are proportional to the
    rank's own share.
    """
    num_steps, columns = layout.num_steps, layout.classes_per_step
    stop_step = num_steps if stop_step is None else min(stop_step, num_steps)
    steps = np.arange(start_step, stop_step, dtype=np.int64)
    slots = rank * classes_per_batch + np.arange(classes_per_batch, dtype=np.int64)
    column = (slots[None, :] + layout.slot_shift[steps][:, None]) % columns
    offset = (layout.step_key[steps][:, None] - layout.column_shift[column]) % num_steps
    position = column * num_steps + offset
    run = layout.run_of[position]
    chunk = position - layout.starts[run]
    cls = layout.class_order[run]
    size = index.sizes[cls]
    within = (chunk[..., None] * samples_per_class + np.arange(samples_per_class)) % size[..., None]
    keys = mix64(layout.member_key ^ cls.astype(np.uint64))
    rows = within.reshape(-1, samples_per_class)
    shuffled = keyed_permute(rows, size.reshape(-1), keys.reshape(-1)).reshape(within.shape)
    return index.members[index.offsets[cls][..., None] + shuffled].astype(np.int64, copy=False)


def balanced_plan(
    index: ClassIndex,
    classes_per_batch: int,
    samples_per_class: int,
    num_replicas: int,
    rank: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    small_classes: str = "repeat",
    class_weighting: float = 1.0,
    start_step: int = 0,
) -> np.ndarray:
    """One rank's batches for one epoch, shape ``(steps, P * K)``: layout, then slice."""
    layout = epoch_layout(
        index,
        num_replicas * classes_per_batch,
        samples_per_class,
        seed=seed,
        epoch=epoch,
        small_classes=small_classes,
        class_weighting=class_weighting,
    )
    batches = rank_batches(layout, index, classes_per_batch, samples_per_class, rank, start_step=start_step)
    return batches.reshape(batches.shape[0], classes_per_batch * samples_per_class)

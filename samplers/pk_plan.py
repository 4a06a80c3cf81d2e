"""The P x K epoch plan as pure numpy functions (numpy in, numpy out).

Vocabulary: P = classes per rank batch, K = samples per class, W = world size,
G classes per global step (G = W*P when W divides G; otherwise ranks take
ceil(G/W) or floor(G/W)), S = global steps per epoch. A *chunk* is K
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
4. Every column gets its own random bijection onto the steps (one chunk of
   every column per step, so G chunks per step). Independent columns are what
   make batch-mates varied: a class's chunks land in random steps and meet
   random chunks of every other column, as in a random deal. Only a class
   split across columns j-1 and j can meet itself; each such chunk in column
   j swaps its step with a chunk of column j on a step the class does not
   use. In a *loose* column (split class plus the next column's share fit in
   S) the partner is a chunk of a class lying wholly inside the column, which
   touches no other constraint, so all loose columns are repaired at once,
   vectorised. A *tight* column (two large classes adjacent) may have to move
   the next split class, so tight columns are repaired in column order and
   the next boundary re-checked; a partner always exists.
5. Within step s, the G columns are rotated by a random ``rho_s`` into slots;
   rank r takes a contiguous run of slots, ``[r*P, (r+1)*P)`` when W divides
   G, else ``ceil(G/W)`` slots for the first ``G % W`` ranks and
   ``floor(G/W)`` for the rest; every rank meets every class.
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

import heapq
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ._labels import ClassIndex
from ._permute import keyed_permute, mix64
from ._world import rank_share

__all__ = [
    "SMALL_CLASS_POLICIES",
    "EpochLayout",
    "PlanOptions",
    "balanced_plan",
    "chunk_counts",
    "cap_counts",
    "eligible_classes",
    "epoch_layout",
    "epoch_runs",
    "position_dtype",
    "repair_splits",
    "epoch_rng",
    "column_positions",
    "count_steps",
    "rank_batches",
    "step_classes",
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
        run_of: the run index of every chunk position (S*G,); a table lookup
            is several times cheaper per rank than a binary search of ``starts``.
        position_of: ``(G, S)``; ``position_of[j, s]`` is the offset inside
            column j of the chunk that column j gives to step s (a permutation
            of ``[0, S)`` per row).
        slot_shift: ``rho_s`` per step (S,).
        member_key: base key of the per-class member permutations.
    """

    num_steps: int
    classes_per_step: int
    class_order: np.ndarray
    starts: np.ndarray
    run_of: np.ndarray
    position_of: np.ndarray
    slot_shift: np.ndarray
    member_key: np.uint64


def _counts_for_epoch(
    index: ClassIndex,
    classes_per_step: int,
    samples_per_class: int,
    rng: np.random.Generator,
    small_classes: str,
    class_weighting: float,
    cache: dict | None,
) -> tuple[np.ndarray | None, np.ndarray, int]:
    """Eligible classes (None: all), capped chunk counts and S for one epoch.

    With ``class_weighting == 1`` the result does not depend on the epoch; a
    caller-owned ``cache`` dict keeps it between epochs.
    """
    uniform = float(rng.random())  # always drawn, so later draws do not depend on the weighting
    key = ("counts", classes_per_step, samples_per_class, small_classes)
    if class_weighting == 1.0 and cache is not None and key in cache:
        return cache[key]
    eligible = eligible_classes(index.sizes, samples_per_class, small_classes)
    if eligible.size < classes_per_step:
        raise ValueError(_too_few_classes_message(index, eligible.size, classes_per_step, samples_per_class, small_classes))
    counts = chunk_counts(index.sizes[eligible], samples_per_class, class_weighting, uniform)
    capped, num_steps = cap_counts(counts, classes_per_step)
    code_dtype = np.int32 if index.num_classes < 2**31 else np.int64
    capped = capped.astype(np.int32 if num_steps < 2**31 else np.int64)  # counts <= S
    result = (None if eligible.size == index.num_classes else eligible.astype(code_dtype), capped, num_steps)
    if class_weighting == 1.0 and cache is not None:
        cache[key] = result
    return result


def _too_few_classes_message(
    index: ClassIndex, found: int, needed: int, samples_per_class: int, small_classes: str
) -> str:
    rule = (
        f"classes with at least samples_per_class={samples_per_class} samples (small_classes='drop')"
        if small_classes == "drop"
        else "non-empty classes"
    )
    return (
        f"not enough classes: a global step needs classes_per_step = {needed} distinct "
        f"classes, but the labels have {found} eligible ({rule}) out of {index.num_classes}; "
        "lower classes_per_step (or classes_per_batch), or use small_classes='repeat'"
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
    cache: dict | None = None,
) -> int:
    """S for one epoch in O(C), without building the plan."""
    rng = epoch_rng(seed, epoch)
    return _counts_for_epoch(index, classes_per_step, samples_per_class, rng, small_classes, class_weighting, cache)[2]


def epoch_layout(
    index: ClassIndex,
    classes_per_step: int,
    samples_per_class: int,
    *,
    seed: int,
    epoch: int,
    small_classes: str = "repeat",
    class_weighting: float = 1.0,
    cache: dict | None = None,
) -> EpochLayout:
    """Build the global layout of one epoch (steps 1-5 of the module docstring).

    ``cache`` (optional, owned by the caller) keeps the epoch-independent chunk
    counts between epochs.
    """
    rng = epoch_rng(seed, epoch)
    class_order, starts, run_of, num_steps = epoch_runs(
        index, classes_per_step, samples_per_class, rng, small_classes=small_classes,
        class_weighting=class_weighting, cache=cache,
    )
    position_of = column_positions(starts, num_steps, classes_per_step, rng)
    slot_shift = rng.integers(0, classes_per_step, size=num_steps)
    member_key = np.uint64(rng.integers(0, 2**63, dtype=np.int64))
    return EpochLayout(
        num_steps=num_steps,
        classes_per_step=classes_per_step,
        class_order=class_order,
        starts=starts,
        run_of=run_of,
        position_of=position_of,
        slot_shift=slot_shift,
        member_key=member_key,
    )


def epoch_runs(
    index: ClassIndex,
    classes_per_step: int,
    samples_per_class: int,
    rng: np.random.Generator,
    *,
    small_classes: str,
    class_weighting: float,
    cache: dict | None,
    order: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Steps 1-3 of the module docstring: ``(class_order, starts, run_of, S)``.

    ``order`` (optional) maps the epoch's class codes, after the remainder
    is dropped, to the permutation that lays their runs out; the default is
    the shuffled order itself. The chunk counts never depend on it, so every
    plan built on this function gives a class the same chunks per epoch.
    """
    eligible, counts, num_steps = _counts_for_epoch(
        index, classes_per_step, samples_per_class, rng, small_classes, class_weighting, cache
    )
    code_dtype = np.int32 if counts.size < 2**31 else np.int64
    shuffle = rng.permutation(counts.size).astype(code_dtype)
    class_order = shuffle if eligible is None else eligible[shuffle]
    run_lengths = counts[shuffle]
    # The remainder (fewer than G chunks) is taken one chunk each from the last
    # classes of the shuffled order: distinct classes, different every epoch.
    remainder = int(run_lengths.sum()) - num_steps * classes_per_step
    if remainder:
        run_lengths[-remainder:] -= 1
        present = run_lengths > 0
        class_order, run_lengths = class_order[present], run_lengths[present]
    if order is not None:
        permutation = order(class_order)
        class_order, run_lengths = class_order[permutation], run_lengths[permutation]
    # int32 offsets while the epoch's chunk sequence (S*G) fits: half the memory of int64
    starts = np.zeros(class_order.size + 1, dtype=np.int32 if num_steps * classes_per_step < 2**31 else np.int64)
    np.cumsum(run_lengths, out=starts[1:])
    run_dtype = np.int32 if class_order.size < 2**31 else np.int64
    run_of = np.repeat(np.arange(class_order.size, dtype=run_dtype), run_lengths)
    return class_order, starts, run_of, num_steps


def _split_runs(starts: np.ndarray, num_steps: int, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column j: ``tail[j]``, ``head[j]`` and ``next_tail[j]``.

    ``tail[j]`` chunks at the end of column j-1 and ``head[j]`` at the start of
    column j belong to one class (the class split by boundary j; both 0 when
    no class straddles it); ``next_tail[j] = tail[j+1]`` is how many chunks at
    the end of column j continue into column j+1.
    """
    tail = np.zeros(columns, dtype=np.int64)
    head = np.zeros(columns, dtype=np.int64)
    if columns > 1:
        boundaries = np.arange(1, columns, dtype=np.int64) * num_steps
        run = np.searchsorted(starts, boundaries, side="right") - 1  # run holding the first position of column j
        before = boundaries - starts[run]
        after = np.minimum(starts[run + 1], boundaries + num_steps) - boundaries
        tail[1:] = before
        head[1:] = np.where(before > 0, after, 0)
    next_tail = np.append(tail[1:], 0)
    return tail, head, next_tail


def column_positions(starts: np.ndarray, num_steps: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """An independent random bijection steps -> positions per column, repaired so no step repeats a class.

    Returns ``position_of`` of shape ``(G, S)`` (int16 when S < 2**15). Row j
    is a uniformly random permutation, except where a class split across
    columns j-1 and j would meet itself: each such chunk in column j swaps
    its step with a chunk of column j whose step that class does not use
    (step 4 of the module docstring).
    """
    position_of = np.tile(np.arange(num_steps, dtype=position_dtype(num_steps)), (columns, 1))
    rng.permuted(position_of, axis=1, out=position_of)
    repair_splits(position_of, starts)
    return position_of


def position_dtype(num_steps: int) -> type:
    """The smallest integer type holding a step number below ``num_steps``."""
    return np.int16 if num_steps < 2**15 else np.int32 if num_steps < 2**31 else np.int64


def repair_splits(position_of: np.ndarray, starts: np.ndarray) -> None:
    """Repair ``position_of`` (G, S) in place so that no class split across two columns meets itself in a step."""
    columns, num_steps = position_of.shape
    tail, head, next_tail = _split_runs(starts, num_steps, columns)
    split = tail > 0
    loose = tail + head + next_tail <= num_steps
    # Tight columns (two large classes meet) first, in column order: their
    # repair may move the next split class's steps, so the next boundary is
    # checked again. Loose columns never touch another boundary.
    pending = np.flatnonzero(split & ~loose).tolist()
    heapq.heapify(pending)
    while pending:  # one iteration per tight column (a handful; at most G)
        j = heapq.heappop(pending)
        moved_tail = _repair_column(position_of, j, int(tail[j]), int(head[j]), int(next_tail[j]))
        if moved_tail and j + 1 < columns and split[j + 1] and (not pending or pending[0] != j + 1):
            heapq.heappush(pending, j + 1)
    _repair_loose_columns(position_of, np.flatnonzero(split & loose), tail, head, next_tail)


def _repair_column(position_of: np.ndarray, j: int, tail: int, head: int, next_tail: int) -> bool:
    """Move column j's chunks of the class split at boundary j off that class's steps in column j-1.

    Partners are chunks of column j outside its head on steps the class does
    not use; there are always enough (``S - tail - (head - bad) >= bad``).
    Interior partners come first; returns True if a partner of the tail
    (the class continuing into column j+1) had to move.
    """
    num_steps = position_of.shape[1]
    used = position_of[j - 1] >= num_steps - tail  # steps of the class's part in column j-1
    row = position_of[j]
    bad = np.flatnonzero(used & (row < head))
    if not bad.size:
        return False
    free = np.flatnonzero(~used & (row >= head))
    in_tail = row[free] >= num_steps - next_tail
    free = free[np.argsort(in_tail, kind="stable")][: bad.size]
    row[bad], row[free] = row[free], row[bad].copy()
    return bool((row[bad] >= num_steps - next_tail).any())


def _repair_loose_columns(
    position_of: np.ndarray, columns: np.ndarray, tail: np.ndarray, head: np.ndarray, next_tail: np.ndarray
) -> None:
    """Vectorised repair of every loose column at once (``tail + head + next_tail <= S``).

    The k-th colliding chunk of a column swaps steps with the k-th chunk of
    the column's interior (classes wholly inside the column) on a step the
    split class does not use. Such a swap changes no other column's
    constraint, and a loose column always has enough of them.
    """
    # blocks of columns bound the (columns, S) temporaries
    block = max(1, (1 << 20) // max(position_of.shape[1], 1))
    for first in range(0, columns.size, block):
        _repair_loose_block(position_of, columns[first:first + block], tail, head, next_tail)


def _repair_loose_block(
    position_of: np.ndarray, columns: np.ndarray, tail: np.ndarray, head: np.ndarray, next_tail: np.ndarray
) -> None:
    num_steps = position_of.shape[1]
    rows = position_of[columns]
    used = position_of[columns - 1] >= (num_steps - tail[columns])[:, None]
    bad = used & (rows < head[columns][:, None])
    hit = np.flatnonzero(bad.any(axis=1))
    if not hit.size:
        return
    rows, used, bad, columns = rows[hit], used[hit], bad[hit], columns[hit]
    interior = (rows >= head[columns][:, None]) & (rows < (num_steps - next_tail[columns])[:, None])
    good = interior & ~used
    need = bad.sum(axis=1)
    good &= np.cumsum(good, axis=1) <= need[:, None]  # the first `need` partners of each row
    bad_row, bad_step = np.nonzero(bad)
    good_row, good_step = np.nonzero(good)
    assert np.array_equal(bad_row, good_row), "a loose column ran out of repair partners"
    swapped = rows[bad_row, bad_step].copy()
    rows[bad_row, bad_step] = rows[good_row, good_step]
    rows[good_row, good_step] = swapped
    position_of[columns] = rows


def rank_batches(
    layout: EpochLayout,
    index: ClassIndex,
    classes_per_batch: int,
    samples_per_class: int,
    rank: int,
    *,
    start_step: int = 0,
    stop_step: int | None = None,
    first_slot: int | None = None,
) -> np.ndarray:
    """Sample indices of one rank, shape ``(steps, classes_per_batch, samples_per_class)``.

    Rank ``r`` takes slots ``[first_slot, first_slot + classes_per_batch)`` of
    every global step in ``[start_step, stop_step)``; ``first_slot`` defaults
    to ``r * classes_per_batch`` (equal shares). For an uneven split of G over
    W ranks pass the rank's run from :func:`pksampler.samplers.rank_share`.
    Work and memory are proportional to the rank's own share.
    """
    num_steps, columns = layout.num_steps, layout.classes_per_step
    stop_step = num_steps if stop_step is None else min(stop_step, num_steps)
    steps = np.arange(start_step, stop_step, dtype=np.int64)
    first = rank * classes_per_batch if first_slot is None else first_slot
    if not 0 <= first <= columns - classes_per_batch:
        raise ValueError(f"rank_batches: slots [{first}, {first + classes_per_batch}) lie outside the "
                         f"{columns} slots of a global step")
    slots = first + np.arange(classes_per_batch, dtype=np.int64)
    column = (slots[None, :] + layout.slot_shift[steps][:, None]) % columns
    position = column * num_steps + layout.position_of[column, steps[:, None]]
    run = layout.run_of[position]
    chunk = position - layout.starts[run]
    cls = layout.class_order[run]
    size = index.sizes[cls]
    within = (chunk[..., None] * samples_per_class + np.arange(samples_per_class)) % size[..., None]
    keys = mix64(layout.member_key ^ cls.astype(np.uint64))
    rows = within.reshape(-1, samples_per_class)
    shuffled = keyed_permute(rows, size.reshape(-1), keys.reshape(-1)).reshape(within.shape)
    return index.members[index.offsets[cls][..., None] + shuffled].astype(np.int64, copy=False)


def step_classes(layout: EpochLayout) -> np.ndarray:
    """Class codes of the whole epoch, shape ``(S, G)`` in slot order (for analysis and tests).

    O(S*G); the samplers never need it.
    """
    steps = np.arange(layout.num_steps, dtype=np.int64)
    column = (np.arange(layout.classes_per_step)[None, :] + layout.slot_shift[:, None]) % layout.classes_per_step
    position = column * layout.num_steps + layout.position_of[column, steps[:, None]]
    return layout.class_order[layout.run_of[position]]


@dataclass(frozen=True)
class PlanOptions:
    """Seed, epoch, policies and starting step of one P x K plan (the defaults of the samplers).

    Attributes:
        seed: base seed; the epoch's generator is keyed by ``(seed, epoch)``.
        epoch: the epoch to plan.
        small_classes: ``"repeat"`` or ``"drop"`` (see :data:`SMALL_CLASS_POLICIES`).
        class_weighting: exponent a; a class appears in proportion to ``n_c ** a``.
        start_step: the first global step returned.
    """

    seed: int = 0
    epoch: int = 0
    small_classes: str = "repeat"
    class_weighting: float = 1.0
    start_step: int = 0


def balanced_plan(
    index: ClassIndex,
    classes_per_batch: int | None,
    samples_per_class: int,
    num_replicas: int,
    rank: int,
    options: PlanOptions = PlanOptions(),
    *,
    classes_per_step: int | None = None,
) -> np.ndarray:
    """One rank's batches for one epoch, shape ``(steps, P_r * K)``: layout, then slice.

    Give either ``classes_per_batch`` (P, equal shares, G = W * P) or
    ``classes_per_step`` (G, split as evenly as possible: ``P_r`` is
    ``ceil(G/W)`` for the first ``G % W`` ranks, else ``floor(G/W)``).
    """
    total = num_replicas * classes_per_batch if classes_per_step is None else classes_per_step
    first, count = rank_share(total, num_replicas, rank)
    layout = epoch_layout(
        index,
        total,
        samples_per_class,
        seed=options.seed,
        epoch=options.epoch,
        small_classes=options.small_classes,
        class_weighting=options.class_weighting,
    )
    batches = rank_batches(layout, index, count, samples_per_class, rank, start_step=options.start_step,
                           first_slot=first)
    return batches.reshape(batches.shape[0], count * samples_per_class)

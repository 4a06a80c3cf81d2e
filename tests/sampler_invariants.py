"""Invariant checkers shared by the property tests and the pinned edge cases.

Each function takes plans as numpy arrays and raises AssertionError with a
message saying which guarantee broke.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


def make_labels(kind: str, num_classes: int, num_samples: int, seed: int) -> np.ndarray:
    """Label distributions the guarantees must hold on."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        labels = rng.integers(0, num_classes, num_samples)
    elif kind == "zipf":
        weights = 1.0 / np.arange(1, num_classes + 1) ** 1.2
        labels = rng.choice(num_classes, num_samples, p=weights / weights.sum())
    elif kind == "small":  # many classes smaller than K
        labels = rng.integers(0, num_classes, max(num_classes, num_samples // 4))
    elif kind == "dominant":  # one class holds most of the data
        others = rng.integers(1, num_classes, num_samples) if num_classes > 1 else np.zeros(num_samples, np.int64)
        labels = np.where(rng.random(num_samples) < 0.7, 0, others)
    else:
        raise ValueError(kind)
    labels = np.concatenate([np.arange(num_classes), labels])  # every class present
    return rng.permutation(labels)


@st.composite
def sampler_configs(draw: st.DrawFn, max_world: int = 16) -> dict:
    world = draw(st.integers(1, max_world))
    per_rank = draw(st.integers(1, 4))
    k = draw(st.integers(1, 5))
    kind = draw(st.sampled_from(["uniform", "zipf", "small", "dominant"]))
    num_classes = draw(st.integers(world * per_rank, world * per_rank + 40))
    num_samples = draw(st.integers(num_classes, 12 * num_classes))
    seed = draw(st.integers(0, 2**31 - 1))
    labels = make_labels(kind, num_classes, num_samples, seed)
    return {
        "labels": labels,
        "world": world,
        "P": per_rank,
        "K": k,
        "seed": draw(st.integers(0, 1000)),
        "epoch": draw(st.integers(0, 5)),
        "kind": kind,
    }


@st.composite
def split_configs(draw: st.DrawFn, max_world: int = 12) -> dict:
    """Like :func:`sampler_configs`, but the step holds G classes for any W <= G (W need not divide G)."""
    world = draw(st.integers(1, max_world))
    per_step = draw(st.integers(world, 4 * world))
    k = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["uniform", "zipf", "small", "dominant"]))
    num_classes = draw(st.integers(per_step, per_step + 30))
    num_samples = draw(st.integers(num_classes, 10 * num_classes))
    labels = make_labels(kind, num_classes, num_samples, draw(st.integers(0, 2**31 - 1)))
    return {"labels": labels, "world": world, "G": per_step, "K": k, "seed": draw(st.integers(0, 1000)),
            "epoch": draw(st.integers(0, 5)), "kind": kind}


def check_even_split(per_rank: list[np.ndarray], single: np.ndarray, unit: int) -> None:
    """An uneven split is as even as possible, contiguous in rank order, and the ranks' steps equal one process's.

    ``per_rank[r]`` is rank r's ``(steps, width_r)`` plan and ``single`` the
    ``(steps, G * unit)`` plan of one process (``unit``: K indices per class,
    or 1 triplet). Rank widths are ``ceil(G/W)`` then ``floor(G/W)`` units;
    concatenated in rank order they are exactly the single process's steps.
    """
    world, total = len(per_rank), single.shape[1] // unit
    widths = [b.shape[1] // unit for b in per_rank]
    assert all(b.shape[1] % unit == 0 for b in per_rank), "a rank batch holds a partial chunk"
    expected = [total // world + (r < total % world) for r in range(world)]
    assert widths == expected, f"rank shares {widths}, expected the even split {expected} of {total} over {world}"
    assert len({b.shape[0] for b in per_rank}) == 1, f"ranks take different numbers of steps: {[b.shape[0] for b in per_rank]}"
    merged = np.concatenate(per_rank, axis=1)
    assert merged.shape == single.shape, f"{merged.shape} != {single.shape}"
    assert np.array_equal(merged, single), "the ranks' runs, in rank order, are not the single process's global steps"


def check_rank_batches(batches: np.ndarray, labels: np.ndarray, P: int, K: int) -> None:
    """Guarantee 1: P*K indices, P distinct classes, K each, contiguous."""
    assert batches.ndim == 2 and batches.shape[1] == P * K, f"batch shape {batches.shape}, expected (*, {P * K})"
    classes = labels[batches].reshape(batches.shape[0], P, K)
    assert (classes == classes[:, :, :1]).all(), "a class's K indices are not contiguous"
    for step, row in enumerate(classes[:, :, 0]):
        assert np.unique(row).size == P, f"step {step}: classes {row.tolist()} repeat within a rank batch"


def check_disjoint_across_ranks(per_rank: list[np.ndarray], labels: np.ndarray) -> None:
    """Guarantee 2 and 3: equal lengths; no class on two ranks within a step."""
    lengths = {b.shape[0] for b in per_rank}
    assert len(lengths) == 1, f"ranks have different numbers of batches: {[b.shape[0] for b in per_rank]}"
    step_classes = np.concatenate([labels[b] for b in per_rank], axis=1)
    for step, row in enumerate(step_classes):
        distinct_classes = np.unique(row).size
        assert distinct_classes * (row.size // distinct_classes) == row.size
        assert distinct_classes == sum(np.unique(labels[b[step]]).size for b in per_rank), (
            f"step {step}: a class appears on two ranks"
        )


def check_world_invariance(per_rank: list[np.ndarray], single: np.ndarray) -> None:
    """Guarantee 4: the ranks' batches together are the single process's global batches."""
    merged = np.sort(np.concatenate(per_rank, axis=1), axis=1)
    assert merged.shape == single.shape, f"{merged.shape} != {single.shape}"
    assert np.array_equal(merged, np.sort(single, axis=1)), "global batches differ between world sizes"


def check_within_class_balance(indices: np.ndarray, labels: np.ndarray) -> None:
    """Guarantee 5b: inside each class that appears, index counts differ by at most one."""
    counts = np.bincount(indices, minlength=labels.size)
    for cls in np.unique(labels[indices]):
        members = np.flatnonzero(labels == cls)
        spread = counts[members].max() - counts[members].min()
        assert spread <= 1, f"class {cls}: index counts range over {spread + 1} values"


# --- triplets ---------------------------------------------------------------------


def check_triplets(plan: np.ndarray, labels: np.ndarray) -> None:
    """Every triple (a, p, n): p is another sample of a's class, n is from another class."""
    assert plan.ndim == 3 and plan.shape[2] == 3, f"triplet plan shape {plan.shape}, expected (steps, T, 3)"
    a, p, n = plan[..., 0], plan[..., 1], plan[..., 2]
    assert (labels[a] == labels[p]).all(), "a positive is not from its anchor's class"
    assert (a != p).all(), "a positive is its own anchor"
    assert (labels[n] != labels[a]).all(), "a negative is from its anchor's class"


def check_triplet_ranks(per_rank: list[np.ndarray]) -> None:
    """Equal numbers of batches on every rank; no anchor twice in one global step."""
    lengths = [p.shape[0] for p in per_rank]
    assert len(set(lengths)) == 1, f"ranks have different numbers of batches: {lengths}"
    anchors = np.sort(np.concatenate([p[..., 0] for p in per_rank], axis=1), axis=1)
    assert (anchors[:, 1:] != anchors[:, :-1]).all(), "an anchor is used twice in one step"


def check_anchor_coverage(per_rank: list[np.ndarray], labels: np.ndarray, per_step: int) -> None:
    """Every sample of a class with >= 2 samples is an anchor once per epoch, up to the remainder."""
    anchors = np.concatenate([p[..., 0].reshape(-1) for p in per_rank])
    sizes = np.bincount(labels)
    eligible = sizes[labels] >= 2
    assert anchors.size == (int(eligible.sum()) // per_step) * per_step, "wrong number of anchors in the epoch"
    counts = np.bincount(anchors, minlength=labels.size)
    assert counts.max(initial=0) <= 1, "an anchor is used twice in one epoch"
    assert not counts[~eligible].any(), "a class with one sample served as anchor"

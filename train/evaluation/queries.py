"""Which held-out items are queries: every one up to a limit, above it a fixed class-stratified sample.

The gallery stays whole; only the query set is sampled. The sample is a pure
function of (labels, count, seed): the same at every world size and every
evaluation, so curves over epochs compare the same queries. Each class gets
its share of the count (largest remainders first, equal ones in a keyed
random class order), and within a class the
items with the smallest keyed hash of their position are taken.

Recall@1 over a sample of Q queries carries a standard error of about
√(p(1−p)/Q): 0.5 percentage points at Q = 10⁴ (:func:`recall_standard_error`,
which takes the Wilson interval's half-width / 1.96, so it stays positive at
p = 0 or 1 and for a handful of queries).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pksampler.arrays import as_numpy
from pksampler.hashing import GOLDEN, mix64

__all__ = ["recall_standard_error", "stratified_queries"]


def _mix(values: np.ndarray, seed: int) -> np.ndarray:
    """SplitMix64's finaliser of ``values + seed·GOLDEN``: a fixed pseudo-random key per position."""
    with np.errstate(over="ignore"):
        return mix64(values.astype(np.uint64) + np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * GOLDEN)


def stratified_queries(labels: Any, count: int, *, seed: int = 0) -> np.ndarray:
    """Positions (sorted) of the query items: all of them when ``count >= len(labels)``, else a stratified sample.

    Args:
        labels: ``(N,)`` labels of the whole held-out set (every rank passes the same).
        count: the most queries (``eval.queries``).
        seed: keys the sample (the run's seed).

    Example::

        rows = stratified_queries(labels, 10_000, seed=0)   # about 10^4 rows, each class by its share
    """
    labels = as_numpy(labels, name="stratified_queries(labels=)", kinds=None, ndim=1)
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"stratified_queries(count=) must be a positive int, got {count!r}")
    total = labels.size
    if count >= total:
        return np.arange(total, dtype=np.int64)
    _, codes = np.unique(labels, return_inverse=True)
    codes = codes.reshape(-1)
    sizes = np.bincount(codes)
    share = count * sizes / total
    quota = np.floor(share).astype(np.int64)
    extra = count - int(quota.sum())
    if extra:  # largest remainders first; equal remainders (equal classes) in a keyed random class order
        quota[np.lexsort((_mix(np.arange(sizes.size), ~seed), -(share - quota)))[:extra]] += 1
    order = np.lexsort((_mix(np.arange(total), seed), codes))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rank_in_class = np.arange(total) - starts[codes[order]]
    return np.sort(order[rank_in_class < quota[codes[order]]]).astype(np.int64)


#: the normal quantile of the 95% interval the standard error is read from
_Z = 1.959963984540054


def recall_standard_error(recall: float, queries: int) -> float:
    """The standard error of a recall measured on ``queries`` sampled queries (NaN for none).

    The Wilson score interval's half-width divided by z = 1.96:
    √(p(1−p)/Q + z²/(4Q²)) / (1 + z²/Q). For large Q it is √(p(1−p)/Q)
    (0.5 pp at Q = 10⁴, p = 0.5), but unlike that Wald form it stays positive
    at p = 0 or p = 1 (e.g. 0.20 for one query that was right), where
    √(p(1−p)/Q) would claim a recall known exactly.
    """
    if queries < 1 or not math.isfinite(recall):
        return float("nan")
    p, z2 = min(max(recall, 0.0), 1.0), _Z * _Z
    return math.sqrt(p * (1.0 - p) / queries + z2 / (4.0 * queries * queries)) / (1.0 + z2 / queries)

"""Hard-negative mining: the nearest other classes of every class, by faiss k-NN over class centroids.

Plain functions, numpy in and numpy out (the faiss ``contrib`` style); faiss
is imported here, never by the samplers. The triplet sampler receives the
result as a plain table (:meth:`DistributedTripletSampler.set_class_neighbours`);
:class:`pksampler.train.engine.hooks.HardNegativeHook` mines after each epoch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pksampler.arrays import as_numpy

__all__ = ["class_neighbours", "mine_class_neighbours"]


def _as_numpy(value: Any) -> np.ndarray:
    return as_numpy(value, name="class_neighbours", kinds=None, contiguous=False)


def _checked_inputs(embeddings: Any, codes: Any, num_classes: int, hard_classes: int) -> tuple[np.ndarray, np.ndarray]:
    x = _as_numpy(embeddings).astype(np.float32, copy=False)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"class_neighbours(embeddings=) must be a non-empty 2-D array, got shape {x.shape}")
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        raise ValueError(f"class_neighbours(embeddings=) contains NaN or Inf (first in row {int(np.flatnonzero(~finite)[0])})")
    c = _as_numpy(codes)
    if c.shape != (x.shape[0],):
        raise ValueError(f"class_neighbours(codes=) must have shape ({x.shape[0]},), one per embedding row, got {c.shape}")
    if c.dtype.kind not in "iu":
        raise TypeError(f"class_neighbours(codes=) must be integer class codes, got dtype {c.dtype}")
    if c.min() < 0 or c.max() >= num_classes:
        raise ValueError(f"class_neighbours(codes=) must lie in [0, num_classes={num_classes}), got [{c.min()}, {c.max()}]")
    if isinstance(hard_classes, bool) or not isinstance(hard_classes, (int, np.integer)) or not 1 <= hard_classes < max(num_classes, 2):
        raise ValueError(f"class_neighbours(hard_classes=) must be an int in [1, num_classes - 1 = {num_classes - 1}], got {hard_classes!r}")
    return x, c.astype(np.int64, copy=False)


def class_neighbours(embeddings: Any, codes: Any, num_classes: int, hard_classes: int) -> np.ndarray:
    """The ``hard_classes`` nearest other classes of every class, by cosine between class centroids.

    1. Sum the embeddings of each class and L2-normalise the sums (centroid
       directions); classes without embeddings are left out.
    2. Exact inner-product k-NN (faiss ``IndexFlatIP``) of every centroid
       among the centroids, ``hard_classes + 1`` deep.
    3. Drop each class itself, keep the nearest-first order.

    Args:
        embeddings: ``(n, d)`` embeddings (numpy or torch) of any subset of the data.
        codes: ``(n,)`` class codes in ``[0, num_classes)`` of those rows
            (the sampler's codes; see ``ClassIndex.codes_of``).
        num_classes: C, rows of the table.
        hard_classes: neighbours per class, in ``[1, C - 1]``.

    Returns:
        int64 ``(C, hard_classes)`` class codes, nearest first; ``-1`` where a
        class had no embeddings or fewer other classes had any. A row never
        holds its own class.
    """
    import faiss

    x, c = _checked_inputs(embeddings, codes, num_classes, hard_classes)
    sums = np.zeros((num_classes, x.shape[1]), dtype=np.float64)
    np.add.at(sums, c, x)
    present = np.bincount(c, minlength=num_classes) > 0
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


def mine_class_neighbours(embeddings: Any, labels: Any, index: Any, hard_classes: int) -> np.ndarray:
    """:func:`class_neighbours` for a sampler: ``labels`` mapped to the codes of its class index.

    Args:
        embeddings: ``(n, d)`` embeddings of any subset of the sampler's data.
        labels: ``(n,)`` their labels, all known to ``index``.
        index: the sampler's :class:`~pksampler.samplers.ClassIndex` (``sampler.index``).
        hard_classes: neighbours per class (``sampler.hard_classes``).

    Returns the table for ``sampler.set_class_neighbours``.
    """
    owner = "mine_class_neighbours"
    labels = as_numpy(labels, name=f"{owner}(labels=)", kinds=None, contiguous=False)
    rows = np.shape(embeddings)[0] if np.ndim(embeddings) >= 1 else 0
    if labels.shape != (rows,):
        raise ValueError(f"{owner}(labels=) must have shape ({rows},), one label per embedding row, got {labels.shape}")
    codes, known = index.codes_of(labels)
    if not known.all():
        unknown = labels[~known][:3].tolist()
        raise ValueError(
            f"{owner}(labels=) has labels the sampler does not know, e.g. {unknown}: "
            "the class-neighbour table must come from the sampler's labels"
        )
    try:
        return class_neighbours(embeddings, codes, index.num_classes, hard_classes)
    except ValueError as error:
        raise ValueError(f"{owner}: {error}") from None

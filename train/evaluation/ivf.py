"""The approximate search of one gallery shard: an IVF index over a shared coarse quantizer, searched list by list.

For the self-gallery protocol at 10⁶ items and more (every item a query),
exact search costs N² distance computations. Here faiss does what it does:

1. a coarse quantizer (k-means, ``nlist`` centroids) is trained on a sample
   of the gallery gathered from every rank; the sample is the items whose
   keyed hash of their global id is smallest, the same at every W, and one
   rank's centroids (:func:`train_centroids`, on rank 0) reach every rank
   (:func:`.sharded.sharded_retrieval` gathers them);
2. each rank fills a ``faiss.IndexIVFFlat`` over those centroids with its
   own shard, keyed by global id;
3. the queries are searched with faiss's ``contrib.big_batch_search``:
   list by list, every query probing a list meets the list's items in one
   ``faiss.knn`` call, so the work is GEMMs, not N separate probes.

The shards' top-k lists are merged like the exact ones
(:func:`.shard_search.merge_topk`). The evaluation checks itself against
exact search on a sample of queries (:func:`.sharded.sharded_retrieval`,
``index="ivf"``).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any, Callable

import numpy as np

from pksampler.train.evaluation.queries import _mix

__all__ = ["IVF_POINTS_PER_LIST", "build_ivf", "default_nlist", "ivf_search", "sample_mask", "train_centroids"]

#: training points per centroid (faiss's minimum without a warning)
IVF_POINTS_PER_LIST = 39


def default_nlist(total: int) -> int:
    """About √N lists (1,000 at 10⁶: a k-means that takes seconds), at least 1, at most N / 39."""
    return int(max(1, min(np.sqrt(total), total // 39)))


def sample_mask(ids: np.ndarray, fraction: float, *, seed: int) -> np.ndarray:
    """Which of these global ids belong to the training sample: a keyed hash below ``fraction`` of its range."""
    if fraction >= 1.0:
        return np.ones(ids.shape, dtype=bool)
    return _mix(ids, seed) < np.uint64(int(fraction * 2**64))


def train_centroids(sample: np.ndarray, nlist: int, *, metric: str, seed: int) -> np.ndarray:
    """k-means centroids of ``sample`` (spherical for inner products), float32 ``(nlist, d)``.

    ``nlist`` shrinks to keep at least :data:`IVF_POINTS_PER_LIST` points per centroid.
    """
    import faiss

    nlist = max(1, min(nlist, sample.shape[0] // IVF_POINTS_PER_LIST))
    kmeans = faiss.Kmeans(sample.shape[1], nlist, niter=20, seed=seed, spherical=metric != "l2")
    kmeans.train(np.ascontiguousarray(sample, dtype=np.float32))
    return np.ascontiguousarray(kmeans.centroids, dtype=np.float32)


def build_ivf(shard: np.ndarray, shard_ids: np.ndarray, centroids: np.ndarray, *, metric: str, nprobe: int,
              rows: Callable[[np.ndarray], np.ndarray] | None = None, block_rows: int = 1 << 16) -> Any:
    """A ``faiss.IndexIVFFlat`` over ``centroids`` holding this shard, keyed by global id.

    ``rows`` maps each block of ``block_rows`` shard rows to what is indexed
    (the cosine search normalises them), so only the index holds a second copy.
    """
    import faiss

    kind = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
    quantizer = faiss.IndexFlat(centroids.shape[1], kind)
    quantizer.add(centroids)
    index = faiss.IndexIVFFlat(quantizer, centroids.shape[1], centroids.shape[0], kind)
    index.is_trained = True
    for start in range(0, shard.shape[0], block_rows):
        block = shard[start:start + block_rows]
        index.add_with_ids(block if rows is None else rows(block), shard_ids[start:start + block_rows])
    index.nprobe = min(nprobe, centroids.shape[0])
    return index


def ivf_search(index: Any, queries: np.ndarray, query_ids: np.ndarray, k: int, *,
               metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Approximate best ``k`` (distance, global id) per query, self left out; ``inf``/``-1`` pad.

    Distances are smaller-is-nearer (negated inner products), sorted by
    (distance, id) as the exact lists are.
    """
    from faiss.contrib.big_batch_search import big_batch_search

    rows = queries.shape[0]
    if index.ntotal == 0 or rows == 0:
        return np.full((rows, k), np.inf), np.full((rows, k), -1, dtype=np.int64)
    # Its progress report prints at every list even with verbose=0 (faiss 1.15's report()), and verbose=1
    # prints timings instead: the trainer's log stays clean only without its stdout.
    with contextlib.redirect_stdout(io.StringIO()):
        scores, ids = big_batch_search(index, np.ascontiguousarray(queries, dtype=np.float32), k + 1)
    ids = ids.astype(np.int64)
    dist = (scores if metric == "l2" else -scores).astype(np.float64)
    dist[(ids < 0) | (ids == query_ids[:, None])] = np.inf
    order = np.lexsort((np.where(ids < 0, np.iinfo(np.int64).max, ids), dist), axis=1)[:, :k]
    dist, ids = np.take_along_axis(dist, order, axis=1), np.take_along_axis(ids, order, axis=1)
    return dist, np.where(np.isfinite(dist), ids, -1)

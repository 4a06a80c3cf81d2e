"""Exact k-NN over one share of a gallery, and the merge of the shares' lists on (distance, global id).

The pure half of the evaluation of a gallery split over the ranks (:mod:`.sharded` is the
distributed driver): numpy in, numpy out, so one process can check every
world size by looping over shares.

Why the merged lists do not depend on how the gallery is split:

1. Each shard holds its items sorted by global id, so "ties by shard
   position" is "ties by global id".
2. faiss (``faiss.knn``, no index copy of the shard) fetches a few more
   neighbours than asked; every fetched candidate's distance is then
   recomputed in float64, elementwise (:func:`~.metrics._exact_distances`),
   so a pair's distance is the same bits whatever shard and block it sits in
   (a BLAS product may round a pair differently at another offset).
3. Each shard returns its best k by (distance, global id); rows whose ties
   reach past the fetched candidates are ranked by the same gallery scan as
   :func:`~.metrics.evaluate_retrieval` (:func:`~.metrics._resolve_ties`).
4. :func:`merge_topk` keeps the best k of the W lists by (distance, global
   id): the global top k, the same list at every W.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pksampler.train.evaluation.metrics import _TIE_MARGIN, _exact_distances, _normalise, _resolve_ties

__all__ = ["merge_topk", "search_shard", "search_unit_blocks"]

#: query rows whose candidates' exact distances are computed at once
_EXACT_ROWS = 512


def _faiss_knn(queries: np.ndarray, shard: np.ndarray, fetch: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """faiss's brute-force k-NN without an index (an index would copy the shard)."""
    import faiss

    kind = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
    scores, ids = faiss.knn(queries, shard, fetch, metric=kind)
    return (scores if metric == "l2" else -scores).astype(np.float64), ids.astype(np.int64)


def _search_rows(queries: np.ndarray, shard: np.ndarray, self_local: np.ndarray, k: int,
                 metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Best ``k`` shard positions of each query by (exact distance, position); ``inf``/``-1`` pad."""
    rows, size = queries.shape[0], shard.shape[0]
    fetch = min(k + 1 + _TIE_MARGIN, size)
    faiss_dist, ids = _faiss_knn(queries, shard, fetch, metric)
    is_self = ids == self_local[:, None]
    faiss_dist = np.sort(np.where(is_self, np.inf, faiss_dist), axis=1)
    exact = np.empty(ids.shape)
    for start in range(0, rows, _EXACT_ROWS):  # bounded float64 temporaries, whatever the chunk
        part = slice(start, start + _EXACT_ROWS)
        exact[part] = _exact_distances(queries[part], shard[ids[part]], metric)
    exact[is_self] = np.inf
    order = np.lexsort((ids, exact), axis=1)
    exact, ids = np.take_along_axis(exact, order, axis=1), np.take_along_axis(ids, order, axis=1)
    keep = min(k, fetch)
    dist = np.full((rows, k), np.inf)
    out = np.full((rows, k), -1, dtype=np.int64)
    dist[:, :keep], out[:, :keep] = exact[:, :keep], ids[:, :keep]
    if fetch < size:  # then fetch > k + 1: every row has k candidates besides itself
        # Unseen items may tie with the k-th when the last valid candidate is no
        # farther than it, by the exact distances or by faiss's own.
        last = np.isfinite(exact).sum(axis=1) - 1
        tied = np.flatnonzero((exact[np.arange(rows), last] <= exact[:, k - 1])
                              | (faiss_dist[np.arange(rows), last] <= faiss_dist[:, k - 1]))
        if tied.size:
            dist[tied], out[tied] = _resolve_ties(queries[tied], shard, ids[tied], k, metric, self_local[tied])
    out[~np.isfinite(dist)] = -1
    return dist, out


def search_shard(queries: np.ndarray, query_ids: np.ndarray, shard: np.ndarray, shard_ids: np.ndarray, k: int, *,
                 metric: str, exclude_self: bool = True, chunk_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` nearest items of one shard for every query, ranked by (float64 distance, global id).

    Args:
        queries: ``(Q, d)`` float32, already normalised for ``"cosine"`` (then searched as ``"ip"``).
        query_ids: ``(Q,)`` global ids of the queries (their own gallery item is left out with
            ``exclude_self``).
        shard: ``(n, d)`` float32 C-contiguous, normalised like the queries; ``n`` may be 0.
        shard_ids: ``(n,)`` strictly increasing global ids of the shard's rows.
        k: neighbours per query.
        metric: ``"cosine"``, ``"ip"`` or ``"l2"``.
        exclude_self: a query is never its own neighbour.
        chunk_size: queries per faiss call.

    Returns:
        ``D, I``: ``(Q, k)`` float64 distances (smaller is nearer; negated inner products)
        and global ids; ``inf``/``-1`` where the shard holds fewer than ``k`` candidates.
    """
    dist = np.full((queries.shape[0], k), np.inf)
    ids = np.full((queries.shape[0], k), -1, dtype=np.int64)
    if shard.shape[0] == 0 or queries.shape[0] == 0:
        return dist, ids
    search_metric = "ip" if metric == "cosine" else metric
    position = np.minimum(np.searchsorted(shard_ids, query_ids), shard_ids.size - 1)
    self_local = np.where(exclude_self & (shard_ids[position] == query_ids), position, -1)
    for start in range(0, queries.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        dist[part], local = _search_rows(queries[part], shard, self_local[part], k, search_metric)
        ids[part] = np.where(local >= 0, shard_ids[np.maximum(local, 0)], -1)
    return dist, ids


def search_unit_blocks(queries: np.ndarray, query_ids: np.ndarray, shard: np.ndarray, shard_ids: np.ndarray, k: int,
                       *, block_rows: int, chunk_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """:func:`search_shard` with ``metric="cosine"`` over a shard that is not normalised, one block at a time.

    Each block of ``block_rows`` rows is normalised into a temporary and
    searched as a shard of its own; :func:`merge_topk` joins the blocks' lists.
    A block is a finer split of the gallery, so the lists are the ones the
    whole normalised shard gives, bit for bit, while the shard is held once
    (plus one block) instead of twice. ``queries`` are normalised already.
    """
    dists, found = [], []
    for start in range(0, max(shard.shape[0], 1), block_rows):
        rows = slice(start, start + block_rows)
        dist, ids = search_shard(queries, query_ids, unit_rows(shard[rows]), shard_ids[rows], k, metric="cosine",
                                 chunk_size=chunk_size)
        dists.append(dist)
        found.append(ids)
    return merge_topk(dists, found, k) if len(dists) > 1 else (dists[0], found[0])


def unit_rows(x: np.ndarray) -> np.ndarray:
    """``x``'s rows L2-normalised into a new float32 array (zero rows stay zero), as :mod:`.metrics` normalises."""
    return _normalise(x).astype(np.float32, copy=False)


def merge_topk(dists: Sequence[np.ndarray], ids: Sequence[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise best ``k`` of several shards' ``(Q, k_s)`` lists, by (distance, global id); pads last.

    The result is the same for any order of the shards and any split of
    the gallery: a total order on (distance, id) picks the same k items.
    """
    dist = np.concatenate(list(dists), axis=1)
    found = np.concatenate(list(ids), axis=1)
    # Pads (inf, -1) go after every real item: sort them on the largest id.
    key = np.where(found < 0, np.iinfo(np.int64).max, found)
    order = np.lexsort((key, dist), axis=1)[:, :k]
    return np.take_along_axis(dist, order, axis=1), np.take_along_axis(found, order, axis=1)

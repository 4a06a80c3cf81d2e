"""Retrieval evaluation with faiss: Recall@K, precision@1, R-precision, MAP@R.

Definitions follow "A Metric Learning Reality Check" (Musgrave et al., 2020).
For a query with label y, let R be the number of gallery items labelled y
(the query itself excluded when the query set is its own gallery), and rank
the gallery by distance, ties broken by gallery index:

* ``recall_at_k``: fraction of queries with at least one item of class y in the top k;
* ``precision_at_1``: fraction of queries whose nearest item is of class y;
* ``r_precision``: mean over queries of (items of class y in the top R) / R;
* ``map_at_r``: mean over queries of ``(1/R) * sum_{i<=R} P(i) * [item i is of class y]``,
  where P(i) is the precision of the top i.

Queries with R = 0 are excluded and counted in ``num_excluded``. The search
streams over query chunks, asking faiss for only as many neighbours as the
chunk's largest R needs, so memory stays bounded for a 10^6-item gallery and
no N x N matrix is ever built.

Exact ties. faiss returns *some* k items among equally distant ones, not the
lowest-indexed. A few extra neighbours are fetched; a row whose last fetched
distance still equals its k-th is a *tie row*, and the items tied at the cut
may lie anywhere in the gallery. Tie rows are resolved together
(:func:`_resolve_ties`): the gallery is scanned in index order, in blocks
that double in size, and a row stops as soon as the scanned prefix holds k
items no farther than its k-th distance, because every later item with the
same distance has a larger index. A collapsed model (all embeddings equal)
therefore costs one small block per query instead of a full gallery pass.

:func:`evaluate_retrieval` also returns the ranked neighbours of requested
query rows (for the result gallery), taken from the same search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from pksampler.arrays import as_numpy

__all__ = ["METRICS", "RetrievalResult", "evaluate_retrieval", "knn_search", "retrieval_metrics"]

METRICS = ("cosine", "l2", "ip")
#: neighbours fetched beyond what is needed, to see ties that cross the cut
_TIE_MARGIN = 4
#: float64 elements held at once while scanning the gallery for tied items
_TIE_BUDGET = 1 << 22


@dataclass(frozen=True)
class RetrievalResult:
    """What :func:`evaluate_retrieval` found.

    Attributes:
        metrics: ``{"recall_at_{k}", "precision_at_1", "r_precision", "map_at_r",
            "num_queries", "num_excluded"}``, as :func:`retrieval_metrics` returns.
        rows: the query rows whose neighbours were kept (``neighbour_rows=``), in the given order.
        neighbours: ``(len(rows), num_neighbours)`` gallery indices, nearest first,
            ties by index, the query itself left out for a self-gallery; ``-1`` pads.
        distances: same shape; smaller is nearer (squared L2, or the negated
            cosine / inner product); ``inf`` pads.
        metric: the metric used.
    """

    metrics: dict[str, float]
    rows: np.ndarray
    neighbours: np.ndarray
    distances: np.ndarray
    metric: str

    @property
    def similarities(self) -> np.ndarray:
        """Cosine similarity (or inner product) of each neighbour; ``-distance`` for l2, NaN pads."""
        values = -self.distances
        return np.where(np.isfinite(values), values, np.nan)


def _as_matrix(function: str, name: str, value: Any) -> np.ndarray:
    return as_numpy(value, name=f"{function}({name}=)", dtype=np.float32, ndim=2, non_empty=True, finite=True)


def _as_labels(name: str, value: Any, length: int, rows_name: str) -> np.ndarray:
    labels = as_numpy(value, name=f"retrieval_metrics({name}=)", kinds=None)
    if labels.ndim != 1 or labels.shape[0] != length:
        raise ValueError(
            f"retrieval_metrics({name}=) must be 1-D with one label per row of {rows_name} ({length}), "
            f"got shape {labels.shape}"
        )
    return labels


def _normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def _check_metric(function: str, metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"{function}(metric=) must be one of {list(METRICS)}, got {metric!r}")


def _build_index(gallery: np.ndarray, metric: str):
    import faiss

    index = faiss.IndexFlatL2(gallery.shape[1]) if metric == "l2" else faiss.IndexFlatIP(gallery.shape[1])
    index.add(gallery)
    return index


def knn_search(
    query: Any,
    gallery: Any,
    k: int,
    *,
    metric: str = "cosine",
    exclude_self: bool = False,
    index: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest neighbours with faiss, ties broken by gallery index.

    Args:
        query, gallery: ``(n, d)`` arrays or tensors; normalised here for ``"cosine"``.
        k: neighbours per query.
        metric: ``"cosine"``, ``"ip"`` (inner product) or ``"l2"`` (squared L2).
        exclude_self: query i is gallery item i and is left out of its own list.
        index: a faiss index already holding ``gallery`` (as prepared for the metric).

    Returns:
        ``D, I``: ``(n, k)`` distances (smaller is nearer; negated scores for
        inner products) and gallery indices, ``-1``/``inf`` where the gallery
        has fewer than k items.
    """
    _check_metric("knn_search", metric)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"knn_search(k=) must be a positive int, got {k!r}")
    query = _as_matrix("knn_search", "query", query)
    gallery = _as_matrix("knn_search", "gallery", gallery)
    if metric == "cosine":
        query, gallery = _normalise(query), _normalise(gallery)
    index = _build_index(gallery, metric) if index is None else index
    return _search_chunk(query, gallery, np.arange(query.shape[0]), int(k), metric, exclude_self, index)


def retrieval_metrics(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    ks: Sequence[int] = (1, 5, 10),
    metric: str = "cosine",
    chunk_size: int = 4096,
    max_neighbours_per_chunk: int = 1 << 24,
) -> dict[str, float]:
    """Recall@k, precision@1, R-precision and MAP@R of a query set against a gallery.

    Args:
        query: ``(n, d)`` embeddings (numpy or torch).
        query_labels: ``(n,)`` labels.
        gallery, gallery_labels: the searched set; ``None`` uses the query set
            itself and excludes each query's own row (by index, so exact
            duplicates of a query still count).
        ks: the k of each ``recall_at_{k}``.
        metric: ``"cosine"`` (embeddings L2-normalised here), ``"ip"`` or ``"l2"``.
        chunk_size: queries per search call (at most).
        max_neighbours_per_chunk: bound on ``rows * k`` held at once; large R
            shrinks the chunk accordingly.

    Returns:
        ``{"recall_at_{k}": ..., "precision_at_1", "r_precision", "map_at_r",
        "num_queries", "num_excluded"}``.
    """
    return evaluate_retrieval(query, query_labels, gallery, gallery_labels, ks=ks, metric=metric,
                              chunk_size=chunk_size, max_neighbours_per_chunk=max_neighbours_per_chunk).metrics


def evaluate_retrieval(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    ks: Sequence[int] = (1, 5, 10),
    metric: str = "cosine",
    neighbour_rows: Any = None,
    num_neighbours: int = 5,
    chunk_size: int = 4096,
    max_neighbours_per_chunk: int = 1 << 24,
) -> RetrievalResult:
    """:func:`retrieval_metrics` plus the ranked neighbours of some query rows, from one search.

    Args:
        neighbour_rows: query row indices whose top ``num_neighbours`` are kept
            (e.g. the rows shown in the result gallery); ``None`` keeps none.
        num_neighbours: neighbours kept per requested row.
        Everything else as in :func:`retrieval_metrics`.

    Example::

        result = evaluate_retrieval(embeddings, labels, neighbour_rows=[0, 40, 80], num_neighbours=5)
        result.metrics["recall_at_1"], result.neighbours, result.similarities
    """
    ks = _check_options(metric, ks, chunk_size=chunk_size, num_neighbours=num_neighbours)
    query, query_labels, gallery, gallery_labels, self_gallery = _prepare(
        query, query_labels, gallery, gallery_labels, metric)
    wanted = _neighbour_rows(neighbour_rows, query.shape[0])

    relevant, query_codes, gallery_codes = _relevant_counts(query_labels, gallery_labels, self_gallery)
    used = np.flatnonzero(relevant > 0)
    names = [f"recall_at_{k}" for k in ks] + ["precision_at_1", "r_precision", "map_at_r"]
    per_query = {name: np.zeros(query.shape[0], dtype=np.float64) for name in names}
    shown = _Shown.of(wanted, query.shape[0], num_neighbours)
    index = _build_index(gallery, metric)
    search = lambda rows, k: _search_chunk(query, gallery, rows, k, metric, self_gallery, index)  # noqa: E731
    for chunk in _relevance_chunks(relevant, used, max(ks), chunk_size, max_neighbours_per_chunk):
        need = max(max(ks), int(relevant[chunk].max()))
        requested = shown.slot[chunk] >= 0
        dist, ids = search(chunk, max(need, num_neighbours) if requested.any() else need)
        shown.keep(chunk[requested], ids[requested], dist[requested])
        ids = ids[:, :need]
        hits = (ids >= 0) & (gallery_codes[np.maximum(ids, 0)] == query_codes[chunk][:, None])
        _score(per_query, chunk, hits, relevant[chunk], ks)
    # Requested rows without a relevant item were not searched above.
    missing = shown.rows[relevant[shown.rows] <= 0]
    if missing.size:
        dist, ids = search(missing, num_neighbours)
        shown.keep(missing, ids, dist)
    count = used.size
    # Means over per-query values in query order: identical for any chunking.
    metrics = {name: (float(values[used].mean()) if count else float("nan")) for name, values in per_query.items()}
    metrics["num_queries"] = int(count)
    metrics["num_excluded"] = int(query.shape[0] - count)
    return RetrievalResult(metrics, wanted, shown.ids[shown.slot[wanted]], shown.dist[shown.slot[wanted]], metric)


@dataclass(frozen=True)
class _Shown:
    """The neighbours kept for the requested query rows (a result gallery), one slot per distinct row."""

    rows: np.ndarray  # the distinct requested rows
    slot: np.ndarray  # slot[row]: where a requested row's neighbours are kept (-1: not requested)
    ids: np.ndarray
    dist: np.ndarray

    @classmethod
    def of(cls, wanted: np.ndarray, num_queries: int, width: int) -> "_Shown":
        rows = np.unique(wanted)
        slot = np.full(num_queries, -1, dtype=np.int64)
        slot[rows] = np.arange(rows.size)
        ids = np.full((rows.size, width), -1, dtype=np.int64)
        return cls(rows, slot, ids, np.full(ids.shape, np.inf, dtype=np.float64))

    def keep(self, rows: np.ndarray, ids: np.ndarray, dist: np.ndarray) -> None:
        """The first neighbours of requested ``rows`` (their search's ``ids`` and ``dist``)."""
        if not rows.size:
            return
        width = self.ids.shape[1]
        self.ids[self.slot[rows]], self.dist[self.slot[rows]] = ids[:, :width], dist[:, :width]


def _relevance_chunks(relevant: np.ndarray, used: np.ndarray, least: int, chunk_size: int, budget: int):
    """The ``used`` query rows in chunks by increasing R, so each chunk asks for about the k it needs (at least
    ``least``), each bounded by ``budget`` neighbours; every chunk sorted."""
    by_relevant = used[np.argsort(relevant[used], kind="stable")]
    start = 0
    while start < by_relevant.size:
        need = max(least, int(relevant[by_relevant[min(start + chunk_size, by_relevant.size) - 1]]))
        rows = max(1, min(chunk_size, budget // max(need, 1)))
        yield np.sort(by_relevant[start:start + rows])
        start += rows


def _check_options(metric: str, ks: Sequence[int], *, owner: str = "retrieval_metrics",
                   **counts: Any) -> tuple[int, ...]:
    """Validate the metric, the ks and the positive-int options; returns ks as a tuple.

    ``owner`` is the public function the user called, named in the error.
    """
    _check_metric(owner, metric)
    try:
        ks = tuple(ks)
    except TypeError:
        raise ValueError(f"{owner}(ks=) must be a sequence of positive ints, got {ks!r}") from None
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 for k in ks):
        raise ValueError(f"{owner}(ks=) must be positive ints, got {ks!r}")
    for arg, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{owner}({arg}=) must be a positive int, got {value!r}")
    return ks


def _prepare(query: Any, query_labels: Any, gallery: Any, gallery_labels: Any, metric: str):
    """Checked float32 query/gallery (normalised for cosine) and their labels."""
    query = _as_matrix("retrieval_metrics", "query", query)
    query_labels = _as_labels("query_labels", query_labels, query.shape[0], "query")
    self_gallery = gallery is None
    if self_gallery:
        if gallery_labels is not None:
            raise ValueError("retrieval_metrics(gallery_labels=) given without gallery=")
        gallery, gallery_labels = query, query_labels
    else:
        gallery = _as_matrix("retrieval_metrics", "gallery", gallery)
        if gallery_labels is None:
            raise ValueError("retrieval_metrics(gallery_labels=) is required when gallery= is given")
        gallery_labels = _as_labels("gallery_labels", gallery_labels, gallery.shape[0], "gallery")
        if gallery.shape[1] != query.shape[1]:
            raise ValueError(
                f"retrieval_metrics: query has dimension {query.shape[1]} but gallery has {gallery.shape[1]}"
            )
    if metric == "cosine":
        query = _normalise(query)
        gallery = query if self_gallery else _normalise(gallery)
    return query, query_labels, gallery, gallery_labels, self_gallery


def _neighbour_rows(value: Any, num_queries: int) -> np.ndarray:
    if value is None:
        return np.zeros(0, dtype=np.int64)
    rows = as_numpy(value, name="retrieval_metrics(neighbour_rows=)", kinds="iu", ndim=1).astype(np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= num_queries):
        raise ValueError(
            f"retrieval_metrics(neighbour_rows=) must lie in [0, {num_queries}), got values from "
            f"{rows.min()} to {rows.max()}"
        )
    return rows


def _relevant_counts(query_labels: np.ndarray, gallery_labels: np.ndarray, self_gallery: bool):
    """R per query (same-class gallery items, minus the query itself) and integer class codes."""
    classes, gallery_codes = np.unique(gallery_labels, return_inverse=True)
    class_sizes = np.bincount(gallery_codes.reshape(-1), minlength=classes.size)
    position = np.minimum(np.searchsorted(classes, query_labels), classes.size - 1)
    known = classes[position] == query_labels
    relevant = np.where(known, class_sizes[position], 0) - int(self_gallery)
    return relevant, np.where(known, position, -1), gallery_codes.reshape(-1)


def _search_chunk(query, gallery, rows, k, metric, self_gallery, index):
    """The k nearest gallery items of ``query[rows]``, a few extra fetched to see ties at the cut."""
    fetch = min(k + int(self_gallery) + _TIE_MARGIN, gallery.shape[0])
    scores, ids = index.search(query[rows], fetch)
    return _finish(query, gallery, rows, scores, ids, k, metric, rows if self_gallery else None)


def _finish(query, gallery, rows, scores, ids, k, metric, self_ids):
    """Sort by (distance, index), drop self, resolve rows whose ties cross the cut."""
    dist = (scores if metric == "l2" else -scores).astype(np.float64)
    dist = np.where(ids < 0, np.inf, dist)
    fetched = ids.shape[1]
    if self_ids is not None:
        dist = np.where(ids == self_ids[:, None], np.inf, dist)
    order = np.lexsort((ids, dist), axis=1)
    dist = np.take_along_axis(dist, order, axis=1)
    ids = np.take_along_axis(ids, order, axis=1)
    available = gallery.shape[0] - (1 if self_ids is not None else 0)
    keep = min(k, available)
    # If the last fetched distance equals the keep-th, unseen gallery items may
    # tie with the kept ones: those rows are ranked exactly.
    if fetched < gallery.shape[0] and keep > 0:
        valid = fetched - (1 if self_ids is not None else 0)
        tied = np.flatnonzero(dist[:, valid - 1] <= dist[:, keep - 1])
        if tied.size:
            candidates = ids[tied]
            dist, ids = dist[:, :keep].copy(), ids[:, :keep].copy()
            dist[tied], ids[tied] = _resolve_ties(query[rows[tied]], gallery, candidates, keep, metric,
                                                  None if self_ids is None else self_ids[tied])
    ids = np.where(np.isfinite(dist), ids, -1)[:, :k]
    dist = dist[:, :k]
    if ids.shape[1] < k:
        pad = k - ids.shape[1]
        ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
        dist = np.pad(dist, ((0, 0), (0, pad)), constant_values=np.inf)
    return dist, ids


def _exact_distances(vectors: np.ndarray, items: np.ndarray, metric: str) -> np.ndarray:
    """float64 distances of ``vectors[r]`` to ``items[r, j]`` (``items``: ``(rows, m, d)`` or ``(m, d)``).

    Elementwise products summed over the last axis: the same arithmetic for a
    fetched candidate and for the same item met again in the scan, so exact
    ties stay exact (a BLAS product may round the two differently).
    """
    q = vectors.astype(np.float64)[:, None, :]
    g = items if items.ndim == 3 else items[None]
    if metric == "l2":
        # float32 items meet float64 queries inside the ufunc: no float64 copy of the items
        diff = np.subtract(g, q)
        return np.square(diff, out=diff).sum(axis=-1)
    return -np.multiply(g, q).sum(axis=-1)


def _resolve_ties(vectors, gallery, candidates, keep, metric, self_ids):
    """Exact top ``keep`` by (distance, gallery index) for rows whose ties reach past the fetched items.

    1. tau = the keep-th exact distance among the fetched candidates (self excluded);
       the answer holds only items at distance <= tau.
    2. Scan the gallery from index 0 in blocks that double in size (all
       unfinished rows share a block); keep the best ``keep`` scanned items
       with distance <= tau per row. A row is finished once it holds ``keep``
       of them: every unscanned item at distance tau has a larger index.
    3. Merge the fetched candidates beyond the scanned prefix (items nearer
       than tau that faiss found at high indices).

    Memory is bounded by ``_TIE_BUDGET`` float64 values per step.
    """
    rows, size = vectors.shape[0], gallery.shape[0]
    cand_dist = np.concatenate([
        _exact_distances(vectors[part], gallery[candidates[part]], metric)
        for part in _slices(rows, max(1, _TIE_BUDGET // max(1, candidates.shape[1] * gallery.shape[1])))
    ]) if rows else np.zeros(candidates.shape)
    if self_ids is not None:
        cand_dist[candidates == self_ids[:, None]] = np.inf
    cand_order = np.lexsort((candidates, cand_dist), axis=1)
    tau = np.take_along_axis(cand_dist, cand_order, axis=1)[:, keep - 1]

    best_dist = np.full((rows, keep), np.inf)
    best_ids = np.full((rows, keep), size, dtype=np.int64)
    scanned = np.zeros(rows, dtype=np.int64)
    active = np.arange(rows)
    start, block = 0, max(candidates.shape[1], 16)  # collapsed: one block
    while active.size and start < size:
        stop = min(start + block, size)
        step_rows = max(1, _TIE_BUDGET // ((stop - start) * gallery.shape[1]))
        for part in _slices(active.size, step_rows):
            act = active[part]
            d = _exact_distances(vectors[act], gallery[start:stop], metric)
            ids = np.broadcast_to(np.arange(start, stop), d.shape)
            if self_ids is not None:
                d = np.where(ids == self_ids[act, None], np.inf, d)
            d = np.where(d <= tau[act, None], d, np.inf)
            best_dist[act], best_ids[act] = _merge(best_dist[act], best_ids[act], d, ids, keep)
        scanned[active] = stop
        active = active[~np.isfinite(best_dist[active, keep - 1])]
        start, block = stop, block * 2
    outside = candidates >= scanned[:, None]
    dist, ids = _merge(best_dist, best_ids, np.where(outside, cand_dist, np.inf), candidates, keep)
    return dist, np.where(np.isfinite(dist), ids, -1)


def _merge(dist_a, ids_a, dist_b, ids_b, keep):
    """Row-wise best ``keep`` of two (distance, index) lists, ordered by (distance, index)."""
    dist = np.concatenate([dist_a, dist_b], axis=1)
    ids = np.concatenate([ids_a, ids_b], axis=1)
    order = np.lexsort((ids, dist), axis=1)[:, :keep]
    return np.take_along_axis(dist, order, axis=1), np.take_along_axis(ids, order, axis=1)


def _slices(total: int, step: int):
    return [slice(s, min(s + step, total)) for s in range(0, total, step)]


def _score(per_query: dict[str, np.ndarray], rows: np.ndarray, hits: np.ndarray, relevant: np.ndarray,
           ks: Sequence[int]) -> None:
    """Per-query metric values from the ranked hit matrix (hits[i, j]: j-th neighbour is relevant)."""
    for k in ks:
        per_query[f"recall_at_{k}"][rows] = hits[:, :k].any(axis=1)
    per_query["precision_at_1"][rows] = hits[:, 0]
    width = hits.shape[1]
    hits_r = hits & (np.arange(width)[None, :] < relevant[:, None])
    per_query["r_precision"][rows] = hits_r.sum(axis=1) / relevant
    precision_at_i = np.cumsum(hits_r, axis=1) / np.arange(1, width + 1)[None, :]
    per_query["map_at_r"][rows] = (precision_at_i * hits_r).sum(axis=1) / relevant

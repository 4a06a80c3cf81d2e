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
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .checkpoint import atomic_write_bytes

__all__ = ["METRICS", "knn_search", "retrieval_metrics", "save_gallery_png"]

METRICS = ("cosine", "l2", "ip")
#: neighbours fetched beyond what is needed, to see ties that cross the cut
_TIE_MARGIN = 4


def _as_matrix(name: str, value: Any) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype.kind not in "fiu":
        raise TypeError(f"retrieval_metrics({name}=) must be numeric, got dtype {array.dtype}")
    if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"retrieval_metrics({name}=) must be a non-empty 2-D (items, dim) array, got shape {array.shape}")
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(array).all():
        bad = int(np.flatnonzero(~np.isfinite(array).all(axis=1))[0])
        raise ValueError(f"retrieval_metrics({name}=) contains NaN or Inf (first in row {bad})")
    return array


def _as_labels(name: str, value: Any, length: int, rows_name: str) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    labels = np.asarray(value)
    if labels.ndim != 1 or labels.shape[0] != length:
        raise ValueError(
            f"retrieval_metrics({name}=) must be 1-D with one label per row of {rows_name} ({length}), got shape {labels.shape}"
        )
    return labels


def _normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def _build_index(gallery: np.ndarray, metric: str):
    import faiss

    index = faiss.IndexFlatL2(gallery.shape[1]) if metric == "l2" else faiss.IndexFlatIP(gallery.shape[1])
    index.add(gallery)
    return index


def _distances_to_all(vector: np.ndarray, gallery: np.ndarray, metric: str, block: int = 65536) -> np.ndarray:
    """Distances (float64) of one query to the whole gallery, in blocks (tie fallback)."""
    vector = vector.astype(np.float64)
    out = np.empty(gallery.shape[0], dtype=np.float64)
    for start in range(0, gallery.shape[0], block):
        part = gallery[start:start + block].astype(np.float64)
        out[start:start + block] = ((part - vector) ** 2).sum(axis=1) if metric == "l2" else -(part @ vector)
    return out


def knn_search(
    query: np.ndarray,
    gallery: np.ndarray,
    k: int,
    *,
    metric: str = "cosine",
    exclude_self: bool = False,
    index: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest neighbours with faiss, ties broken by gallery index.

    Args:
        query, gallery: ``(n, d)`` arrays; normalised here for ``"cosine"``.
        k: neighbours per query.
        metric: ``"cosine"``, ``"ip"`` (inner product) or ``"l2"`` (squared L2).
        exclude_self: query i is gallery item i and is left out of its own list.
        index: a faiss index already holding ``gallery`` (as prepared for the metric).

    Returns:
        ``D, I``: ``(n, k)`` distances (smaller is nearer; negated scores for
        inner products) and gallery indices, ``-1``/``inf`` where the gallery
        has fewer than k items.
    """
    if metric not in METRICS:
        raise ValueError(f"knn_search(metric=) must be one of {list(METRICS)}, got {metric!r}")
    query = _as_matrix("query", query)
    gallery = _as_matrix("gallery", gallery)
    if metric == "cosine":
        query, gallery = _normalise(query), _normalise(gallery)
    index = _build_index(gallery, metric) if index is None else index
    return _search_chunk(query, gallery, np.arange(query.shape[0]), k, metric, exclude_self, index)


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
    if metric not in METRICS:
        raise ValueError(f"retrieval_metrics(metric=) must be one of {list(METRICS)}, got {metric!r}")
    ks = tuple(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 for k in ks):
        raise ValueError(f"retrieval_metrics(ks=) must be positive ints, got {ks!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"retrieval_metrics(chunk_size=) must be a positive int, got {chunk_size!r}")
    query = _as_matrix("query", query)
    query_labels = _as_labels("query_labels", query_labels, query.shape[0], "query")
    self_gallery = gallery is None
    if self_gallery:
        if gallery_labels is not None:
            raise ValueError("retrieval_metrics(gallery_labels=) given without gallery=")
        gallery, gallery_labels = query, query_labels
    else:
        gallery = _as_matrix("gallery", gallery)
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

    # R per query: same-class gallery items, minus the query itself.
    classes, gallery_codes = np.unique(gallery_labels, return_inverse=True)
    class_sizes = np.bincount(gallery_codes.reshape(-1), minlength=classes.size)
    position = np.searchsorted(classes, query_labels)
    position = np.minimum(position, classes.size - 1)
    known = classes[position] == query_labels
    relevant = np.where(known, class_sizes[position], 0) - int(self_gallery)
    query_codes = np.where(known, position, -1)
    gallery_codes = gallery_codes.reshape(-1)

    used = np.flatnonzero(relevant > 0)
    names = [f"recall_at_{k}" for k in ks] + ["precision_at_1", "r_precision", "map_at_r"]
    per_query = {name: np.zeros(query.shape[0], dtype=np.float64) for name in names}
    index = _build_index(gallery, metric)
    # Queries in order of R, so each chunk asks for about the k it needs.
    by_relevant = used[np.argsort(relevant[used], kind="stable")]
    start = 0
    while start < by_relevant.size:
        need = max(max(ks), int(relevant[by_relevant[min(start + chunk_size, by_relevant.size) - 1]]))
        rows = max(1, min(chunk_size, max_neighbours_per_chunk // max(need, 1)))
        chunk = np.sort(by_relevant[start:start + rows])
        need = max(max(ks), int(relevant[chunk].max()))
        _, ids = _search_chunk(query, gallery, chunk, need, metric, self_gallery, index)
        hits = (ids >= 0) & (gallery_codes[np.maximum(ids, 0)] == query_codes[chunk][:, None])
        _score(per_query, chunk, hits, relevant[chunk], ks)
        start += rows
    count = used.size
    # Means over per-query values in query order: identical for any chunking.
    result = {name: (float(values[used].mean()) if count else float("nan")) for name, values in per_query.items()}
    result["num_queries"] = int(count)
    result["num_excluded"] = int(query.shape[0] - count)
    return result


def _search_chunk(query, gallery, rows, k, metric, self_gallery, index):
    """The k nearest gallery items of ``query[rows]``, a few extra fetched to see ties at the cut."""
    fetch = min(k + int(self_gallery) + _TIE_MARGIN, gallery.shape[0])
    scores, ids = index.search(query[rows], fetch)
    return _finish(query, gallery, rows, scores, ids, k, metric, rows if self_gallery else None)


def _finish(query, gallery, rows, scores, ids, k, metric, self_ids):
    """Sort by (distance, index), drop self, fix rows whose ties cross the cut."""
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
    # Last finite fetched distance: if it equals the keep-th, unseen gallery
    # items may tie with the kept ones; rank those rows exactly.
    if fetched < gallery.shape[0] and keep > 0:
        valid = fetched - (1 if self_ids is not None else 0)
        boundary = dist[:, keep - 1]
        last = dist[:, valid - 1]
        for r in np.flatnonzero(last <= boundary):
            exact = _distances_to_all(query[rows[r]], gallery, metric)
            if self_ids is not None:
                exact[self_ids[r]] = np.inf
            ranked = np.lexsort((np.arange(gallery.shape[0]), exact))[:fetched]
            ids[r], dist[r] = ranked, exact[ranked]
    ids = np.where(np.isfinite(dist), ids, -1)[:, :k]
    dist = dist[:, :k]
    if ids.shape[1] < k:
        pad = k - ids.shape[1]
        ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
        dist = np.pad(dist, ((0, 0), (0, pad)), constant_values=np.inf)
    return dist, ids


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


# --- result galleries -----------------------------------------------------------------


def _to_pil(image: Any):
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = image.detach().cpu().numpy() if hasattr(image, "detach") else np.asarray(image)
    if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3):
        array = array.transpose(1, 2, 0)  # CHW -> HWC
    if array.dtype.kind == "f":
        low, high = float(array.min()), float(array.max())
        array = (array - low) / (high - low + 1e-12) * 255.0 if (low < 0.0 or high > 1.0) else array * 255.0
        array = array.clip(0, 255).astype(np.uint8)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    return Image.fromarray(array).convert("RGB")


def save_gallery_png(
    path: str | Path,
    query_images: Sequence[Any],
    neighbour_images: Sequence[Sequence[Any]],
    correct: Any,
    *,
    cell: int = 96,
    border: int = 4,
) -> Path:
    """Write a grid: each row a query (grey frame) and its neighbours framed green (right class) or red.

    Images may be PIL images, HWC/CHW uint8 or float arrays, or tensors. The
    file is written to a temporary name and renamed, so a reader never sees a
    half-written PNG.
    """
    from PIL import Image, ImageDraw

    correct = np.asarray(correct, dtype=bool)
    rows = len(query_images)
    if rows == 0:
        raise ValueError("save_gallery_png(query_images=) is empty")
    if len(neighbour_images) != rows or correct.shape[0] != rows:
        raise ValueError(
            f"save_gallery_png: {rows} queries but {len(neighbour_images)} neighbour rows and correct of shape {correct.shape}"
        )
    columns = 1 + max(len(row) for row in neighbour_images)
    gap = border * 2
    canvas = Image.new("RGB", (columns * (cell + gap) + gap, rows * (cell + gap) + gap), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for r in range(rows):
        row_images = [query_images[r], *neighbour_images[r]]
        for c, image in enumerate(row_images):
            x0, y0 = gap + c * (cell + gap), gap + r * (cell + gap)
            colour = (128, 128, 128) if c == 0 else ((0, 170, 0) if correct[r, c - 1] else (210, 0, 0))
            draw.rectangle([x0 - border, y0 - border, x0 + cell + border - 1, y0 + cell + border - 1], fill=colour)
            canvas.paste(_to_pil(image).resize((cell, cell)), (x0, y0))
    buffer = io.BytesIO()
    canvas.save(buffer, format="PNG")
    return atomic_write_bytes(path, buffer.getvalue())

"""The files beside a base index that let it grow and shrink without being rewritten: a delta and the centroids.

1. ``delta-vectors.npy`` (float32 ``(n, d)``) and ``delta-ids.npy`` (int64
   ``(n,)``) hold every vector added since the base index was written;
   ``delta-removed.npy`` (int64) the ids removed from the base since. Each
   update rewrites these (they are small: a fraction of the catalogue), the
   base ``index.faiss`` stays as it is.
2. Loading merges them (:func:`apply_delta`): ``remove_ids`` of the removed
   ids, then ``add_with_ids`` of the added vectors; an IVF index assigns
   them to its lists with the centroids it has.
3. ``centroids.npy`` holds an IVF index's coarse centroids, so an update
   measures drift (:func:`mean_sq_distance`: the new vectors' mean squared
   distance to their nearest centroid) without reading the base index.

Every file is written atomically and described in ``index.json`` (name,
size, SHA-256); a file that does not match is refused when read, as the
base index is.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from pksampler.files import atomic_write_bytes

from pksampler.train.catalogue.parts import writing
from pksampler.train.errors import ConfigError

__all__ = ["CENTROIDS", "DELTA_FILES", "apply_delta", "mean_sq_distance", "read_array", "read_delta", "remove_stale",
           "write_array"]

DELTA_FILES = {"vectors": "delta-vectors.npy", "ids": "delta-ids.npy", "removed": "delta-removed.npy"}
CENTROIDS = "centroids.npy"


def write_array(folder: Path, name: str, array: np.ndarray) -> dict[str, Any]:
    """``folder/name`` written atomically; returns its description for ``index.json``."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    data = buffer.getvalue()
    with writing(folder / name):
        atomic_write_bytes(folder / name, data)
    return {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def read_array(folder: Path, described: Any) -> np.ndarray:
    """The array ``described`` names inside ``folder``, refused in one line when it is not the file described."""
    name = described.get("file") if isinstance(described, dict) else None
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..") or "\\" in name:
        raise ConfigError(f"--index: {folder}/index.json names {name!r} as an index file; it must be a plain file "
                          "name inside the folder; build the index again (--rebuild)")
    path = folder / name
    try:
        data = path.read_bytes() if path.is_file() else None
    except OSError:
        data = None
    if data is None or len(data) != described.get("bytes") or hashlib.sha256(data).hexdigest() != described.get(
            "sha256"):
        raise ConfigError(f"--index: {path} is missing or not the file {folder / 'index.json'} describes (changed, "
                          "damaged or half written); build the index again (--rebuild)")
    return np.load(io.BytesIO(data), allow_pickle=False)


def read_delta(folder: Path, metadata: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(vectors, ids, removed)`` of the index's delta; empty arrays when it has none."""
    delta = metadata.get("delta")
    if not delta:
        dim = int(metadata["dim"])
        return np.zeros((0, dim), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    vectors, ids, removed = (read_array(folder, delta.get(key)) for key in ("vectors", "ids", "removed"))
    if vectors.dtype != np.float32 or vectors.shape != (len(ids), metadata["dim"]) or ids.dtype != np.int64 \
            or removed.dtype != np.int64 or ids.ndim != 1 or removed.ndim != 1:
        raise ConfigError(f"--index: {folder}: the delta files must be float32 (n, {metadata['dim']}) vectors and "
                          "int64 ids of the same n; build the index again (--rebuild)")
    return vectors, ids, removed


def apply_delta(index: faiss.Index, vectors: np.ndarray, ids: np.ndarray, removed: np.ndarray) -> None:
    """Remove ``removed`` from ``index``, then add ``vectors`` under ``ids`` (an IVF index keeps its centroids)."""
    if removed.size:
        index.remove_ids(np.ascontiguousarray(removed, dtype=np.int64))
    if ids.size:
        index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), np.ascontiguousarray(ids, dtype=np.int64))


def mean_sq_distance(centroids: np.ndarray, vectors: np.ndarray) -> float:
    """The mean squared L2 distance of ``vectors`` to their nearest centroid (how well the lists fit them)."""
    if not len(vectors):
        return 0.0
    distances, _ = faiss.knn(np.ascontiguousarray(vectors, dtype=np.float32),
                             np.ascontiguousarray(centroids, dtype=np.float32), 1)
    return float(distances.mean())


def remove_stale(out: Path, metadata: dict[str, Any]) -> None:
    """Base and delta files that ``index.json`` no longer names (it is written: nothing reads them any more)."""
    named = {metadata["index_file"]} | {d["file"] for d in (metadata.get("delta") or {}).values()}
    for path in [*out.glob("delta-*.npy"), *out.glob("index-*.faiss"), out / "index.faiss"]:
        if path.name not in named and path.is_file():
            path.unlink()

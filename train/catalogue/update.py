"""Grow and shrink a catalogue's index in place: add the vectors of new versions, remove the ids they removed.

``train/build_index.py`` calls :func:`grow_index`:

1. An ``--out`` holding the index of an earlier version of the same
   catalogue (same folder, same model, the same history of versions; the
   same kind and nlist when given) is updated; anything else is built
   afresh by :func:`~.index.build_index` (``--rebuild`` forces it; another
   model's index is refused there, in one line).
2. The update reads only the new versions' parts. The vectors added since
   the base file was written and the ids removed from it are written as a
   delta beside it (:mod:`.delta`), under names of this version, and then
   ``index.json``, which switches to them (the commit); the old delta files
   go last. The base file is not rewritten, so an update costs about what
   its new vectors cost, not what the catalogue does.
3. When the delta passes ``compact_fraction`` of the base (10 %), it is
   merged: the base is loaded, the delta applied (``remove_ids``,
   ``add_with_ids``: an IVF index keeps its centroids) and written as a new
   base file.
4. The drift check (IVF kinds): the delta's vectors' mean squared distance
   to their nearest centroid against the indexed sample's at build time.
   Past ``drift_limit`` (1.2 times) the lists no longer fit the catalogue,
   and the update says to retrain the coarse quantizer (``--rebuild``).
   The recall certificate is the base build's; ``--rebuild`` certifies
   afresh.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from pksampler.train.catalogue.delta import (DELTA_FILES, apply_delta, mean_sq_distance, read_array, read_delta,
                                             remove_stale, write_array)
from pksampler.train.catalogue.index import (IndexOptions, build_index, history_digest, load_base, read_metadata,
                                             write_index, write_metadata)
from pksampler.train.catalogue.parts import catalogue_versions, check_parts, iter_parts, read_manifest
from pksampler.train.errors import ConfigError

__all__ = ["grow_index", "update_index"]


def _held(out: Path) -> dict[str, Any] | None:
    try:
        return read_metadata(out)
    except ConfigError:
        return None


def _updatable(held: dict[str, Any], catalogue: Path, manifest: dict[str, Any], options: IndexOptions) -> bool:
    """Whether ``held`` indexes an earlier version of this catalogue, by this model, with the settings asked for."""
    version = held.get("catalogue_version")
    last = catalogue_versions(manifest)[-1].number
    return (held["catalogue"] == str(catalogue.resolve()) and held["model"]["digest"] == manifest["model"]["digest"]
            and isinstance(version, int) and 1 <= version <= last
            and held.get("history_digest") == history_digest(manifest, version)
            and options.kind in ("auto", held["kind"]) and options.nlist in (None, held["nlist"]))


def grow_index(catalogue: str | Path, out: str | Path, *, options: IndexOptions = IndexOptions()) -> dict[str, Any]:
    """Update the index in ``out`` to the catalogue's last version where it can be, else build it afresh."""
    catalogue, out = Path(catalogue), Path(out)
    held = None if options.rebuild else _held(out)
    manifest = read_manifest(catalogue)
    if held is None or not _updatable(held, catalogue, manifest, options):
        return build_index(catalogue, out, options=options)
    return update_index(catalogue, out, manifest, held, options)


def _new_vectors(catalogue: Path, manifest: dict[str, Any], versions: set[int], dim: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The live vectors and ids of ``versions`` (removed ids left out)."""
    check_parts(catalogue, manifest, versions=versions)
    found = [(np.asarray(e, dtype=np.float32), np.asarray(i)) for _, e, i in
             iter_parts(catalogue, manifest, versions=versions)]
    if not found:
        return np.zeros((0, dim), np.float32), np.zeros(0, np.int64)
    return np.concatenate([e for e, _ in found]), np.concatenate([i for _, i in found])


def _drift(out: Path, held: dict[str, Any], vectors: np.ndarray, options: IndexOptions) -> dict[str, Any]:
    """The new vectors' fit to the IVF lists against the indexed ones' (see the module doc, step 4)."""
    base = held.get("drift")
    if not base:
        return {"applies": False, "note": "an exact index has no coarse quantizer: nothing drifts"}
    new = mean_sq_distance(read_array(out, base["centroids"]), vectors)
    ratio = new / max(base["base_mean_sq_distance"], 1e-12) if len(vectors) else 1.0
    return {"applies": True, "vectors": len(vectors), "mean_sq_distance": new,
            "base_mean_sq_distance": base["base_mean_sq_distance"], "ratio": ratio, "limit": options.drift_limit,
            "retrain": ratio > options.drift_limit}


def _write_delta(out: Path, version: int, vectors: np.ndarray, ids: np.ndarray, removed: np.ndarray
                 ) -> dict[str, Any]:
    return {key: write_array(out, f"delta-{version:04d}-{name.split('-', 1)[1]}", array)
            for (key, name), array in zip(DELTA_FILES.items(), (vectors, ids, removed))}


def _compact(out: Path, held: dict[str, Any], version: int, delta: tuple[np.ndarray, np.ndarray, np.ndarray]
             ) -> dict[str, Any]:
    """The base with the delta merged, written as this version's base file; the fields of ``index.json`` it sets."""
    index = load_base(out, held)
    apply_delta(index, *delta)
    name = f"index-{version:04d}.faiss"
    size, digest = write_index(index, out / name)
    return {"index_file": name, "index_bytes": size, "index_sha256": digest, "base_count": int(index.ntotal),
            "delta": None}


def update_index(catalogue: Path, out: Path, manifest: dict[str, Any], held: dict[str, Any],
                 options: IndexOptions) -> dict[str, Any]:
    """Bring ``held`` (the index in ``out``) to the catalogue's last version; see the module doc."""
    started = time.perf_counter()
    versions = catalogue_versions(manifest)
    last, new = versions[-1].number, [v for v in versions if v.number > held["catalogue_version"]]
    if not new:
        return {**held, "history": [*held["history"], {"version": last, "how": "up to date", "seconds": 0.0}]}
    added_vectors, added_ids = _new_vectors(catalogue, manifest, {v.number for v in new}, int(held["dim"]))
    newly_removed = np.unique(np.asarray([i for v in new for i in v.removed], dtype=np.int64))
    old_vectors, old_ids, old_removed = read_delta(out, held)
    keep = ~np.isin(old_ids, newly_removed)
    delta = (np.concatenate([old_vectors[keep], added_vectors]), np.concatenate([old_ids[keep], added_ids]),
             np.union1d(old_removed, np.setdiff1d(newly_removed, old_ids)))
    drift = _drift(out, held, delta[0], options)
    if len(delta[1]) + len(delta[2]) > options.compact_fraction * held["base_count"]:
        fields, how = _compact(out, held, last, delta), "compacted"
    else:
        fields, how = {"delta": _write_delta(out, last, *delta)}, "updated"
    entry = {"version": last, "how": how, "added": len(added_ids), "removed": len(newly_removed),
             "delta_added": len(delta[1]), "delta_removed": len(delta[2]),
             "drift_ratio": drift.get("ratio"), "seconds": round(time.perf_counter() - started, 3)}
    metadata = {**held, **fields, "count": int(manifest["count"]), "catalogue_version": last,
                "history_digest": history_digest(manifest, last), "source": manifest["source"],
                "last_drift": drift, "history": [*held["history"], entry]}
    write_metadata(out, metadata)
    remove_stale(out, metadata)
    return metadata


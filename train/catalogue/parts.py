"""The catalogue's parts on disk: a plan that does not depend on the world size, and the files of each part.

1. The catalogue's ``N`` items (global ids ``0..N-1``, the data source's
   numbering) are cut into parts of ``part_size`` consecutive ids; part
   ``p`` holds ``[p * part_size, min((p + 1) * part_size, N))``.
2. Rank ``r`` of ``W`` embeds the parts ``p = r, r + W, r + 2W, ...`` (as
   the sampler slices one global plan): a part's batches, and so its files,
   are the same at every W. A restarted job, at any W, skips finished parts.
3. Each part is three files, written atomically in this order, so a part
   whose record exists is complete::

       embeddings/part-00003.npy   float32 (n, d): faiss / autofaiss read the folder as it is
       ids/part-00003.npy          int64 (n,): the global id of each row (bad images left out)
       parts/part-00003.json       the record: ids range, counts, bad ids, model digest

4. When every part is done, rank 0 writes ``manifest.json``: the model (its
   digest and preprocessing), the data source, the plan, the counts and
   the bad images' ids.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from pksampler.files import atomic_write_bytes, atomic_write_text

from pksampler.train.errors import ConfigError

__all__ = ["MANIFEST", "PartPlan", "PartVectors", "check_existing_parts", "finished", "iter_parts", "part_name",
           "read_manifest", "read_part", "write_manifest", "write_part"]

MANIFEST = "manifest.json"
PART_FORMAT = "pksampler-catalogue-part"
MANIFEST_FORMAT = "pksampler-catalogue"


def part_name(part: int) -> str:
    return f"part-{part:05d}"


@dataclass(frozen=True)
class PartPlan:
    """``total`` ids cut into parts of ``part_size``; which parts a rank embeds."""

    total: int
    part_size: int

    def __post_init__(self) -> None:
        if isinstance(self.part_size, bool) or not isinstance(self.part_size, int) or self.part_size < 1:
            raise ConfigError(f"--part-size: must be a positive int, got {self.part_size!r}")
        if self.total < 1:
            raise ConfigError("--data: the catalogue holds no images")

    @property
    def num_parts(self) -> int:
        return -(-self.total // self.part_size)

    def bounds(self, part: int) -> tuple[int, int]:
        start = part * self.part_size
        return start, min(start + self.part_size, self.total)

    def parts_of(self, rank: int, world_size: int) -> list[int]:
        return list(range(rank, self.num_parts, world_size))


def _paths(out: Path, part: int) -> tuple[Path, Path, Path]:
    name = part_name(part)
    return out / "embeddings" / f"{name}.npy", out / "ids" / f"{name}.npy", out / "parts" / f"{name}.json"


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def write_part(out: Path, part: int, embeddings: np.ndarray, ids: np.ndarray, record: dict[str, Any]) -> None:
    """The part's arrays, then its record (which marks it finished)."""
    emb_path, ids_path, record_path = _paths(out, part)
    atomic_write_bytes(emb_path, _npy_bytes(np.ascontiguousarray(embeddings, dtype=np.float32)))
    atomic_write_bytes(ids_path, _npy_bytes(np.ascontiguousarray(ids, dtype=np.int64)))
    atomic_write_text(record_path, json.dumps({"format": PART_FORMAT, "part": part, **record}, indent=1))


def read_record(out: Path, part: int) -> dict[str, Any] | None:
    """The part's record, or None when the part is not finished (no record, or an unreadable one)."""
    path = _paths(out, part)[2]
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == PART_FORMAT else None


def read_part(out: Path, part: int, *, mmap: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(embeddings, ids)`` of a finished part (memory-mapped by default: nothing is read until used)."""
    emb_path, ids_path, _ = _paths(out, part)
    mode = "r" if mmap else None
    return np.load(emb_path, mmap_mode=mode, allow_pickle=False), np.load(ids_path, mmap_mode=mode, allow_pickle=False)


def finished(out: Path, plan: PartPlan, part: int, digest: str) -> bool:
    """Whether ``part`` is on disk, complete, for this plan and model (a restart skips it)."""
    record = read_record(out, part)
    if record is None or record.get("model_digest") != digest or record.get("part_size") != plan.part_size \
            or record.get("total") != plan.total:
        return False
    try:
        embeddings, ids = read_part(out, part)
    except (OSError, ValueError):
        return False
    return embeddings.shape[0] == ids.shape[0] == record.get("count")


def check_existing_parts(out: Path, plan: PartPlan, digest: str) -> None:
    """Refuse to mix: records of another model, or of another cut of the catalogue, in ``out``."""
    for path in sorted((out / "parts").glob("part-*.json")):
        record = read_record(out, int(path.stem.split("-")[1])) if path.stem.split("-")[1].isdigit() else None
        if record is None:
            continue
        if record.get("model_digest") != digest:
            raise ConfigError(f"--out: {out} holds parts embedded by another model ({path.name}: digest "
                              f"{str(record.get('model_digest'))[:12]}, this checkpoint's is {digest[:12]}); "
                              "use another --out or delete it")
        if (record.get("total"), record.get("part_size")) != (plan.total, plan.part_size):
            raise ConfigError(f"--part-size/--data: {out} holds parts of {record.get('total')} images in parts of "
                              f"{record.get('part_size')} ({path.name}), this job cuts {plan.total} images into "
                              f"parts of {plan.part_size}; use the same --part-size and --data, or another --out")


def write_manifest(out: Path, manifest: dict[str, Any]) -> Path:
    return atomic_write_text(out / MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "version": 1, **manifest},
                                                        indent=1))


def read_manifest(out: str | Path) -> dict[str, Any]:
    """The manifest of a finished catalogue; a ConfigError naming the folder when there is none."""
    path = Path(out) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{out}: no {MANIFEST}; embed the catalogue first (train/embed_catalogue.py), and let it "
                          "finish: the manifest is written when every part is done") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: cannot be read: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ConfigError(f"{path}: not a pksampler catalogue manifest")
    return manifest


def iter_parts(out: str | Path, manifest: dict[str, Any], *, mmap: bool = True
               ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(part, embeddings, ids)`` for every non-empty part in order, one at a time."""
    for entry in manifest["parts"]:
        if entry["count"]:
            embeddings, ids = read_part(Path(out), entry["part"], mmap=mmap)
            yield entry["part"], embeddings, ids


class PartVectors:
    """Catalogue vectors by global id, read from the memory-mapped parts (the exact re-rank of an IVF-PQ index).

    Part ``id // part_size`` holds an id; its row is found by a binary search
    of the part's ids (ascending; bad images' ids are missing). Only the pages
    of the rows asked for are read.
    """

    def __init__(self, catalogue: str | Path) -> None:
        self.catalogue = Path(catalogue)
        manifest = read_manifest(self.catalogue)
        self.part_size, self.dim = int(manifest["plan"]["part_size"]), int(manifest["dim"])
        self._open: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """``(len(ids), dim)`` float32; rows of ids < 0 (no result) are zeros."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.zeros((ids.size, self.dim), dtype=np.float32)
        valid = ids >= 0
        parts = ids // self.part_size
        for part in np.unique(parts[valid]).tolist():
            if part not in self._open:
                self._open[part] = read_part(self.catalogue, part)
            embeddings, part_ids = self._open[part]
            chosen = valid & (parts == part)
            out[chosen] = embeddings[np.searchsorted(part_ids, ids[chosen])]
        return out

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
       parts/part-00003.json       the record: ids range, counts, bad ids, model digest, the arrays' SHA-256

4. When every part is done, rank 0 writes ``manifest.json``: the model (its
   digest and preprocessing), the data source, the plan, the counts and
   the bad images' ids.
5. Nothing is trusted when read back (:func:`check_parts`): regular files
   only (a FIFO would block the reader for ever), the manifest's shapes
   before any sampling, finite vectors, ids rising strictly inside their
   part's range (the re-rank's binary search and ``id // part_size`` rely
   on it), each of the plan's parts listed once, in order, embedded by the
   manifest's model, its two arrays the bytes its record's SHA-256 names
   (a part swapped, linked or copied from another part or model is refused,
   and a restart embeds it again).
6. A catalogue grows in versions (:mod:`.versions`): version 1's parts lie
   at the top of the folder (as every catalogue before growth), version
   ``v >= 2``'s in ``versions/000v/``, each cut from its own first id
   (new ids come from a counter, never reused). Ids a later version removed
   are masked whenever parts are read (:func:`iter_parts`,
   :class:`PartVectors`).
"""

from __future__ import annotations

import hashlib
import io
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from pksampler.datasets._image import open_regular, read_regular
from pksampler.files import atomic_write_bytes, atomic_write_text

from pksampler.train.errors import ConfigError

__all__ = ["JOB_LOCK", "MANIFEST", "CatalogueVersion", "PartPlan", "PartVectors", "catalogue_versions",
           "check_existing_parts", "check_parts", "file_sha256", "finished", "iter_parts", "make_out_folder",
           "part_name", "read_manifest", "read_part", "removed_ids", "version_folder", "write_manifest", "write_part",
           "writing"]

MANIFEST = "manifest.json"
PART_FORMAT = "pksampler-catalogue-part"
MANIFEST_FORMAT = "pksampler-catalogue"
#: held (``flock``) by the job embedding into a folder, naming its model: a second job is refused while it runs
JOB_LOCK = ".embed.lock"
#: rows checked for finiteness at a time (bounded memory whatever the part size)
_FINITE_BLOCK = 1 << 16


def part_name(part: int) -> str:
    return f"part-{part:05d}"


def version_folder(out: str | Path, version: int) -> Path:
    """Where version ``version``'s parts lie: the catalogue's own folder for version 1, ``versions/000v`` after."""
    return Path(out) if version == 1 else Path(out) / "versions" / f"{version:04d}"


@dataclass(frozen=True)
class PartPlan:
    """``total`` ids from ``first_id`` on, cut into parts of ``part_size``; which parts a rank embeds.

    Position ``j`` of the plan is id ``first_id + j`` and the source's item
    ``members[j]`` (``j`` itself when ``members`` is None: version 1 embeds
    the whole listing, ids are positions in it).
    """

    total: int
    part_size: int
    #: the data source's fingerprint (:func:`~pksampler.train.catalogue.sources.source_fingerprint`)
    source: str = ""
    first_id: int = 0
    members: np.ndarray | None = field(default=None, compare=False, repr=False)

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

    def ids(self, part: int) -> np.ndarray:
        """The ids of ``part``'s rows, in order."""
        start, stop = self.bounds(part)
        return np.arange(self.first_id + start, self.first_id + stop, dtype=np.int64)

    def items(self, part: int) -> np.ndarray:
        """The source's item numbers of ``part``'s rows, in order."""
        start, stop = self.bounds(part)
        return np.arange(start, stop, dtype=np.int64) if self.members is None else self.members[start:stop]


def _paths(out: Path, part: int) -> tuple[Path, Path, Path]:
    name = part_name(part)
    return out / "embeddings" / f"{name}.npy", out / "ids" / f"{name}.npy", out / "parts" / f"{name}.json"


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


@contextmanager
def writing(path: Path, argument: str = "--out") -> Iterator[None]:
    """Turn a failed write of ``path`` (a full disk, a quota, a read-only mount: an OSError that names no file)
    into one ConfigError naming ``argument`` and the file; the atomic writer has removed its temporary file."""
    try:
        yield
    except OSError as error:
        reason = f"[Errno {error.errno}] {error.strerror}" if error.errno else str(error)
        raise ConfigError(f"{argument}: cannot write {path}: {reason}") from None


def write_part(out: Path, part: int, embeddings: np.ndarray, ids: np.ndarray, record: dict[str, Any]) -> None:
    """The part's arrays, then its record (which marks it finished)."""
    emb_path, ids_path, record_path = _paths(out, part)
    digests = {}
    for path, array, dtype in ((emb_path, embeddings, np.float32), (ids_path, ids, np.int64)):
        data = _npy_bytes(np.ascontiguousarray(array, dtype=dtype))
        digests[path.parent.name] = hashlib.sha256(data).hexdigest()
        with writing(path):
            atomic_write_bytes(path, data)
    with writing(record_path):
        atomic_write_text(record_path, json.dumps({"format": PART_FORMAT, "part": part, **record,
                                                   "sha256": digests}, indent=1))


def read_record(out: Path, part: int) -> dict[str, Any] | None:
    """The part's record, or None when the part is not finished (no record, or an unreadable one)."""
    path = _paths(out, part)[2]
    try:
        record = json.loads(read_regular(path).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == PART_FORMAT else None


def read_part(out: Path, part: int, *, mmap: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(embeddings, ids)`` of a finished part (memory-mapped by default: nothing is read until used)."""
    emb_path, ids_path, _ = _paths(out, part)
    for path in (emb_path, ids_path):
        open_regular(path).close()  # a FIFO or a device would block np.load for ever
    mode = "r" if mmap else None
    return np.load(emb_path, mmap_mode=mode, allow_pickle=False), np.load(ids_path, mmap_mode=mode, allow_pickle=False)


def finished(out: Path, plan: PartPlan, part: int, digest: str) -> bool:
    """Whether ``part`` is on disk, complete, for this plan and model (a restart skips it)."""
    record = read_record(out, part)
    if record is None or record.get("model_digest") != digest or record.get("part_size") != plan.part_size \
            or record.get("total") != plan.total or record.get("source_digest") != plan.source \
            or record.get("first_id", 0) != plan.first_id:
        return False
    try:
        embeddings, ids = read_part(out, part)
        same = _changed_array(out, part, record) is None
    except (OSError, ValueError):
        return False
    return same and embeddings.shape[0] == ids.shape[0] == record.get("count")


def file_sha256(path: Path) -> str:
    """SHA-256 of the regular file ``path``, read in 16 MiB blocks (a part or an index may exceed memory)."""
    hasher = hashlib.sha256()
    with open_regular(path) as stream:
        for block in iter(lambda: stream.read(1 << 24), b""):
            hasher.update(block)
    return hasher.hexdigest()


def _changed_array(out: Path, part: int, record: dict[str, Any]) -> Path | None:
    """The first of the part's two arrays whose bytes are not the ones its record's SHA-256 names, else None.

    A part's file swapped for another part's (a link, a copy) or for another
    model's array of the same shape passes every shape, range and finiteness
    check; only the bytes tell. A record without the digests counts as changed.
    """
    digests = record.get("sha256")
    for path in _paths(out, part)[:2]:
        if not isinstance(digests, dict) or digests.get(path.parent.name) != file_sha256(path):
            return path
    return None


def check_existing_parts(out: Path, plan: PartPlan, digest: str) -> None:
    """Refuse to mix: records of another model, of another data source or of another cut of the catalogue, in ``out``."""
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
        if record.get("source_digest") != plan.source:
            raise ConfigError(f"--out/--data: {out} holds parts embedded from another data source ({path.name}: source "
                              f"{str(record.get('source_digest'))[:12]}, this --data lists {plan.source[:12]}: other "
                              "images, paths or labels); use another --out, or delete it to embed afresh")


def make_out_folder(out: str | Path, argument: str = "--out") -> Path:
    """Create the output folder ``out`` up front, or one ConfigError naming ``argument`` (a file in the way, no
    permission) before any work is done."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"{argument}: {str(out)!r} cannot be used as a folder ({error.strerror or error}); "
                          "name a folder, or a path where one can be created") from None
    return out


def write_manifest(out: Path, manifest: dict[str, Any]) -> Path:
    with writing(out / MANIFEST):
        return atomic_write_text(out / MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "version": 1, **manifest},
                                                            indent=1))


def read_manifest(out: str | Path) -> dict[str, Any]:
    """The manifest of a finished catalogue; a ConfigError naming the folder when there is none."""
    path = Path(out) / MANIFEST
    try:
        manifest = json.loads(read_regular(path).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{out}: no {MANIFEST}; embed the catalogue first (train/embed_catalogue.py), and let it "
                          "finish: the manifest is written when every part is done") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: cannot be read: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ConfigError(f"{path}: not a pksampler catalogue manifest")
    _check_manifest(path, manifest)
    return manifest


def _is_count(value: Any, *, positive: bool = False) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= (1 if positive else 0)


def _check_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """The fields the index and the re-rank read, with their types and agreeing counts, or one ConfigError."""
    def bad(field: str, rule: str) -> ConfigError:
        return ConfigError(f"{path}: {field} {rule}; embed the catalogue again (train/embed_catalogue.py)")

    for field in ("dim", "count", "parts", "plan"):
        if field not in manifest:
            raise bad(field, "is missing")
    model = manifest.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("digest"), str):
        raise bad("model", f"must be an object with the model's 'digest', got {model!r}")
    if not _is_count(manifest["dim"], positive=True):
        raise bad("dim", f"must be a positive int, got {manifest['dim']!r}")
    plan = manifest["plan"]
    if not isinstance(plan, dict) or not _is_count(plan.get("part_size"), positive=True):
        raise bad("plan.part_size", f"must be a positive int, got {plan!r}")
    if not _is_count(plan.get("total"), positive=True):
        raise bad("plan.total", f"must be a positive int, got {plan.get('total')!r}")
    parts = manifest["parts"]
    if not isinstance(parts, list):
        raise bad("parts", f"must be a list, got {type(parts).__name__}")
    seen: dict[int, int] = {}
    for number, entry in enumerate(parts):
        if not isinstance(entry, dict) or not _is_count(entry.get("part")) or not _is_count(entry.get("count")):
            raise bad(f"parts[{number}]", f"must hold int 'part' and 'count' >= 0, got {entry!r}")
        if entry["part"] in seen:
            raise bad(f"parts[{number}]", f"repeats part {entry['part']} (parts[{seen[entry['part']]}])")
        if entry["part"] * plan["part_size"] >= plan["total"]:
            raise bad(f"parts[{number}]", f"part {entry['part']} lies past the plan's {plan['total']} ids")
        seen[entry["part"]] = number
    expected = -(-plan["total"] // plan["part_size"])
    wrong = next((n for n, e in enumerate(parts) if e["part"] != n), len(parts) if len(parts) != expected else None)
    if wrong is not None:
        raise bad("parts", f"must list each of the plan's {expected} parts ({plan['total']} ids in parts of "
                           f"{plan['part_size']}) once, in order: part {wrong} is "
                           + ("missing" if wrong < expected else f"past them ({len(parts)} listed)"))
    if "versions" in manifest:
        _check_versions(manifest, bad)
        return
    if not _is_count(manifest["count"]) or manifest["count"] != sum(e["count"] for e in parts):
        raise bad("count", f"{manifest['count']!r} must be the sum of the parts' counts "
                           f"({sum(e['count'] for e in parts)})")


def _check_versions(manifest: dict[str, Any], bad: Any) -> None:
    """A grown catalogue's version list: numbered 1, 2, ... with plans, parts and removed ids of the right types;
    ``count`` (the live vectors) no more than ``embedded`` (every part's count)."""
    versions = manifest["versions"]
    if not isinstance(versions, list) or not versions:
        raise bad("versions", f"must be a non-empty list, got {versions!r}")
    for number, entry in enumerate(versions, start=1):
        if not isinstance(entry, dict) or entry.get("version") != number:
            raise bad(f"versions[{number - 1}]", f"must be an object with 'version' {number}")
        removed = entry.get("removed", [])
        if not isinstance(removed, list) or not all(_is_count(i) for i in removed):
            raise bad(f"versions[{number - 1}].removed", "must be a list of ids")
        if number > 1 and entry.get("plan") is not None:
            plan, parts = entry["plan"], entry.get("parts")
            if not isinstance(plan, dict) or not all(_is_count(plan.get(k), positive=k != "first_id")
                                                     for k in ("part_size", "total", "first_id")):
                raise bad(f"versions[{number - 1}].plan", f"must hold int part_size, total, first_id, got {plan!r}")
            if not isinstance(parts, list) or not all(isinstance(e, dict) and _is_count(e.get("part"))
                                                      and _is_count(e.get("count")) for e in parts):
                raise bad(f"versions[{number - 1}].parts", "must be a list of {'part', 'count'} objects")
    embedded = sum(e["count"] for v in catalogue_versions(manifest) for e in v.parts)
    if manifest.get("embedded") != embedded or not _is_count(manifest["count"]) or manifest["count"] > embedded:
        raise bad("count/embedded", f"{manifest['count']!r}/{manifest.get('embedded')!r} must be the live vectors "
                                    f"and the sum of every version's part counts ({embedded})")


@dataclass(frozen=True)
class CatalogueVersion:
    """One version's parts: where they lie, the ids they cover, and the ids this version removed."""

    number: int
    folder: str
    first_id: int
    total: int
    part_size: int
    parts: tuple[dict[str, Any], ...]
    removed: tuple[int, ...] = ()
    #: the version's item table (names, classes, content fingerprints), None for a catalogue embedded before growth
    items: str | None = None

    def path(self, catalogue: str | Path) -> Path:
        return Path(catalogue) / self.folder

    def range_of(self, part: int) -> tuple[int, int]:
        """The ids ``[low, high)`` that ``part`` of this version may hold."""
        low = self.first_id + part * self.part_size
        return low, min(low + self.part_size, self.first_id + self.total)


def catalogue_versions(manifest: dict[str, Any]) -> list[CatalogueVersion]:
    """Every version of the catalogue, oldest first; a manifest written before growth is one version."""
    plan = manifest["plan"]
    entries = manifest.get("versions") or [{"version": 1}]
    found = [CatalogueVersion(1, ".", 0, plan["total"], plan["part_size"], tuple(manifest["parts"]),
                              tuple(entries[0].get("removed", ())), entries[0].get("items"))]
    for entry in entries[1:]:
        own = entry.get("plan") or {"first_id": 0, "total": 0, "part_size": 1}
        found.append(CatalogueVersion(entry["version"], str(version_folder(".", entry["version"])), own["first_id"],
                                      own["total"], own["part_size"], tuple(entry.get("parts", ())),
                                      tuple(entry.get("removed", ())), entry.get("items")))
    return found


def removed_ids(manifest: dict[str, Any]) -> np.ndarray:
    """Sorted ids that some version removed (items that left the source, or whose image changed)."""
    removed = [np.asarray(v.removed, dtype=np.int64) for v in catalogue_versions(manifest)]
    return np.unique(np.concatenate(removed)) if removed else np.zeros(0, dtype=np.int64)


def _kept(ids: np.ndarray, removed: np.ndarray) -> np.ndarray | None:
    """The rows of ``ids`` not removed, or None when every row stays (no copy needed)."""
    if not removed.size:
        return None
    keep = ~np.isin(np.asarray(ids), removed)
    return None if keep.all() else keep


def _checked_part(out: Path, entry: dict[str, Any], dim: int, *, mmap: bool) -> tuple[np.ndarray, np.ndarray]:
    """A part's arrays, refused in one line when they are not what the manifest says (float32 (count, dim), int64
    (count,))."""
    emb_path, ids_path, _ = _paths(out, entry["part"])
    try:
        embeddings, ids = read_part(out, entry["part"], mmap=mmap)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{out}: part {entry['part']} ({emb_path.name}) cannot be read as .npy arrays ({error}); "
                          "embed the catalogue again") from None
    count = entry["count"]
    if embeddings.dtype != np.float32 or embeddings.ndim != 2 or embeddings.shape != (count, dim):
        raise ConfigError(f"{emb_path}: must be float32 of shape ({count}, {dim}) as {MANIFEST} says, got "
                          f"{embeddings.dtype} {embeddings.shape}; embed the catalogue again")
    if ids.dtype != np.int64 or ids.shape != (count,):
        raise ConfigError(f"{ids_path}: must be int64 of shape ({count},) as {MANIFEST} says, got {ids.dtype} "
                          f"{ids.shape}; embed the catalogue again")
    return embeddings, ids


def _check_values(out: Path, entry: dict[str, Any], version: CatalogueVersion, embeddings: np.ndarray,
                  ids: np.ndarray) -> None:
    """Finite vectors; ids rising strictly inside the part's range ``[first_id + part * part_size, ...)``."""
    emb_path, ids_path, _ = _paths(out, entry["part"])
    for start in range(0, len(embeddings), _FINITE_BLOCK):
        block = np.asarray(embeddings[start:start + _FINITE_BLOCK])
        if not np.isfinite(block).all():
            row = start + int(np.flatnonzero(~np.isfinite(block).all(axis=1))[0])
            raise ConfigError(f"{emb_path}: holds NaN or infinite values (row {row}); embed the catalogue again")
    low, high = version.range_of(entry["part"])
    values = np.asarray(ids)
    wrong = (values < low) | (values >= high)
    wrong[1:] |= values[1:] <= values[:-1]
    if wrong.any():
        row = int(np.flatnonzero(wrong)[0])
        raise ConfigError(f"{ids_path}: ids must rise strictly within [{low}, {high}) (part {entry['part']} in parts "
                          f"of {version.part_size}), got {int(values[row])} at row {row}; embed the catalogue again")


def check_parts(out: str | Path, manifest: dict[str, Any], *, versions: set[int] | None = None) -> None:
    """Every part the manifest lists, checked before anything is built from them (see the module doc, step 5).

    Shapes first, from the ``.npy`` headers alone, so a manifest that claims
    more vectors than its parts hold is refused before any work; then each
    part's record (the manifest's model), values and ids, one part at a time,
    version by version; last, the live rows (removed ids masked) against the
    manifest's ``count``. With ``versions``, only those versions' parts are
    checked (an index update reads no other), and not the count.
    """
    out, digest, dim = Path(out), manifest["model"]["digest"], int(manifest["dim"])
    chosen = [v for v in catalogue_versions(manifest) if versions is None or v.number in versions]
    for version in chosen:
        for entry in (e for e in version.parts if e["count"]):
            _checked_part(version.path(out), entry, dim, mmap=True)  # the headers: nothing of the data is read
    removed, live = removed_ids(manifest), 0
    for version in chosen:
        folder = version.path(out)
        for entry in (e for e in version.parts if e["count"]):
            record_path = _paths(folder, entry["part"])[2]
            record = read_record(folder, entry["part"])
            if record is None:
                raise ConfigError(f"{record_path}: missing or not a part record; embed the catalogue again")
            if record.get("model_digest") != digest:
                raise ConfigError(f"{record_path}: embedded by another model (digest "
                                  f"{str(record.get('model_digest'))[:12]}, the manifest's {digest[:12]}); embed the "
                                  "catalogue again into a folder of its own")
            embeddings, ids = _checked_part(folder, entry, dim, mmap=True)
            _check_values(folder, entry, version, embeddings, ids)
            _check_bytes(folder, entry["part"], record, record_path)
            live += len(ids) - int(np.isin(np.asarray(ids), removed).sum())
    if versions is None and live != manifest["count"]:
        raise ConfigError(f"{out / MANIFEST}: count {manifest['count']} is not the {live} vectors its parts hold "
                          "once removed ids are left out; embed the catalogue again")


def _check_bytes(folder: Path, part: int, record: dict[str, Any], record_path: Path) -> None:
    """Refuse a part whose arrays are not the bytes its record's SHA-256 names (replaced, linked to another part,
    damaged) or whose record names none (an older embed, or edited)."""
    if not isinstance(record.get("sha256"), dict):
        raise ConfigError(f"{record_path}: records no SHA-256 of the part's arrays (written by an older version, "
                          "or edited), so its bytes cannot be checked; embed the catalogue again (train/"
                          "embed_catalogue.py does the parts whose records lack it)")
    changed = _changed_array(folder, part, record)
    if changed is not None:
        raise ConfigError(f"{changed}: its bytes are not the ones {record_path.name} records (SHA-256): "
                          "replaced, linked to another part or damaged since it was embedded; embed the "
                          "source into a new --out (a job stopped before its manifest mends it on restart)")


def iter_parts(out: str | Path, manifest: dict[str, Any], *, mmap: bool = True, versions: set[int] | None = None
               ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(part, embeddings, ids)`` for every non-empty part of every version (or of ``versions``) in order, one at
    a time, each checked against the manifest (dtype, shape, count); rows of removed ids are left out (a copy of
    that part only)."""
    removed = removed_ids(manifest)
    for version in catalogue_versions(manifest):
        if versions is not None and version.number not in versions:
            continue
        for entry in version.parts:
            if entry["count"]:
                embeddings, ids = _checked_part(version.path(out), entry, int(manifest["dim"]), mmap=mmap)
                keep = _kept(ids, removed)
                if keep is None:
                    yield entry["part"], embeddings, ids
                elif keep.any():
                    yield entry["part"], np.asarray(embeddings)[keep], np.asarray(ids)[keep]


class PartVectors:
    """Catalogue vectors by global id, read from the memory-mapped parts (the exact re-rank of an IVF-PQ index).

    The version holding an id is the last whose first id is not above it;
    its part is ``(id - first_id) // part_size``, and the row is found by a
    binary search of the part's ids (ascending; bad images' ids are missing).
    Only the pages of the rows asked for are read.
    """

    def __init__(self, catalogue: str | Path) -> None:
        self.catalogue = Path(catalogue)
        self.manifest = manifest = read_manifest(self.catalogue)
        self.dim = int(manifest["dim"])
        self.versions = [v for v in catalogue_versions(manifest) if v.total]
        self._firsts = np.asarray([v.first_id for v in self.versions], dtype=np.int64)
        self._open: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """``(len(ids), dim)`` float32; rows of ids < 0 (no result) are zeros."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.zeros((ids.size, self.dim), dtype=np.float32)
        valid = ids >= 0
        which = np.maximum(np.searchsorted(self._firsts, ids, side="right") - 1, 0)
        sizes = np.asarray([v.part_size for v in self.versions], dtype=np.int64)
        parts = (ids - self._firsts[which]) // sizes[which]
        for key in sorted(set(zip(which[valid].tolist(), parts[valid].tolist()))):
            if key not in self._open:
                version = self.versions[key[0]]
                self._open[key] = read_part(version.path(self.catalogue), key[1])
            embeddings, part_ids = self._open[key]
            chosen = valid & (which == key[0]) & (parts == key[1])
            out[chosen] = embeddings[np.searchsorted(part_ids, ids[chosen])]
        return out

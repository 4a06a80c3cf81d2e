"""Rank-range checkpoints of a row-sharded table: each rank writes its own rows, a manifest names them all.

A checkpoint ``checkpoints/last.pt`` keeps a shared part's rows beside it,
never inside it, so no rank gathers the whole table to write one::

    checkpoints/last.shared/<part>/step-<N>/rows-<start>-<stop>.pt   one per rank: its RangeCopy's tensors
    checkpoints/last.shared/<part>/step-<N>/manifest.json            rank 0, once every range is on disk

1. :func:`write_ranges` (a collective): each rank writes its range atomically
   (:func:`pksampler.files.atomic_writer`, fsynced), then the ranks exchange
   each file's rows, size and digest (:func:`pksampler.agree.gather_outcomes`:
   a rank that failed to write fails every rank, naming its file), and rank 0
   writes the manifest (the part's total rows, the step, every file) and
   reports that too. The checkpoint holds only the reference it returns.
2. :func:`fill_range` reads, at any world size, only the files that overlap
   the rows a rank owns now, and :func:`load_part` gives a shared part its
   saved state that way (``range_state``'s dense state and ``load_range``:
   the sharded-state protocol, whatever the part); :func:`read_rows` takes any
   rows (a continued run matches classes by name); :func:`whole_copy` the whole
   table, for one process that wants it (an export, a test). A missing file, or one
   whose size, rows or digest differ from the manifest's, is one line naming
   the file (:class:`RangeFileError`).

Each step writes a folder of its own, so the ranges of ``last.pt`` on disk are
never overwritten by a checkpoint still in flight; :func:`drop_older` removes
the older folders once the newer ``last.pt`` is durable.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from pksampler.agree import gather_outcomes
from pksampler.files import atomic_write_text, atomic_writer
from pksampler.train.modeling.head_replicas import RangeCopy

__all__ = ["MANIFEST", "RangeFileError", "drop_older", "fill_range", "load_part", "located", "range_folder",
           "read_manifest", "read_rows", "whole_copy", "write_ranges"]

#: the manifest's name in a step's folder
MANIFEST = "manifest.json"
_FORMAT = 1


class RangeFileError(ValueError):
    """A range file or manifest is missing, unreadable or does not match the manifest (the message names it)."""


def range_folder(checkpoint: Path, part: str, step: int) -> Path:
    """Where ``checkpoint``'s (``last.pt``) ranges of ``part`` at ``step`` lie: ``last.shared/<part>/step-<N>``."""
    return Path(checkpoint).with_suffix(".shared") / part / f"step-{step}"


def _digest(tensors: Sequence[torch.Tensor]) -> int:
    """A 56-bit BLAKE2b of the tensors' bytes (fits the int64 of an agreement row)."""
    hasher = hashlib.blake2b(digest_size=7)
    for tensor in tensors:
        hasher.update(np.ascontiguousarray(tensor.detach().cpu().numpy()).view(np.uint8).reshape(-1).data)
    return int.from_bytes(hasher.digest(), "little")


def _write_own(folder: Path, own: RangeCopy) -> tuple[int, int]:
    """This rank's range as ``rows-<lo>-<hi>.pt`` (atomic, fsynced); its size in bytes and digest."""
    path = folder / f"rows-{own.lo}-{own.hi}.pt"
    with atomic_writer(path) as stream:
        torch.save({"start": own.lo, "stop": own.hi, "tensors": list(own.tensors)}, stream)
    return path.stat().st_size, _digest(own.tensors)


def write_ranges(checkpoint: Path, part: str, own: RangeCopy, *, num_rows: int, step: int,
                 collectives: Any) -> dict[str, Any]:
    """Collective: every rank writes ``own`` (its rows of ``part``), rank 0 the manifest once all are on disk.

    Returns the reference a checkpoint keeps (the manifest's path relative to the checkpoint's folder, the
    rows); a rank's failed write, or rank 0's failed manifest, raises :class:`OSError` on every rank.
    """
    folder = range_folder(checkpoint, part, step)
    error, values = None, [own.lo, own.hi, 0, 0]
    try:
        values[2:] = _write_own(folder, own)
    except (OSError, RuntimeError) as caught:  # torch.save's stream writer reports a full disk as RuntimeError
        error = OSError(f"{folder / f'rows-{own.lo}-{own.hi}.pt'} could not be written: {caught}")
    outcomes = gather_outcomes(collectives, error, values)
    if outcomes.failed:
        raise OSError(outcomes.messages[outcomes.failed[0]])
    if collectives.rank == 0:
        files = [{"name": f"rows-{lo}-{hi}.pt", "start": int(lo), "stop": int(hi), "bytes": int(size),
                  "blake2b": int(digest)} for lo, hi, size, digest in outcomes.values.tolist()]
        try:
            atomic_write_text(folder / MANIFEST, json.dumps({"format": _FORMAT, "part": part, "rows": num_rows,
                                                             "step": step, "files": files}, indent=1))
        except OSError as caught:
            error = OSError(f"{folder / MANIFEST} could not be written: {caught}")
    manifest = gather_outcomes(collectives, error)
    if manifest.failed:
        raise OSError(manifest.messages[manifest.failed[0]])
    return {"manifest": str((folder / MANIFEST).relative_to(Path(checkpoint).parent)), "rows": num_rows}


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest at ``path`` (JSON, plain data): its files checked to tile ``[0, rows)`` in order."""
    path = Path(path)
    try:
        manifest = json.loads(path.read_text())
        files, rows = manifest["files"], int(manifest["rows"])
        starts = [int(entry["start"]) for entry in files] + [rows]
        tiled = starts[0] == 0 and all(int(entry["stop"]) == following for entry, following in zip(files, starts[1:]))
    except FileNotFoundError:
        raise RangeFileError(f"checkpoint rows manifest {path} is missing") from None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
        raise RangeFileError(f"checkpoint rows manifest {path} could not be read: {type(error).__name__}: "
                             f"{error}") from None
    if not tiled:
        raise RangeFileError(f"checkpoint rows manifest {path}: its files do not cover rows 0 to {rows} in order")
    return manifest


def _read_file(folder: Path, entry: dict[str, Any]) -> list[torch.Tensor]:
    """One range file's tensors (mapped, not read whole), checked against its manifest ``entry``."""
    path = folder / entry["name"]
    if not path.is_file():
        raise RangeFileError(f"checkpoint rows file {path} is missing (its manifest lists rows "
                             f"{entry['start']}-{entry['stop']})")
    if path.stat().st_size != entry["bytes"]:
        raise RangeFileError(f"checkpoint rows file {path} holds {path.stat().st_size} bytes, its manifest "
                             f"{entry['bytes']}: the file is damaged or from another checkpoint")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        tensors, rows = list(saved["tensors"]), int(saved["stop"]) - int(saved["start"])
    except Exception as error:  # truncated, not a torch file, refused by weights_only
        raise RangeFileError(f"checkpoint rows file {path} could not be read: {type(error).__name__}: "
                             f"{' '.join(str(error).split())[:200]}") from None
    if rows != entry["stop"] - entry["start"] or any(t.shape[0] != rows for t in tensors) or \
            _digest(tensors) != entry["blake2b"]:
        raise RangeFileError(f"checkpoint rows file {path} does not match its manifest (rows "
                             f"{entry['start']}-{entry['stop']}, digest): the file is damaged or from another "
                             "checkpoint")
    return tensors


def read_rows(manifest_path: Path, ids: np.ndarray) -> list[torch.Tensor]:
    """Rows ``ids`` (global, any order) of each of the table's tensors, reading only the files that hold them."""
    manifest_path = Path(manifest_path)
    manifest, ids = read_manifest(manifest_path), np.asarray(ids, dtype=np.int64)
    taken: list[torch.Tensor] | None = None
    for entry in manifest["files"]:
        inside = np.flatnonzero((ids >= entry["start"]) & (ids < entry["stop"]))
        if not inside.size and taken is not None:
            continue
        tensors = _read_file(manifest_path.parent, entry)
        if taken is None:
            taken = [t.new_zeros((ids.size, *t.shape[1:])) for t in tensors]
        rows = torch.from_numpy(ids[inside] - entry["start"])
        for target, tensor in zip(taken, tensors):
            target[torch.from_numpy(inside)] = tensor[rows]
    return taken if taken is not None else []


def fill_range(manifest_path: Path, lo: int, hi: int, *targets: torch.Tensor) -> None:
    """Rows ``[lo, hi)`` of the table into ``targets`` (one per saved tensor, ``hi − lo`` rows each), from the
    files that overlap them only."""
    manifest_path = Path(manifest_path)
    manifest = read_manifest(manifest_path)
    if int(manifest["rows"]) < hi:
        raise RangeFileError(f"checkpoint rows manifest {manifest_path} holds {manifest['rows']} rows, "
                             f"this run's table {hi} or more")
    for entry in manifest["files"]:
        start, stop = max(lo, entry["start"]), min(hi, entry["stop"])
        if start >= stop:
            continue
        tensors = _read_file(manifest_path.parent, entry)
        if len(tensors) != len(targets):
            raise RangeFileError(f"checkpoint rows file {manifest_path.parent / entry['name']} holds "
                                 f"{len(tensors)} tensors, this part {len(targets)}")
        for target, tensor in zip(targets, tensors):
            target[start - lo:stop - lo] = tensor[start - entry["start"]:stop - entry["start"]].to(target)


def load_part(part: Any, saved: dict[str, Any], lo: int, hi: int, *, key: str) -> None:
    """A shared part's checkpointed state into ``part``: ``saved`` is what a checkpoint keeps of it (its
    ``range_state()`` dense state beside ``ranges``, the manifest made absolute by :func:`located`); the part's
    rows ``[lo, hi)`` (its range in this world) come from the files that overlap them only, through its
    ``load_range(dense, fill)``. ``key`` names the part in the one-line error for a table of another size."""
    ranges = saved["ranges"]
    if int(ranges["rows"]) != part.num_rows:
        raise RangeFileError(f"checkpoint rows manifest {ranges['manifest']}: shared part {key!r} was saved with "
                             f"{ranges['rows']} rows, this run's has {part.num_rows}: they must match")
    dense = {name: value for name, value in saved.items() if name != "ranges"}
    part.load_range(dense, functools.partial(fill_range, ranges["manifest"], lo, hi))


def _same_layout(path: Path, saved: Sequence[torch.Tensor], first: Sequence[torch.Tensor]) -> None:
    """Refuse, in one line naming ``path``, a range file whose tensors differ from the first file's in number,
    dtype or row shape: copied into the first file's tensors they would be cast or broadcast without a word."""
    described = [(str(t.dtype).removeprefix("torch."), tuple(t.shape[1:])) for t in saved]
    expected = [(str(t.dtype).removeprefix("torch."), tuple(t.shape[1:])) for t in first]
    if described != expected:
        raise RangeFileError(f"checkpoint rows file {path} holds tensors of (dtype, row shape) {described}, the "
                             f"first file {expected}: every range file of a table must hold the same")


def whole_copy(manifest_path: Path) -> RangeCopy:
    """The whole table as one :class:`RangeCopy`, every file read once, each tensor in the dtype it was saved in
    (a float64 table stays float64)."""
    manifest_path = Path(manifest_path)
    manifest = read_manifest(manifest_path)
    rows, tensors = int(manifest["rows"]), None
    for entry in manifest["files"]:
        saved = _read_file(manifest_path.parent, entry)
        if tensors is None:
            tensors = tuple(t.new_zeros((rows, *t.shape[1:])) for t in saved)
        _same_layout(manifest_path.parent / entry["name"], saved, tensors)
        for target, tensor in zip(tensors, saved):
            target[entry["start"]:entry["stop"]] = tensor
    if tensors is None:
        raise RangeFileError(f"checkpoint rows manifest {manifest_path} lists no files for its {rows} rows")
    return RangeCopy(0, rows, tensors)


def drop_older(checkpoint: Path, step: int) -> None:
    """Remove ``checkpoint``'s range folders of steps before ``step`` (called once its ``last.pt`` is durable)."""
    shared = Path(checkpoint).with_suffix(".shared")
    for folder in shared.glob("*/step-*") if shared.is_dir() else ():
        number = folder.name.removeprefix("step-")
        if number.isdigit() and int(number) < step:
            shutil.rmtree(folder, ignore_errors=True)


def located(state: Any, checkpoint: Path) -> Any:
    """``state`` (a checkpoint's, or a section of it) with each range reference's manifest made absolute against
    ``checkpoint``'s folder: the one step every reader takes before handing the state on (it may go to other
    ranks, or be read far from the file)."""
    if isinstance(state, dict):
        ranges = state.get("ranges")
        if isinstance(ranges, dict) and isinstance(ranges.get("manifest"), str):
            state = {**state, "ranges": {**ranges, "manifest": str(Path(checkpoint).parent / ranges["manifest"])}}
        return {key: located(value, checkpoint) if key != "ranges" else value for key, value in state.items()}
    return state

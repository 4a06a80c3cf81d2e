"""Pack an image folder or a list file into class-contiguous tar shards with a random-access index.

Usage::

    python -m pksampler.datasets.pack SRC OUT [--root DIR] [--shard-size 512MB] [--workers N]
                                              [--max-side PX] [--max-pixels N]

``SRC`` is a folder (one sub-folder per class, read as :class:`ImageFolderDataset`
reads it) or a file (a list file as :class:`ListFileDataset` reads it; relative
paths resolve under ``--root``, default the list file's folder). ``OUT``
receives ``shard-000000.tar``... in WebDataset's layout (``<key>.<ext>`` +
``<key>.cls``, so ``webdataset``/``wids`` read them), ``index.npy``,
``labels.npy`` and ``manifest.json`` (see :mod:`.sharded`).

Steps:

1. List the source without opening images and order it by class (stable), so
   every class is contiguous; ``stat`` every file for its size.
2. Plan the shards from the file sizes alone (deterministic): classes are
   added whole to the current shard until it would exceed ``--shard-size``;
   a class larger than a shard is split. The plan and its hash are saved in
   ``OUT/.pack/plan.json``.
3. Write each shard (in ``--workers`` processes): read each file, decode it
   fully (corrupt, unreadable and over-``--max-pixels`` images are reported
   on stderr by path and left out), store the bytes as they are (or, with
   ``--max-side``, a resized re-encoding: JPEG quality 90 or PNG), then write
   the tar atomically and a sidecar with its records (``OUT/.pack/``).
4. Concatenate the sidecars into the index, write ``labels.npy`` and finally
   ``manifest.json`` (its presence marks a finished pack), and list the
   left-out files in ``skipped.tsv``.

Resuming: run the same command again. A shard whose tar and sidecar both
exist (and agree on the size and the SHA-256, so a shard damaged in place is
found) is kept; any other is rewritten from scratch,
so a shard interrupted mid-write (only a temporary file exists) is redone.
If the source or options changed, the plan hash differs and the pack stops
with an error instead of mixing two plans. Every file is written atomically
through :mod:`pksampler.files`.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import io
import json
import multiprocessing
import os
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from PIL import Image

from pksampler.files import atomic_write_text, atomic_writer, lock_exclusively, parse_bytes, remove_stale_temporaries

from ._image import IMAGE_EXTENSIONS, MAX_IMAGE_PIXELS, ImageLoadError, load_rgb, read_regular
from .folder import ImageFolderDataset
from .listfile import ListFileDataset
from .sharded import FORMAT_VERSION, INDEX_DTYPE, MANIFEST, shard_digests, shard_name, write_index

__all__ = ["main", "pack", "parse_size", "plan_shards"]

_TAR_BLOCK = 512
_PER_SAMPLE_OVERHEAD = 3 * _TAR_BLOCK  # image header, .cls header, .cls payload block
_WORK = ".pack"


def parse_size(text: str | int) -> int:
    """``--shard-size``: ``"512MB"``, ``"2GiB"``, ``"1000000"`` -> bytes, at least four tar blocks."""
    return parse_bytes(text, name="--shard-size", least=_TAR_BLOCK * 4)


def plan_shards(labels: np.ndarray, sizes: np.ndarray, shard_size: int) -> np.ndarray:
    """Shard boundaries (``starts`` of length shards + 1) over samples ordered by class.

    A class goes whole into the current shard if it fits, else starts a new
    shard; a class larger than ``shard_size`` is cut at the size limit. Sizes
    are tar bytes (payload rounded to 512 plus headers), so the plan depends
    only on the listing, never on what decoding finds.
    """
    cost = (-(-np.asarray(sizes, dtype=np.int64) // _TAR_BLOCK)) * _TAR_BLOCK + _PER_SAMPLE_OVERHEAD
    class_starts = np.flatnonzero(np.r_[True, labels[1:] != labels[:-1]]) if labels.size else np.zeros(0, np.int64)
    class_stops = np.r_[class_starts[1:], labels.size]
    cumulative = np.r_[0, np.cumsum(cost)]
    starts = [0]
    used = 0
    for begin, end in zip(class_starts.tolist(), class_stops.tolist()):
        whole = int(cumulative[end] - cumulative[begin])
        if used and used + whole > shard_size:
            starts.append(begin)
            used = 0
        position = begin
        while used + int(cumulative[end] - cumulative[position]) > shard_size:
            # Only a class larger than a shard gets here, with used == 0: cut it where the shard is full
            # (at least one sample per shard, even one larger than shard_size).
            fits = int(np.searchsorted(cumulative, cumulative[position] + shard_size, side="right")) - 1
            cut = max(fits, position + 1)
            if cut >= end:
                break
            starts.append(cut)
            position = cut
        used += int(cumulative[end] - cumulative[position])
    return np.asarray(starts + [int(labels.size)], dtype=np.int64)


def _list_source(source: Path, root: Path | None) -> tuple[list[str], np.ndarray, list[str]]:
    """Paths, labels and class names of the source, ordered by class (stable)."""
    if source.is_dir():
        if root is not None:
            raise ValueError(f"--root is only for list files; SRC {source} is a folder")
        dataset: ImageFolderDataset | ListFileDataset = ImageFolderDataset(source)
    elif source.is_file():
        dataset = ListFileDataset(source, root=root)
    else:
        raise FileNotFoundError(f"SRC {source} is neither a folder of class folders nor a list file")
    order = np.argsort(dataset.labels, kind="stable")
    return [dataset.paths[i] for i in order.tolist()], dataset.labels[order], list(dataset.classes)


#: tar member extensions by Pillow format, for files whose own extension is not an image extension
_FORMAT_EXTENSIONS = {"JPEG": "jpg", "PNG": "png", "BMP": "bmp", "GIF": "gif", "WEBP": "webp", "TIFF": "tif",
                      "PPM": "ppm"}


def _extension(path: str, source_format: str) -> str:
    """The stored member's extension: the file's own if it is an image extension, else the decoded format's.

    ``x.cls`` would collide with the label member ``<key>.cls`` and a 120-character
    extension would not fit a tar header, so neither is ever used.
    """
    suffix = os.path.splitext(path)[1].lower()
    if suffix in IMAGE_EXTENSIONS:
        return suffix.lstrip(".")
    return _FORMAT_EXTENSIONS.get(source_format, "img")


def _encode(path: str, data: bytes, max_side: int | None, max_pixels: int) -> tuple[bytes, str]:
    """Check that ``data`` decodes; return the bytes to store and their extension."""
    image = load_rgb(data, name=path, max_pixels=max_pixels)
    with Image.open(io.BytesIO(data)) as original:
        source_format = original.format or ""
    extension = _extension(path, source_format)
    if max_side is None or max(image.size) <= max_side:
        return data, extension
    image.thumbnail((max_side, max_side), Image.LANCZOS)
    stream = io.BytesIO()
    if source_format == "JPEG":
        image.save(stream, format="JPEG", quality=90)
        return stream.getvalue(), "jpg"
    image.save(stream, format="PNG")
    return stream.getvalue(), "png"


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    return info


def _write_shard(task: tuple[Path, int, int, list[str], list[int], int | None, int]) -> tuple[int, int, list]:
    """Write one shard and its sidecar; returns (shard id, images stored, [(path, reason)] left out)."""
    out, shard, first, paths, labels, max_side, max_pixels = task
    records: list[list[int]] = []
    bad: list[list[str]] = []
    with atomic_writer(out / shard_name(shard)) as stream:
        with tarfile.open(fileobj=stream, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for position, (path, label) in enumerate(zip(paths, labels), start=first):
                try:
                    data = read_regular(path)  # a FIFO or a device is refused, never read
                    payload, extension = _encode(path, data, max_side, max_pixels)
                except (OSError, ImageLoadError) as error:
                    reason = str(error) if isinstance(error, ImageLoadError) else f"cannot read {path}: {error}"
                    bad.append([path, reason])
                    print(f"pack: left out {path}: {reason}", file=sys.stderr, flush=True)
                    continue
                key = f"{position:010d}"
                info = _member(f"{key}.{extension}", len(payload))
                offset = tar.offset + len(info.tobuf(tar.format, tar.encoding, tar.errors))
                tar.addfile(info, io.BytesIO(payload))
                cls = str(label).encode()
                tar.addfile(_member(f"{key}.cls", len(cls)), io.BytesIO(cls))
                records.append([position, offset, len(payload)])
        stream.flush()
        tar_bytes = stream.tell()
    sidecar = {"shard": shard, "tar_bytes": tar_bytes, "records": records, "bad": bad,
               **shard_digests(out / shard_name(shard))}
    atomic_write_text(out / _WORK / f"{shard_name(shard)}.json", json.dumps(sidecar))
    return shard, len(records), bad


def _shard_done(out: Path, shard: int) -> bool:
    sidecar, tar = out / _WORK / f"{shard_name(shard)}.json", out / shard_name(shard)
    if not (sidecar.is_file() and tar.is_file()):
        return False
    try:
        recorded = json.loads(sidecar.read_text())
        # Same size is not enough: a shard damaged in place is found by its full digest and rewritten.
        return recorded["tar_bytes"] == tar.stat().st_size and recorded["sha256"] == shard_digests(tar)["sha256"]
    except (ValueError, KeyError, OSError):
        return False


def _plan_digest(paths: Sequence[str], labels: np.ndarray, sizes: np.ndarray, starts: np.ndarray,
                 options: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps({"version": FORMAT_VERSION, **options}, sort_keys=True).encode())
    for array in (labels.astype(np.int64), sizes.astype(np.int64), starts.astype(np.int64)):
        digest.update(array.tobytes())
    for path in paths:
        digest.update(path.encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


class _PackLock:
    """An exclusive ``flock`` on ``OUT/.pack/lock`` for one pack at a time (released by the kernel on death)."""

    def __init__(self, path: Path) -> None:
        self.path, self.handle = path, None

    def __enter__(self) -> "_PackLock":
        handle, holder = lock_exclusively(self.path, f"pid {os.getpid()}")
        if handle is None:
            raise ValueError(f"pack: {self.path.parent.parent} is being written by another pack ({holder}); "
                             "wait for it to finish or choose another OUT folder")
        self.handle = handle
        return self

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self.handle.fileno(), fcntl.LOCK_UN)
        self.handle.close()


class _Progress:
    """tqdm on a terminal, otherwise a plain line every ``interval`` seconds."""

    def __init__(self, total: int, done: int, interval: float = 10.0) -> None:
        self.total, self.done, self.interval = total, done, interval
        self.started = self.last = time.monotonic()
        self.new = 0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="img", desc="packing", smoothing=0.1)

    def update(self, images: int) -> None:
        self.done += images
        self.new += images
        if self.bar is not None:
            self.bar.update(images)
            return
        now = time.monotonic()
        if now - self.last >= self.interval or self.done >= self.total:
            rate = self.new / max(now - self.started, 1e-9)
            print(f"pack: {self.done}/{self.total} images, {rate:.0f} images/s", file=sys.stderr, flush=True)
            self.last = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_tasks(tasks: list, workers: int, progress: _Progress) -> None:
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            _write_shard(task)
            progress.update(len(task[3]))
        return
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    sizes = {task[1]: len(task[3]) for task in tasks}
    with context.Pool(min(workers, len(tasks))) as pool:
        for shard, _, _ in pool.imap_unordered(_write_shard, tasks):
            progress.update(sizes[shard])


def pack(source: str | os.PathLike, out: str | os.PathLike, *, root: str | os.PathLike | None = None,
         shard_size: int | str = "512MB", workers: int = 1, max_side: int | None = None,
         max_pixels: int = MAX_IMAGE_PIXELS) -> dict[str, Any]:
    """Pack ``source`` into ``out`` (see the module docstring); returns the manifest.

    Re-running on a finished or interrupted ``out`` resumes: finished shards are kept.
    """
    source, out = Path(source), Path(out)
    shard_bytes = parse_size(shard_size)
    for name, value in (("workers", workers), ("max_side", max_side), ("max_pixels", max_pixels)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"pack({name}=) must be a positive int{' or None' if name == 'max_side' else ''}, got {value!r}")
    paths, labels, classes = _list_source(source, Path(root) if root is not None else None)
    sizes = np.fromiter((os.stat(p).st_size for p in paths), dtype=np.int64, count=len(paths))
    starts = plan_shards(labels, sizes, shard_bytes)
    options = {"shard_size": shard_bytes, "max_side": max_side, "max_pixels": max_pixels}
    digest = _plan_digest(paths, labels, sizes, starts, options)
    work = out / _WORK
    work.mkdir(parents=True, exist_ok=True)
    with _PackLock(work / "lock"):
        return _pack_locked(source, out, work, paths, labels, classes, sizes, starts, digest, options, workers)


def _pack_locked(source: Path, out: Path, work: Path, paths: list[str], labels: np.ndarray, classes: list[str],
                 sizes: np.ndarray, starts: np.ndarray, digest: str, options: dict[str, Any],
                 workers: int) -> dict[str, Any]:
    """The part of :func:`pack` that writes, under the folder's lock."""
    max_side, max_pixels = options["max_side"], options["max_pixels"]
    plan_file = work / "plan.json"
    if plan_file.is_file() and json.loads(plan_file.read_text())["plan_sha256"] != digest:
        raise ValueError(f"pack: {out} holds a pack of another source or other options ({plan_file} differs); "
                         f"use an empty OUT folder or delete {out}")
    for folder in (out, work):
        remove_stale_temporaries(folder)
    atomic_write_text(plan_file, json.dumps({"plan_sha256": digest, "shards": len(starts) - 1, **options}))
    num_shards = len(starts) - 1
    todo = [s for s in range(num_shards) if not _shard_done(out, s)]
    kept = sorted(set(range(num_shards)) - set(todo))
    progress = _Progress(len(paths), int(sum(starts[s + 1] - starts[s] for s in kept)))
    tasks = [(out, s, int(starts[s]), paths[starts[s]:starts[s + 1]], labels[starts[s]:starts[s + 1]].tolist(),
              max_side, max_pixels) for s in todo]
    try:
        _run_tasks(tasks, workers, progress)
    finally:
        progress.close()
    return _assemble(out, num_shards, labels, classes, source, options)


def _tsv(text: str) -> str:
    """One TSV field: backslash, tab, newline and carriage return escaped as \\\\, \\t, \\n, \\r."""
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _assemble(out: Path, num_shards: int, labels: np.ndarray, classes: list[str], source: Path,
              options: dict[str, Any]) -> dict[str, Any]:
    """Sidecars -> index.npy, labels.npy, skipped.tsv, manifest.json."""
    parts, shards, bad = [], [], []
    for shard in range(num_shards):
        sidecar = json.loads((out / _WORK / f"{shard_name(shard)}.json").read_text())
        records = np.asarray(sidecar["records"], dtype=np.int64).reshape(-1, 3)
        part = np.empty(len(records), dtype=INDEX_DTYPE)
        part["shard"], part["offset"], part["size"] = shard, records[:, 1], records[:, 2]
        parts.append((part, labels[records[:, 0]]))
        shards.append({"name": shard_name(shard), "bytes": sidecar["tar_bytes"], "samples": len(records),
                       "fingerprint": sidecar["fingerprint"], "sha256": sidecar["sha256"]})
        bad.extend(sidecar["bad"])
    index = np.concatenate([p for p, _ in parts]) if parts else np.empty(0, INDEX_DTYPE)
    packed_labels = np.concatenate([lab for _, lab in parts]) if parts else np.empty(0, np.int64)
    atomic_write_text(out / "skipped.tsv", "".join(f"{_tsv(p)}\t{_tsv(r)}\n" for p, r in bad))
    if bad:
        print(f"pack: left out {len(bad)} unreadable image(s); paths and reasons in {out / 'skipped.tsv'}",
              file=sys.stderr)
    extra = {"class_contiguous": True, "source": str(source), "skipped": len(bad), **options}
    return write_index(out, index, packed_labels, classes=classes, shards=shards, extra=extra)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pksampler.datasets.pack",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("source", metavar="SRC", help="image folder (one sub-folder per class) or list file")
    parser.add_argument("out", metavar="OUT", help="output folder for shards, index and manifest")
    parser.add_argument("--root", default=None, help="folder that a list file's relative paths resolve under")
    parser.add_argument("--shard-size", default="512MB", help="target bytes per shard (default 512MB)")
    parser.add_argument("--workers", type=int, default=1, help="processes writing shards (default 1)")
    parser.add_argument("--max-side", type=int, default=None, help="resize images whose longer side exceeds PX")
    parser.add_argument("--max-pixels", type=int, default=MAX_IMAGE_PIXELS,
                        help=f"images with more pixels are left out as bombs (default {MAX_IMAGE_PIXELS})")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        manifest = pack(args.source, args.out, root=args.root, shard_size=args.shard_size, workers=args.workers,
                        max_side=args.max_side, max_pixels=args.max_pixels)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"pack: error: {error}\n")
    print(f"packed {manifest['num_samples']} images of {manifest['num_classes']} classes into "
          f"{len(manifest['shards'])} shard(s) in {args.out} ({manifest['skipped']} left out); "
          f"see {Path(args.out) / MANIFEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

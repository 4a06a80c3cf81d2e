"""ShardedDataset: random access by sample index into class-contiguous tar shards (WebDataset layout).

The folder written by ``python -m pksampler.datasets.pack`` holds::

    shard-000000.tar ...   tar files of ``<key>.<ext>`` (image bytes as stored) + ``<key>.cls``
    index.npy              per sample: shard id (u4), byte offset of the image payload (u8), size (u4)
    labels.npy             per sample: int64 class code (the samplers read only this)
    manifest.json          format and version, shard names, sizes and digests, class names and
                           counts, a fingerprint and a SHA-256 of index.npy + labels.npy

Samples are numbered in shard order and shards are written class by class,
so sample indices, labels and bytes on disk run in the same order: a chunk of
K samples of one class is K small positioned reads in one shard.

The index and labels are memory-mapped (``np.load(mmap_mode="r",
allow_pickle=False)``): opening a 10^8-sample set reads the manifest, two
array headers, the labels and the index once (vectorised passes check the
labels' range, class order and per-class counts, and that every shard id
names a listed shard and every payload lies inside it).

Integrity, from cheap to complete:

1. at open: the fingerprint of the index and labels (sizes, first and last
   MiB) and the labels pass above;
2. at the first open of each shard in a process: the shard's fingerprint
   (size, first and last MiB: its first tar header names its first sample,
   so two swapped shards of equal size differ);
3. ``verify_index=True`` (or :meth:`ShardedDataset.verify`): the full SHA-256
   of the index, the labels and every shard. The trainer runs the index part
   once per host in the background.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from PIL import Image

from pksampler.files import atomic_write_bytes, atomic_write_text, atomic_writer, parse_bytes
from pksampler.locations import is_remote

from ._image import MAX_IMAGE_PIXELS, ImageLoadError, NotRegularFileError, load_rgb, open_regular
from .base import LabelledDataset, check_decoding
from .blockcache import BlockCache
from .objectstore import DEFAULT_OUTAGE_SECONDS, ObjectStore

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_DTYPE",
    "ShardDamagedError",
    "ShardedDataset",
    "index_fingerprint",
    "shard_digests",
    "write_index",
]

FORMAT_NAME = "pksampler-shards"
FORMAT_VERSION = 1
INDEX_DTYPE = np.dtype([("shard", "<u4"), ("offset", "<u8"), ("size", "<u4")])
MANIFEST = "manifest.json"
INDEX_FILE = "index.npy"
LABELS_FILE = "labels.npy"
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.tar$")
_FINGERPRINT_SPAN = 1 << 20  # bytes hashed at each end of each array file
_LABEL_BLOCK = 1 << 22  # labels checked per block at open (32 MiB of int64)


class ShardDamagedError(ValueError):
    """A shard, the index or the labels do not match the manifest: damaged on disk, swapped or from another pack."""


def shard_name(shard: int) -> str:
    """The file name of shard ``shard``: ``shard-000000.tar``."""
    return f"shard-{shard:06d}.tar"


def _hash_descriptor(digest: Any, descriptor: int, name: str, *, full: bool) -> None:
    """Feed ``digest`` the file's name and size and either all its bytes or its first and last MiB."""
    size = os.fstat(descriptor).st_size
    digest.update(f"{name}:{size};".encode())
    if full:
        position = 0
        while block := os.pread(descriptor, 1 << 24, position):
            digest.update(block)
            position += len(block)
    else:
        digest.update(os.pread(descriptor, _FINGERPRINT_SPAN, 0))
        digest.update(os.pread(descriptor, _FINGERPRINT_SPAN, max(size - _FINGERPRINT_SPAN, 0)))


def _hash_files(paths: Sequence[Path], *, full: bool) -> str:
    """SHA-256 over the files' sizes and either all their bytes or the first and last MiB of each."""
    digest = hashlib.sha256()
    for path in paths:
        with open_regular(path) as handle:
            _hash_descriptor(digest, handle.fileno(), path.name, full=full)
    return digest.hexdigest()


def shard_digests(path: str | os.PathLike) -> dict[str, str]:
    """``{"fingerprint", "sha256"}`` of one shard file: checked at its first open, and by a full verification."""
    path = Path(path)
    return {"fingerprint": _hash_files([path], full=False), "sha256": _hash_files([path], full=True)}


def index_fingerprint(root: str | os.PathLike) -> str:
    """A cheap hash of ``index.npy`` and ``labels.npy`` (sizes, first and last MiB): checked at every open."""
    root = Path(root)
    return _hash_files([root / INDEX_FILE, root / LABELS_FILE], full=False)


def write_index(root: str | os.PathLike, index: np.ndarray, labels: np.ndarray, *, classes: Sequence[str],
                shards: Sequence[dict[str, Any]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``index.npy``, ``labels.npy`` and then ``manifest.json`` (each atomically); returns the manifest.

    The manifest is written last, so its presence means the set is complete.
    ``shards`` holds one ``{"name", "bytes", "samples"}`` per shard; ``extra``
    adds informational keys (source, options, skipped count).
    """
    root = Path(root)
    index = np.asarray(index, dtype=INDEX_DTYPE)
    raw = np.asarray(labels)
    if raw.dtype.kind not in "iu" or (raw.size and (raw.min() < 0 or raw.max() >= len(classes))):
        low, high = (raw.min(), raw.max()) if raw.size and raw.dtype.kind in "iuf" else (None, None)
        raise ValueError(f"write_index(labels=) must be integer class codes in [0, {len(classes)}) (one per class "
                         f"name), got dtype {raw.dtype} with range [{low}, {high}]")
    labels = raw.astype(np.int64)
    if index.shape != labels.shape or index.ndim != 1:
        raise ValueError(f"write_index: index shape {index.shape} and labels shape {labels.shape} must be equal and 1-D")
    for name, array in ((INDEX_FILE, index), (LABELS_FILE, labels)):
        with atomic_writer(root / name) as stream:
            np.save(stream, array, allow_pickle=False)
    counts = np.bincount(labels, minlength=len(classes)) if labels.size else np.zeros(len(classes), np.int64)
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "num_samples": int(labels.size),
        "num_classes": len(classes),
        "classes": [str(c) for c in classes],
        "class_counts": counts.astype(int).tolist(),
        "shards": [{"name": s["name"], "bytes": int(s["bytes"]), "samples": int(s["samples"]),
                    **{k: str(s[k]) for k in ("fingerprint", "sha256") if k in s}} for s in shards],
        "index_dtype": [[name, INDEX_DTYPE[name].str] for name in INDEX_DTYPE.names],
        "index_fingerprint": index_fingerprint(root),
        "index_sha256": _hash_files([root / INDEX_FILE, root / LABELS_FILE], full=True),
        **(extra or {}),
    }
    atomic_write_text(root / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


class ShardedDataset(LabelledDataset):
    """Images packed into tar shards by :mod:`pksampler.datasets.pack`, read by sample index.

    Each ``load(i)`` is one ``os.pread`` of the image payload (offset and size
    from the memory-mapped index) followed by a decode: no whole-shard read,
    no tar parsing. Shard file handles are cached per process (keyed by pid,
    so DataLoader workers reopen after fork), at most ``max_open_shards`` at a
    time.

    Args:
        root: the folder holding ``manifest.json``, ``index.npy``, ``labels.npy`` and the shards.
        transform: applied to the decoded RGB PIL image (see :mod:`.transforms`).
        seed: augmentation seed (per-sample generators keyed by seed, epoch, index).
        on_bad: ``"replace"`` (default) or ``"raise"``, as for the other datasets.
        decode_size: decode JPEGs in Pillow's draft mode at no less than this side.
        max_pixels: images declaring more pixels are bad images (decompression bombs).
        verify_index: also check the full SHA-256 of the index, the labels and every shard
            (reads everything once); by default only the fingerprints are checked
            (sizes, first and last MiB; each shard's at its first open).
        max_open_shards: bound on cached open shard files per process.
        block_cache: object stores only: keep shards' bytes in a node-local cache of this many bytes (an int or
            a size such as ``"64GB"``), read in blocks of ``block_size`` (:mod:`.blockcache`), shared by the
            host's ranks and workers. Pair it with the shard-local plan (``locality="shard"``), whose lanes read
            a shard in long visits: GETs fall from one per K-chunk to one per block. ``None`` (default): one
            ranged GET per run of nearby samples of each batch, nothing kept.
        block_size: the cache's block (and GET) size, default ``"16MiB"``.
        cache_dir: the cache's folder (default ``$PKSAMPLER_CACHE/objectstore/<store>/blocks``); ``/dev/shm/...``
            keeps it in RAM. The blocks go to a folder of their own inside it (``pksampler-blocks-v1/``).
        outage_seconds: object stores only: how long a store that stops answering is retried before a read
            fails (default 300).

    Path rules: shard names in the manifest must be plain file names
    (``[A-Za-z0-9_.-]``, ending ``.tar``: no ``/``, no ``..``, not absolute), and a
    shard that is a symlink must resolve inside ``root``; the index and labels
    files have fixed names. A missing file or an index that does not match
    the manifest is an error naming the path.

    Example::

        dataset = ShardedDataset("/data/products-shards", transform=train_preset(224), decode_size=224)
        sampler = DistributedBalancedBatchSampler(dataset.labels, 32, 4, num_replicas=16, rank=r)
    """

    verifiable = True  # the manifest holds the SHA-256 of the index and labels (and of each shard)

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None, *, seed: int = 0,
                 on_bad: str = "replace", decode_size: int | None = None, max_pixels: int = MAX_IMAGE_PIXELS,
                 verify_index: bool = False, max_open_shards: int = 64, block_cache: int | str | None = None,
                 block_size: int | str = "16MiB", cache_dir: str | os.PathLike | None = None,
                 outage_seconds: float | None = None) -> None:
        super().__init__(transform, seed=seed, on_bad=on_bad)
        self.decode_size, self.max_pixels = check_decoding("ShardedDataset", decode_size, max_pixels)
        if isinstance(max_open_shards, bool) or not isinstance(max_open_shards, int) or max_open_shards < 1:
            raise ValueError(f"ShardedDataset(max_open_shards=) must be a positive int, got {max_open_shards!r}")
        self.max_open_shards = max_open_shards
        self.store: ObjectStore | None = None
        self._prefetched: dict[int, bytes] = {}
        self._etags: dict[int, str | None] = {}  # remote shards' ETags seen in this process (packs without them)
        fresh = True
        if is_remote(root):  # s3://bucket/prefix: the small files in a node-local cache, shards read by ranged GETs
            self.store = ObjectStore(str(root), outage_seconds=DEFAULT_OUTAGE_SECONDS if outage_seconds is None
                                     else outage_seconds)
            root, fresh = _cache_pack_files(self.store)
            if verify_index:
                raise ValueError("ShardedDataset(verify_index=True) reads every shard; on an object store, check the "
                                 "shards' SHA-256 where they were packed (python -m pksampler.datasets.pack keeps them)")
        elif outage_seconds is not None:
            raise ValueError(f"ShardedDataset(outage_seconds={outage_seconds!r}) is an object store's outage budget; "
                             f"{root} is a local folder")
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"ShardedDataset(root=) is not a directory: {self.root}")
        self.manifest = _read_manifest(self.root)
        self.shard_names = [s["name"] for s in self.manifest["shards"]]
        self.shard_bytes = np.asarray([s["bytes"] for s in self.manifest["shards"]], dtype=np.int64)
        self.classes = list(self.manifest["classes"])
        self.index, self.labels = self._open_index(verify_index, fresh)
        self._checked: set[int] = set()  # shards whose fingerprint matched in this process
        # The packer writes class by class: same-class lookups are a binary search, no scan of 10^8 labels.
        self._labels_sorted = True if self.manifest.get("class_contiguous") else None
        self._handles: OrderedDict[int, int] = OrderedDict()
        self._pid = os.getpid()
        self.blocks = self._block_cache(block_cache, block_size, cache_dir)
        if verify_index:
            self.verify(index=False)

    def _open_index(self, verify: bool, fresh: bool) -> tuple[np.ndarray, np.ndarray]:
        """The index and labels, checked against the manifest. A remote pack's cached copies that fail the check
        (damaged on the node's disk) are fetched once more, with a warning; a fresh copy that fails names the
        ``s3://`` objects."""
        try:
            return _open_index(self.root, self.manifest, verify=verify)
        except (ShardDamagedError, ValueError) as error:
            if self.store is None:
                raise
            if fresh:
                raise ShardDamagedError(f"ShardedDataset: {self.store.url}/{INDEX_FILE} and {LABELS_FILE}, as fetched "
                                        f"from the store, do not match {self.store.url}/{MANIFEST}: {error}") from None
            warnings.warn(f"ShardedDataset: the node's cached copies of {self.store.url}/{INDEX_FILE} and "
                          f"{LABELS_FILE} in {self.root} failed their check ({error}); fetched them again",
                          RuntimeWarning, stacklevel=3)
            _fetch_index_files(self.store, self.root)
            return self._open_index(verify, fresh=True)

    def _block_cache(self, limit: int | str | None, block_size: int | str,
                     cache_dir: str | os.PathLike | None) -> BlockCache | None:
        """The node-local block cache ``block_cache=`` asks for (object stores only)."""
        if limit is None:
            if cache_dir is not None:
                raise ValueError("ShardedDataset(cache_dir=) is the block cache's folder: give block_cache= a size too")
            return None
        if self.store is None:
            raise ValueError(f"ShardedDataset(block_cache={limit!r}) caches an object store's shards; {self.root} is "
                             "a local folder, read directly")
        block_bytes = parse_bytes(block_size, name="ShardedDataset(block_size=)", least=64 << 10)
        limit_bytes = parse_bytes(limit, name="ShardedDataset(block_cache=)", least=2 * block_bytes)
        folder = Path(cache_dir) if cache_dir is not None else self.store.cache_folder() / "blocks"
        return BlockCache(folder, limit_bytes=limit_bytes, block_bytes=block_bytes)

    def _shard_etag(self, shard: int) -> str | None:
        """The ETag every GET of remote shard ``shard`` must match (``If-Match``).

        Recorded in the manifest by the upload; for a pack uploaded without them, the ETag seen by one HEAD at the
        shard's first use in this process (the size checked against the manifest), so a shard replaced while the
        job runs is refused, never read.
        """
        entry = self.manifest["shards"][shard]
        if entry.get("etag"):
            return str(entry["etag"])
        if shard not in self._etags:
            name = self.shard_names[shard]
            size, etag = self.store.head(name)
            if size != int(self.shard_bytes[shard]):
                raise self.store.changed(name, f"it has {size} bytes, the manifest says {int(self.shard_bytes[shard])}")
            self._etags[shard] = etag
        return self._etags[shard]

    def _shard_version(self, shard: int, etag: str | None) -> str:
        """A block cache key of remote shard ``shard``: the store (endpoint, bucket, prefix), the shard's manifest
        entry and its ETag, so two packs in one cache_dir, a shard packed again under its old name or one replaced
        on the store never share a block."""
        entry = json.dumps(self.manifest["shards"][shard], sort_keys=True)
        return hashlib.sha256(f"{self.store.identity()}|{entry}|{etag}".encode()).hexdigest()[:12]

    def _remote_ranges(self, shard: int, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Bytes of ``ranges`` of remote shard ``shard``: through the block cache, or one GET per nearby run."""
        name, etag = self.shard_names[shard], self._shard_etag(shard)
        if self.blocks is None:
            return self.store.get_ranges(name, ranges, etag=etag)
        return self.blocks.read(self.store, name, self._shard_version(shard, etag), int(self.shard_bytes[shard]),
                                ranges, etag=etag)

    def verify(self, *, index: bool = True, shards: bool = True) -> None:
        """Check the full SHA-256 of the index and labels and of every shard against the manifest (reads all).

        Raises:
            ValueError: naming the first file whose content does not match.
        """
        if index and _hash_files([self.root / INDEX_FILE, self.root / LABELS_FILE], full=True) != \
                self.manifest.get("index_sha256"):
            raise ShardDamagedError(f"ShardedDataset: {self.root / INDEX_FILE} and {self.root / LABELS_FILE} do not match "
                             f"the SHA-256 in {self.root / MANIFEST} (damaged on disk? re-run pack)")
        for shard, entry in enumerate(self.manifest["shards"] if shards else ()):
            if "sha256" not in entry:
                continue  # packed before shards carried digests
            path = _inside(self.root, entry["name"])
            if _hash_files([path], full=True) != entry["sha256"]:
                raise ShardDamagedError(f"ShardedDataset: shard {path} does not match the SHA-256 in {self.root / MANIFEST}: "
                                 "its content is damaged or it was swapped with another; re-run pack")

    @property
    def shard_ids(self) -> np.ndarray:
        """The shard of every sample (uint32), read from index.npy alone: what ``locality="shard"`` samplers need."""
        return np.ascontiguousarray(self.index["shard"])

    def describe(self, index: int) -> str:
        record = self.index[index]
        where = f"{self.store.url}/" if self.store is not None else f"{self.root}{os.sep}"
        return (f"{where}{self.shard_names[int(record['shard'])]}@{int(record['offset'])}"
                f"+{int(record['size'])} (sample {index})")

    def prefetch(self, indices: Sequence[int]) -> None:
        """Read the bytes of ``indices`` ahead, one GET per run of nearby samples of a shard (object stores only).

        Called with a batch's indices (by :meth:`__getitems__`, or the trainer's
        loader): a K-chunk of adjacent samples costs one request. The previous
        batch's bytes are dropped, so memory stays at one batch per process.
        """
        if self.store is None:
            return
        records = self.index[np.asarray(indices, dtype=np.int64)]
        self._prefetched = {}
        for shard in np.unique(records["shard"]):
            mine = np.flatnonzero(records["shard"] == shard)
            ranges = [(int(records["offset"][i]), int(records["offset"][i]) + int(records["size"][i])) for i in mine]
            for i, data in zip(mine, self._remote_ranges(int(shard), ranges)):
                self._prefetched[int(indices[i])] = data

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, int]]:
        """A batch: its bytes prefetched together (object stores), then each sample as ``self[i]``."""
        self.prefetch(indices)
        return [self[i] for i in indices]

    def read_bytes(self, index: int) -> bytes:
        """The stored (encoded) image bytes of sample ``index``: one positioned read (or ranged GET)."""
        record = self.index[index]
        shard, offset, size = int(record["shard"]), int(record["offset"]), int(record["size"])
        if self.store is not None:
            data = self._prefetched.pop(int(index), None)
            if data is None:
                data = self._remote_ranges(shard, [(offset, offset + size)])[0]
        else:
            data = os.pread(self._handle(shard), size, offset)
        if len(data) != size:
            raise ImageLoadError(f"{self.describe(index)}: shard ends after {len(data)} of {size} bytes (truncated shard?)")
        return data

    def load(self, index: int) -> Image.Image:
        return load_rgb(self.read_bytes(index), name=self.describe(index), draft_size=self.decode_size,
                        max_pixels=self.max_pixels)

    def _handle(self, shard: int) -> int:
        """A read-only descriptor of shard ``shard``, cached per process (LRU)."""
        if self._pid != os.getpid():  # a forked worker: the parent's descriptors are not ours to share
            self._handles = OrderedDict()
            self._pid = os.getpid()
        handle = self._handles.get(shard)
        if handle is not None:
            self._handles.move_to_end(shard)
            return handle
        if not 0 <= shard < len(self.shard_names):
            raise ValueError(f"{self.root / INDEX_FILE}: shard id {shard} out of range for {len(self.shard_names)} shards")
        path = _inside(self.root, self.shard_names[shard])
        try:
            handle = _regular_descriptor(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"ShardedDataset: shard listed in {self.root / MANIFEST} is missing: {path}") from None
        except NotRegularFileError as error:
            raise ValueError(f"ShardedDataset: shard {error}") from None
        size = os.fstat(handle).st_size
        if size != self.shard_bytes[shard]:
            os.close(handle)
            raise ShardDamagedError(f"ShardedDataset: shard {path} has {size} bytes, the manifest "
                             f"{self.root / MANIFEST} says {int(self.shard_bytes[shard])}: the shard and index do not match")
        expected = self.manifest["shards"][shard].get("fingerprint")
        if shard not in self._checked and expected is not None:
            digest = hashlib.sha256()
            _hash_descriptor(digest, handle, path.name, full=False)
            if digest.hexdigest() != expected:
                os.close(handle)
                raise ShardDamagedError(f"ShardedDataset: shard {path} does not match its fingerprint in "
                                 f"{self.root / MANIFEST}: its content is damaged or it was swapped with another "
                                 "shard of the same size; re-run pack")
            self._checked.add(shard)
        self._handles[shard] = handle
        while len(self._handles) > self.max_open_shards:
            os.close(self._handles.popitem(last=False)[1])
        return handle

    def close(self) -> None:
        """Close this process's cached shard handles."""
        if self._pid == os.getpid():
            for handle in self._handles.values():
                os.close(handle)
        self._handles = OrderedDict()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to do
            pass

    def __getstate__(self) -> dict[str, Any]:
        """Pickle (e.g. for spawned DataLoader workers) without file handles or the arrays' contents.

        A pickled ``np.memmap`` carries its whole data; the receiving process
        maps the files again instead.
        """
        state = dict(self.__dict__)
        state["_handles"] = OrderedDict()
        state["_prefetched"] = {}
        state["index"] = state["labels"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.index, self.labels = _open_index(self.root, self.manifest, verify=False)
        self._pid = os.getpid()


def _cache_pack_files(store: ObjectStore) -> tuple[Path, bool]:
    """The pack's manifest, index and labels in a node-local folder, downloaded when the manifest changed;
    returns the folder and whether the index and labels were downloaded now (else: trusted from the cache, to be
    fetched again if they fail their check).

    Several processes of a host may do this at once: every file is written
    atomically, the manifest last, so a reader sees either the old set or the new.
    """
    folder = store.cache_folder()
    manifest = store.get(MANIFEST)
    cached = folder / MANIFEST
    kept = cached.is_file() and cached.read_bytes() == manifest and (folder / INDEX_FILE).is_file() \
        and (folder / LABELS_FILE).is_file()
    if not kept:
        _fetch_index_files(store, folder)
        atomic_write_bytes(cached, manifest)
    return folder, not kept


def _fetch_index_files(store: ObjectStore, folder: Path) -> None:
    store.fetch(INDEX_FILE, folder)
    store.fetch(LABELS_FILE, folder)


def _regular_descriptor(path: Path) -> int:
    """A descriptor of the regular file ``path`` (a FIFO or device is refused without blocking)."""
    with open_regular(path) as handle:
        return os.dup(handle.fileno())


def _require_regular(path: Path) -> None:
    """Refuse a FIFO, device or folder where the shard set needs a regular file (``stat`` never blocks)."""
    if path.exists() and not path.is_file():
        raise ValueError(f"ShardedDataset: {path} is not a regular file (a FIFO, device or folder); refused")


def _inside(root: Path, name: str) -> Path:
    """``root / name`` for a plain shard name, refusing links that resolve outside ``root``."""
    path = root / name
    resolved, root_resolved = path.resolve(), root.resolve()
    if root_resolved not in resolved.parents:
        raise ValueError(f"ShardedDataset: shard {path} resolves to {resolved}, outside the shard folder {root_resolved}")
    return path


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    _require_regular(path)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"ShardedDataset: no {MANIFEST} in {root} (write one with "
                                f"`python -m pksampler.datasets.pack SRC {root}`; an interrupted pack has none)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"ShardedDataset: {path} is not valid JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ValueError(f"ShardedDataset: {path} is not a {FORMAT_NAME} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"ShardedDataset: {path} has format version {manifest.get('version')!r}; "
                         f"this reader supports {FORMAT_VERSION}")
    for key in ("num_samples", "classes", "shards", "index_fingerprint"):
        if key not in manifest:
            raise ValueError(f"ShardedDataset: {path} lacks the key {key!r}")
    for entry in manifest["shards"]:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not _SHARD_NAME.match(name) or ".." in name:
            raise ValueError(f"ShardedDataset: {path} lists shard {name!r}; shard names must be plain file "
                             f"names matching {_SHARD_NAME.pattern} (no '/', '..' or absolute paths)")
    names = [entry["name"] for entry in manifest["shards"]]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:  # shard ids index this list: a repeated file would serve another shard's byte ranges
        raise ValueError(f"ShardedDataset: {path} lists shard file(s) {repeated} more than once; each shard id "
                         "must name its own file")
    return manifest


def _open_index(root: Path, manifest: dict[str, Any], *, verify: bool) -> tuple[np.ndarray, np.ndarray]:
    """Memory-map index.npy and labels.npy and check them against the manifest."""
    arrays = []
    for name, dtype in ((INDEX_FILE, INDEX_DTYPE), (LABELS_FILE, np.dtype(np.int64))):
        path = root / name
        _require_regular(path)
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise FileNotFoundError(f"ShardedDataset: index file missing: {path}") from None
        except ValueError as error:
            raise ValueError(f"ShardedDataset: {path} is not a readable .npy array: {error}") from None
        if array.dtype != dtype or array.shape != (manifest["num_samples"],):
            raise ValueError(f"ShardedDataset: {path} holds {array.dtype} {array.shape}; the manifest "
                             f"{root / MANIFEST} needs {dtype} ({manifest['num_samples']},)")
        arrays.append(array)
    if index_fingerprint(root) != manifest["index_fingerprint"]:
        raise ShardDamagedError(f"ShardedDataset: {root / INDEX_FILE} and {root / LABELS_FILE} do not match the "
                         f"fingerprint in {root / MANIFEST} (index from another pack?)")
    if verify and _hash_files([root / INDEX_FILE, root / LABELS_FILE], full=True) != manifest.get("index_sha256"):
        raise ShardDamagedError(f"ShardedDataset: {root / INDEX_FILE} and {root / LABELS_FILE} do not match the "
                         f"SHA-256 in {root / MANIFEST}")
    index, labels = arrays
    _check_labels(root, labels, manifest)
    _check_shard_ids(root, index, manifest)
    return index, labels


def _check_labels(root: Path, labels: np.ndarray, manifest: dict[str, Any]) -> None:
    """One pass over the labels in blocks: codes in range, class order (when contiguous) and counts as the manifest says."""
    classes = len(manifest["classes"])
    counts = np.zeros(classes, dtype=np.int64)
    contiguous, previous = bool(manifest.get("class_contiguous")), None
    for start in range(0, labels.size, _LABEL_BLOCK):
        block = np.asarray(labels[start:start + _LABEL_BLOCK])
        low, high = int(block.min()), int(block.max())
        if low < 0 or high >= classes:
            bad = int(np.flatnonzero((block < 0) | (block >= classes))[0])
            raise ShardDamagedError(f"ShardedDataset: {root / LABELS_FILE} holds class code {int(block[bad])} at sample "
                             f"{start + bad}, outside [0, {classes}) (damaged on disk? re-run pack)")
        if contiguous and ((previous is not None and block[0] < previous) or np.any(block[1:] < block[:-1])):
            raise ShardDamagedError(f"ShardedDataset: {root / LABELS_FILE} is not in class order near sample {start}, as "
                             f"{root / MANIFEST} says it is (damaged on disk? re-run pack)")
        previous = block[-1]
        counts += np.bincount(block, minlength=classes)
    expected = manifest.get("class_counts")
    if expected is not None and counts.tolist() != list(expected):
        first = int(np.flatnonzero(counts != np.asarray(expected, dtype=np.int64))[0])
        raise ShardDamagedError(f"ShardedDataset: {root / LABELS_FILE} gives class {first} {int(counts[first])} samples, "
                         f"{root / MANIFEST} says {int(expected[first])} (damaged on disk? re-run pack)")


def _check_shard_ids(root: Path, index: np.ndarray, manifest: dict[str, Any]) -> None:
    """One pass over the index in blocks: every shard id names a shard of the manifest and every payload lies
    inside its shard (an id of 2**31 would make the shard-local plan allocate per id, not per shard)."""
    sizes = np.asarray([int(entry.get("bytes", 0)) for entry in manifest["shards"]], dtype=np.int64)
    for start, block in _blocks_of(index, 1 << 20):
        shards = block["shard"].astype(np.int64)
        bad = np.flatnonzero(shards >= sizes.size)
        if bad.size:
            raise ShardDamagedError(f"ShardedDataset: {root / INDEX_FILE} names shard {int(shards[bad[0]])} at sample "
                                    f"{start + int(bad[0])}; {root / MANIFEST} lists {sizes.size} shards, ids "
                                    f"[0, {sizes.size}) (damaged on disk? re-run pack)")
        ends = block["offset"].astype(np.uint64) + block["size"].astype(np.uint64)
        bad = np.flatnonzero(ends > sizes[shards].astype(np.uint64))
        if bad.size:
            i = int(bad[0])
            raise ShardDamagedError(f"ShardedDataset: {root / INDEX_FILE} puts sample {start + i} at bytes "
                                    f"[{int(block['offset'][i])}, {int(ends[i])}) of shard {int(shards[i])}, which has "
                                    f"{int(sizes[shards[i]])} bytes in {root / MANIFEST} (damaged on disk? re-run pack)")


def _blocks_of(array: np.ndarray, length: int) -> Iterator[tuple[int, np.ndarray]]:
    """(start, copy of ``array[start:start + length]``) over the array; a memory-mapped one is read through a file
    handle, so the pass leaves no mapped pages in the process's resident memory."""
    filename = getattr(array, "filename", None)
    if not isinstance(array, np.memmap) or not filename:
        for start in range(0, array.size, length):
            yield start, np.asarray(array[start:start + length])
        return
    with open(filename, "rb") as handle:
        handle.seek(array.offset)
        for start in range(0, array.size, length):
            yield start, np.fromfile(handle, dtype=array.dtype, count=min(length, array.size - start))

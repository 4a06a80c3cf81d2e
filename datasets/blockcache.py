"""A node-local cache of fixed-size blocks of remote shards, shared by every process on a host.

Why: with the shard-local plan (``locality="shard"``) a rank's lanes read a
shard in long *visits*: over one shuffling window a lane's K-chunks lie in
one contiguous byte range of a shard, read in shuffled order. Coalescing per
batch turns that into about one GET per K-chunk (2.5·10⁷ GETs per epoch at
10⁸ images); reading the range in blocks of ``block_bytes`` (16 MiB) and
keeping them until the window has passed turns it into about one GET per
block: bytes per epoch / block size (6·10⁵ at 10⁸ images of 100 KB).

How:

* A block is ``[b·B, (b+1)·B)`` of one shard, stored as one file in
  ``folder``; its name carries the shard's name and a digest of the shard's
  manifest entry, so a re-packed shard never serves stale bytes.
* The folder is shared by all ranks and DataLoader workers of a host (spawned
  or forked): a block is fetched once per host. Fetches of the same block are
  serialised by ``flock`` on one of 256 lock files (the kernel frees a lock
  when its holder dies); the others wait and then read the file.
* A block is written atomically (:func:`pksampler.files.atomic_writer`) and
  its size checked on every read, so a reader never sees a torn block; a
  block whose file is missing, short or vanished is fetched again.
* The folder stays within ``limit_bytes`` plus the blocks of the call in
  progress: after a fetch, the least recently used blocks (by mtime, renewed
  on every hit) are deleted. A block being read stays readable after its
  deletion (an open file), so eviction never breaks a reader.
* Memory: a process holds only the blocks it is fetching for the current
  batch; hits are ``pread``s of the sample's bytes from the block file, served
  from the page cache. Put ``folder`` on ``/dev/shm`` to keep the cache in RAM.

Size the limit for the working set: every lane on the host keeps one window of
its K-chunks (``window × K × mean image bytes``) plus about two blocks; see
docs/object-store.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from pksampler.files import atomic_writer

__all__ = ["BlockCache", "DEFAULT_BLOCK_BYTES"]

DEFAULT_BLOCK_BYTES = 16 << 20
_LOCK_STRIPES = 256
_STALE_TEMPORARY_SECONDS = 600.0
_TOUCH_AFTER_SECONDS = 1.0


class BlockCache:
    """Blocks of remote objects kept as files in ``folder``, at most about ``limit_bytes`` of them.

    Args:
        folder: a node-local folder (created); every process of the host that reads the same store should use it.
        limit_bytes: the folder's byte limit; must hold at least two blocks.
        block_bytes: the block size (and the size of each GET); at least 64 KiB.
    """

    def __init__(self, folder: str | os.PathLike, *, limit_bytes: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
        for name, value, least in (("block_bytes", block_bytes, 64 << 10), ("limit_bytes", limit_bytes, None)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"BlockCache({name}=) must be an int (bytes), got {value!r}")
            if least is not None and value < least:
                raise ValueError(f"BlockCache({name}=) must be at least {least} bytes, got {value}")
        if limit_bytes < 2 * block_bytes:
            raise ValueError(f"BlockCache(limit_bytes=) must hold at least two blocks of {block_bytes} bytes, "
                             f"got {limit_bytes}")
        self.folder = Path(folder)
        self.limit_bytes = limit_bytes
        self.block_bytes = block_bytes
        (self.folder / "locks").mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"BlockCache({str(self.folder)!r}, limit_bytes={self.limit_bytes}, block_bytes={self.block_bytes})"

    def read(self, store: Any, name: str, version: str, object_bytes: int,
             ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes ``[start, end)`` of each range of object ``name`` (``object_bytes`` long), through the cache.

        ``store.get_ranges(name, ranges)`` fetches the missing blocks (adjacent ones in one GET);
        ``version`` is a short string that changes when the object does (a digest of its manifest entry).
        """
        for start, end in ranges:
            if not 0 <= start <= end <= object_bytes:
                raise ValueError(f"{name}: byte range [{start}, {end}) outside the object's {object_bytes} bytes")
        for _ in range(3):
            try:
                return self._read_once(store, name, version, object_bytes, ranges)
            except _Evicted:  # another process needed the room between our check and our read: check again
                continue
        raise OSError(f"{self.folder}: blocks of {name} were evicted while being read three times in a row; the "
                      f"cache's limit ({self.limit_bytes} bytes) is below the host's working set: raise it")

    def _read_once(self, store: Any, name: str, version: str, object_bytes: int,
                   ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        first_last = [(start // self.block_bytes, max(start, end - 1) // self.block_bytes) for start, end in ranges]
        blocks = sorted({b for first, last in first_last for b in range(first, last + 1)})
        files = {b: self._path(name, version, b) for b in blocks}
        sizes = {b: min(self.block_bytes, object_bytes - b * self.block_bytes) for b in blocks}
        held: dict[int, bytes] = {}
        missing = [b for b in blocks if not self._usable(files[b], sizes[b])]
        if missing:
            held = self._fetch(store, name, missing, files, sizes)
        return [self._slice(start, end, files, held) for start, end in ranges]

    # -- one batch's blocks -------------------------------------------------------------------------------------------

    def _path(self, name: str, version: str, block: int) -> Path:
        return self.folder / f"{name}.{version}.{block:07d}"

    @staticmethod
    def _usable(path: Path, size: int) -> bool:
        """Whether ``path`` holds a whole block (then its use time is renewed for the LRU)."""
        try:
            stat = path.stat()
        except FileNotFoundError:
            return False
        if stat.st_size != size:
            return False
        if time.time() - stat.st_mtime > _TOUCH_AFTER_SECONDS:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)
        return True

    def _fetch(self, store: Any, name: str, missing: list[int], files: dict[int, Path],
               sizes: dict[int, int]) -> dict[int, bytes]:
        """Fetch the blocks still missing once their locks are held; returns their bytes (kept for this call)."""
        with self._locked(files[b].name for b in missing):
            still = [b for b in missing if not self._usable(files[b], sizes[b])]
            if not still:
                return {}
            spans = [(b * self.block_bytes, b * self.block_bytes + sizes[b]) for b in still]
            fetched = store.get_ranges(name, spans, gap=0)
            for b, data in zip(still, fetched):
                if len(data) != sizes[b]:
                    raise OSError(f"{name}: block {b} came back with {len(data)} of {sizes[b]} bytes")
                with atomic_writer(files[b]) as stream:
                    stream.write(data)
        self._evict(keep={files[b] for b in still})
        return dict(zip(still, fetched))

    @contextlib.contextmanager
    def _locked(self, names: Iterator[str]) -> Iterator[None]:
        """Hold the lock stripes of ``names`` (taken in sorted order, so two processes never deadlock)."""
        stripes = sorted({int(hashlib.blake2b(n.encode(), digest_size=4).hexdigest(), 16) % _LOCK_STRIPES
                          for n in names})
        handles = []
        try:
            for stripe in stripes:
                handle = open(self.folder / "locks" / f"{stripe:03d}.lock", "a+b")
                handles.append(handle)
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            yield
        finally:
            for handle in handles:
                handle.close()  # closing releases the flock

    def _slice(self, start: int, end: int, files: dict[int, Path], held: dict[int, bytes]) -> bytes:
        """Bytes ``[start, end)`` from this call's fetched blocks or by ``pread`` from the block files."""
        parts = []
        position = start
        while position < end:
            block = position // self.block_bytes
            offset = position - block * self.block_bytes
            length = min(end, (block + 1) * self.block_bytes) - position
            if block in held:
                parts.append(held[block][offset:offset + length])
            else:
                parts.append(self._pread(files[block], offset, length))
            position += length
        return b"".join(parts)

    def _pread(self, path: Path, offset: int, length: int) -> bytes:
        try:
            handle = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # evicted between the check and the read: another process needed the room
            raise _Evicted(path) from None
        try:
            data = os.pread(handle, length, offset)
        finally:
            os.close(handle)
        if len(data) != length:
            raise OSError(f"{path}: a cached block ended after {len(data)} of {length} bytes")
        return data

    # -- the folder's byte limit --------------------------------------------------------------------------------------

    def usage(self) -> tuple[int, int]:
        """(blocks, bytes) in the folder now."""
        entries = self._blocks()
        return len(entries), sum(size for _, size, _ in entries)

    def _blocks(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every block file; temporaries a killed writer left are removed when stale."""
        out = []
        now = time.time()
        with os.scandir(self.folder) as scan:
            for entry in scan:
                if not entry.is_file(follow_symlinks=False):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    stat = entry.stat(follow_symlinks=False)
                    if entry.name.startswith("."):
                        if now - stat.st_mtime > _STALE_TEMPORARY_SECONDS:
                            os.unlink(entry.path)
                        continue
                    out.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        return out

    def _evict(self, keep: set[Path]) -> None:
        """Delete least recently used blocks until the folder is within the limit (never those in ``keep``)."""
        entries = sorted(self._blocks())
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.limit_bytes:
                break
            if path in keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            total -= size


class _Evicted(OSError):
    """A block file deleted by another process between the check and the read (the caller reads again)."""

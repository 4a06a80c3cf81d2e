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
  ``folder/pksampler-blocks-v1/``, a folder the cache creates (mode 0700) and
  owns; its name carries the shard's name and a *version* (a digest of the
  store's endpoint, bucket and prefix and of the shard's manifest entry), so
  a re-packed shard or another pack never serves stale bytes. Nothing else in
  ``folder`` is read, counted or deleted: ``cache_dir: /dev/shm`` is safe.
* A shared host is not trusted: the blocks folder must belong to the user and
  not be writable by group or others (else an error naming it); blocks and
  lock files are opened with ``O_NOFOLLOW`` and must be regular files (a lock
  with more than one link is refused), so a planted link is never served,
  never written through and never makes two lock stripes one.
* The folder is shared by all ranks and DataLoader workers of a host (spawned
  or forked): a block is fetched once per host. Fetches of the same block are
  serialised by ``flock`` on one of 256 lock files (the kernel frees a lock
  when its holder dies); the others wait and then read the file.
* A block is written atomically (:func:`pksampler.files.atomic_writer`) and
  its size checked on every read, so a reader never sees a torn block; a
  block whose file is missing, short or vanished is fetched again.
* The folder stays within ``limit_bytes`` plus the blocks of the call in
  progress: after a fetch, the least recently used blocks (by mtime, renewed
  on every hit) are deleted; only names of the block pattern are. A block
  being read stays readable after its deletion (an open file), so eviction
  never breaks a reader.
* A full, read-only or vanished folder never stops a job: the fetched bytes
  are in memory already, so they are served uncached with one warning per
  process naming the folder (``data.args.cache_dir``), and a folder or
  ``locks/`` deleted mid-run is created again.
* Memory: a process holds only the blocks it is fetching for the current
  batch; hits are ``pread``s of the sample's bytes from the block file, served
  from the page cache. Put ``folder`` on ``/dev/shm`` to keep the cache in RAM.

Size the limit for the working set: every lane on the host keeps one window of
its K-chunks (``window × K × mean image bytes``) plus about two blocks; see
docs/object-store.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat as stat_module
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

from pksampler.files import atomic_writer

__all__ = ["BlockCache", "DEFAULT_BLOCK_BYTES"]

DEFAULT_BLOCK_BYTES = 16 << 20
_LOCK_STRIPES = 256
_STALE_TEMPORARY_SECONDS = 600.0
_TOUCH_AFTER_SECONDS = 1.0
#: the folder the cache creates inside the user's ``folder``; the version suffix changes with the layout
BLOCKS_FOLDER = "pksampler-blocks-v1"
#: ``<shard name>.<version>.<block number>``: the only names eviction deletes
_BLOCK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.[0-9a-f]{12,64}\.[0-9]{7,}$")
#: atomic_writer's temporaries of block files (``.<block name>.<random>.tmp``)
_TEMPORARY_NAME = re.compile(r"^\.[A-Za-z0-9][A-Za-z0-9_.-]*\.[0-9a-f]{12,64}\.[0-9]{7,}\..+\.tmp$")
#: errors of a cache folder that cannot take a block now (full, read-only, quota, vanished): serve uncached
_CACHE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.ENOENT, errno.EACCES, errno.EPERM}


class BlockCache:
    """Blocks of remote objects kept as files in ``folder``, at most about ``limit_bytes`` of them.

    Args:
        folder: a node-local folder (created); the blocks go to ``folder/pksampler-blocks-v1/``. Every process of
            the host that reads the same store should use it.
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
        self.root = Path(folder)
        self.folder = self.root / BLOCKS_FOLDER
        self.limit_bytes = limit_bytes
        self.block_bytes = block_bytes
        self._warned = False
        try:
            self._prepare()
        except OSError as error:
            if error.errno is None:  # an unsafe folder: refused
                raise
            self._degraded(error)  # a read-only or full disk: serve uncached (and say so)

    def _prepare(self) -> None:
        """Create ``root/pksampler-blocks-v1/locks`` (mode 0700) and check that the blocks folder is safe to use."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            # errno-less, so __init__ refuses it at once instead of serving uncached: the setting is wrong
            raise NotADirectoryError(
                f"BlockCache(folder=) (data.args.cache_dir, ShardedDataset(cache_dir=)): {str(self.root)!r} is a "
                "file or lies under one; the cache needs a folder there (one it can create): choose another "
                "cache_dir") from None
        for path in (self.folder, self.folder / "locks"):
            with contextlib.suppress(FileExistsError):
                path.mkdir(mode=0o700)
            _check_private(path)

    def __repr__(self) -> str:
        return f"BlockCache({str(self.root)!r}, limit_bytes={self.limit_bytes}, block_bytes={self.block_bytes})"

    def read(self, store: Any, name: str, version: str, object_bytes: int,
             ranges: Sequence[tuple[int, int]], *, etag: str | None = None) -> list[bytes]:
        """The bytes ``[start, end)`` of each range of object ``name`` (``object_bytes`` long), through the cache.

        ``store.get_ranges(name, ranges, etag=etag)`` fetches the missing blocks (adjacent ones in one GET, each
        carrying ``If-Match: etag`` when given); ``version`` is a short hex string that changes when the object
        does (a digest of the store, its manifest entry and its ETag).
        """
        for start, end in ranges:
            if not 0 <= start <= end <= object_bytes:
                raise ValueError(f"{name}: byte range [{start}, {end}) outside the object's {object_bytes} bytes")
        for _ in range(3):
            try:
                return self._read_once(store, name, version, object_bytes, ranges, etag)
            except _Evicted:  # another process needed the room between our check and our read: check again
                continue
        raise OSError(f"{self.folder}: blocks of {name} were evicted while being read three times in a row; the "
                      f"cache's limit ({self.limit_bytes} bytes) is below the host's working set: raise it")

    def _read_once(self, store: Any, name: str, version: str, object_bytes: int,
                   ranges: Sequence[tuple[int, int]], etag: str | None) -> list[bytes]:
        first_last = [(start // self.block_bytes, max(start, end - 1) // self.block_bytes) for start, end in ranges]
        blocks = sorted({b for first, last in first_last for b in range(first, last + 1)})
        files = {b: self._path(name, version, b) for b in blocks}
        sizes = {b: min(self.block_bytes, object_bytes - b * self.block_bytes) for b in blocks}
        held: dict[int, bytes] = {}
        missing = [b for b in blocks if not self._usable(files[b], sizes[b])]
        if missing:
            held = self._fetch(store, name, etag, missing, files, sizes)
        return [self._slice(start, end, files, held) for start, end in ranges]

    # -- one batch's blocks -------------------------------------------------------------------------------------------

    def _path(self, name: str, version: str, block: int) -> Path:
        return self.folder / f"{name}.{version}.{block:07d}"

    @staticmethod
    def _usable(path: Path, size: int) -> bool:
        """Whether ``path`` holds a whole block (then its use time is renewed for the LRU)."""
        try:
            stat = path.lstat()
        except (FileNotFoundError, NotADirectoryError):
            return False
        if not stat_module.S_ISREG(stat.st_mode) or stat.st_size != size:
            return False  # a planted link or special file is never served: the block is fetched over it
        if time.time() - stat.st_mtime > _TOUCH_AFTER_SECONDS:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)
        return True

    def _fetch(self, store: Any, name: str, etag: str | None, missing: list[int], files: dict[int, Path],
               sizes: dict[int, int]) -> dict[int, bytes]:
        """Fetch the blocks still missing once their locks are held; returns their bytes (kept for this call).

        A folder that cannot take them (full, read-only, deleted) costs a warning, not the job: the bytes are
        served from memory, and the folders are created again for the next call.
        """
        try:
            with self._locked(files[b].name for b in missing):
                still = [b for b in missing if not self._usable(files[b], sizes[b])]
                if not still:
                    return {}
                fetched = self._get(store, name, etag, still, sizes)
                try:
                    for b, data in zip(still, fetched):
                        with atomic_writer(files[b]) as stream:
                            stream.write(data)
                except OSError as error:
                    self._degraded(error)
                    return dict(zip(still, fetched))
        except _Unlocked as unlocked:
            self._degraded(unlocked.error)
            return dict(zip(missing, self._get(store, name, etag, missing, sizes)))
        with contextlib.suppress(OSError):
            self._evict(keep={files[b] for b in still})
        return dict(zip(still, fetched))

    def _get(self, store: Any, name: str, etag: str | None, blocks: list[int],
             sizes: dict[int, int]) -> list[bytes]:
        """The bytes of ``blocks`` of object ``name`` (``If-Match: etag``) from the store, each checked for its
        length."""
        spans = [(b * self.block_bytes, b * self.block_bytes + sizes[b]) for b in blocks]
        fetched = store.get_ranges(name, spans, gap=0, etag=etag)
        for b, data in zip(blocks, fetched):
            if len(data) != sizes[b]:
                raise OSError(f"{name}: block {b} came back with {len(data)} of {sizes[b]} bytes")
        return fetched

    def _degraded(self, error: OSError) -> None:
        """Warn once per process that blocks are served uncached, and re-create the folders if they vanished."""
        if isinstance(error, _Unsafe) or error.errno not in _CACHE_ERRNOS:
            raise error
        if not self._warned:
            self._warned = True
            reason = errno.errorcode.get(error.errno or 0, type(error).__name__)
            remedy = ("deleted while in use: created again" if error.errno == errno.ENOENT else
                      "free room, or move it")
            warnings.warn(f"block cache {self.folder} (data.args.cache_dir, ShardedDataset(cache_dir=)): {reason}: "
                          f"{error.strerror or error}; serving blocks uncached while it cannot take them ({remedy})",
                          RuntimeWarning, stacklevel=4)
        with contextlib.suppress(OSError):
            self._prepare()

    @contextlib.contextmanager
    def _locked(self, names: Iterator[str]) -> Iterator[None]:
        """Hold the lock stripes of ``names`` (taken in sorted order, so two processes never deadlock)."""
        stripes = sorted({int(hashlib.blake2b(n.encode(), digest_size=4).hexdigest(), 16) % _LOCK_STRIPES
                          for n in names})
        handles: list[int] = []
        try:
            for stripe in stripes:
                try:
                    handles.append(_open_lock(self.folder / "locks" / f"{stripe:03d}.lock"))
                except OSError as error:  # a vanished, full or read-only folder, or a planted lock file
                    raise _Unlocked(error) from None
                fcntl.flock(handles[-1], fcntl.LOCK_EX)
            yield
        finally:
            for handle in handles:
                os.close(handle)  # closing releases the flock

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
            handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):  # evicted between the check and the read: read again
            raise _Evicted(path) from None
        except OSError as error:
            if error.errno == errno.ELOOP:  # a link planted after the check: fetched over on the next try
                raise _Evicted(path) from None
            raise
        try:
            if not stat_module.S_ISREG(os.fstat(handle).st_mode):
                raise _Evicted(path)
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
        """(mtime, size, path) of every block file (names of the block pattern only); block temporaries a killed
        writer left are removed when stale."""
        out = []
        now = time.time()
        with os.scandir(self.folder) as scan:
            for entry in scan:
                block, temporary = _BLOCK_NAME.match(entry.name), _TEMPORARY_NAME.match(entry.name)
                if not (block or temporary) or not entry.is_file(follow_symlinks=False):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    stat = entry.stat(follow_symlinks=False)
                    if temporary:
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


class _Unsafe(OSError):
    """A lock file that is not a plain file of its own (a link, or one file under two stripe names)."""


class _Unlocked(Exception):
    """A lock stripe could not be opened (``error`` says why): the blocks are fetched without the cache."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _open_lock(path: Path) -> int:
    """A descriptor of lock file ``path``: created if missing, never through a link, never a file with two names
    (two stripes on one file would make a process wait for itself)."""
    try:
        handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        handle = -1
    if handle >= 0:
        stat = os.fstat(handle)
        if stat_module.S_ISREG(stat.st_mode) and stat.st_nlink == 1:
            return handle
        os.close(handle)
    raise _Unsafe(f"BlockCache: lock file {path} is a link, a special file or one file under several names; "
                  "refused (only this user can write the cache's folder: who planted it?)")


def _check_private(path: Path) -> None:
    """Refuse a cache folder that is a link, is not the user's, or that group or others may write (a neighbour on
    the host could plant blocks there)."""
    stat = path.lstat()
    problem = None
    if not stat_module.S_ISDIR(stat.st_mode):
        problem = "is not a folder (a link or a file)"
    elif stat.st_uid != os.geteuid():
        problem = f"belongs to uid {stat.st_uid}, not to this user (uid {os.geteuid()})"
    elif stat.st_mode & 0o022:
        problem = f"has mode {stat_module.S_IMODE(stat.st_mode):04o}: group or others may write it"
    if problem is not None:
        raise PermissionError(f"BlockCache(folder=): {path} {problem}; the cache keeps its blocks only in a folder of "
                              "its own (mode 0700): remove it, or choose another cache_dir")

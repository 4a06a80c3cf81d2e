"""Files written atomically: a temporary file in the same folder, fsync, rename.

Every file the project writes (checkpoints, PNGs, metrics snapshots, packed
shards' indexes, synthetic images) goes through :func:`atomic_write_bytes` or
:func:`atomic_writer`, so a crash or a kill while writing leaves the previous
file intact and a reader never sees a half-written one. The temporary files
are named ``.<name>.<random>.tmp``; :func:`remove_stale_temporaries` deletes
the ones a killed process left behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import IO, BinaryIO, Iterator

__all__ = ["LockFileError", "atomic_write_bytes", "atomic_write_text", "atomic_writer", "lock_exclusively",
           "parse_bytes", "remove_stale_temporaries"]

_SUFFIX = ".tmp"


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Open a binary stream whose contents replace ``path`` only when the block ends without error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_SUFFIX, dir=path.parent)
    try:
        # mkstemp creates 0600; give the file the mode an ordinary open() would (0666 less the umask),
        # so shards and checkpoints in a shared folder stay readable by the team.
        os.fchmod(handle, 0o666 & ~_umask())
        with os.fdopen(handle, "wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_writer(path) as stream:
        stream.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically; returns the path."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def remove_stale_temporaries(folder: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Delete temporary files that :func:`atomic_writer` left in ``folder`` when its process was killed.

    Only files of this module's pattern (``.<name>.*.tmp``) are touched; with
    ``name`` only those for that target file. Call it at start-up, before any
    writer of this process runs. Returns the removed paths.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    pattern = f".{name}.*{_SUFFIX}" if name else f".*{_SUFFIX}"
    removed = []
    for candidate in folder.glob(pattern):
        if candidate.is_file():
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


class LockFileError(ValueError):
    """A lock file's path holds something that is not a regular file (a link, a FIFO, a folder): one line naming it."""


def _open_lock_file(path: str | os.PathLike) -> IO[str]:
    """``path`` opened for reading and writing, created if absent, refusing anything but a regular file.

    The lock file is truncated and written: a symbolic link planted in its
    place would have the holder's line written into the file it points to,
    and a FIFO or a folder cannot be truncated. ``O_NOFOLLOW`` refuses a link,
    ``O_NONBLOCK`` keeps a FIFO from blocking the open, ``fstat`` on the open
    descriptor decides the rest.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(path, flags, 0o644)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.EISDIR):
            raise
        kind = "a symbolic link" if os.path.islink(path) else "a folder"
        raise LockFileError(f"{os.fspath(path)} is {kind}, not a regular file: it cannot be used as a lock file; "
                            "remove it") from None
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device or special file"
        raise LockFileError(f"{os.fspath(path)} is {kind}, not a regular file: it cannot be used as a lock file; "
                            "remove it")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "r+", encoding="utf-8")


def lock_exclusively(path: str | os.PathLike, holder: str, *,
                     unknown: str = "another process") -> tuple[IO[str] | None, str]:
    """Take a non-blocking ``flock`` on ``path`` and write ``holder`` into it.

    Returns ``(handle, holder)`` when taken (keep the handle open while the
    lock is held; the kernel releases it when the process dies), else
    ``(None, what the file names as the current holder)`` so the caller can
    raise its own error naming it.

    Raises:
        LockFileError: ``path`` is a symbolic link, a FIFO, a folder or another non-regular file.
    """
    handle = _open_lock_file(path)
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        current = handle.read().strip() or unknown
        handle.close()
        return None, current
    handle.seek(0)
    handle.truncate()
    handle.write(holder + "\n")
    handle.flush()
    return handle, holder


def parse_bytes(text: str | int, *, name: str, least: int = 0) -> int:
    """``"512MB"``, ``"2GiB"``, ``"1000000"`` or an int -> bytes (decimal and binary units).

    Raises:
        ValueError: naming ``name`` (the argument or key), the value and the rule.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*", str(text))
        if not match:
            raise ValueError(f"{name}: expected a size such as 512MB or 1GiB, got {text!r}")
        number, unit = float(match.group(1)), (match.group(2) or "b").lower().rstrip("b")
        base = 1024 if unit.endswith("i") else 1000
        value = int(number * base ** " kmgt".index((unit[:1] or " ")))
    if value < least:
        raise ValueError(f"{name}: must be at least {least} bytes, got {text!r}")
    return value

"""The run's workspace on rank 0: an exclusive lock, left-over temporaries, the metrics log.

* One job per workspace: :class:`WorkspaceLock` takes an ``flock`` on
  ``WORKSPACE/.lock`` (released by the kernel when the process dies, so a
  killed job never blocks the next one) and records the holder's pid and
  host, which a second job's error names.
* Files that a killed writer left half-written (``.name.*.tmp``) are removed
  at start.
* ``metrics.jsonl`` is appended to line by line; on resume the lines past the
  checkpoint's step are dropped, so a step is never logged twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

from pksampler.files import LockFileError, atomic_write_text, lock_exclusively, remove_stale_temporaries

from pksampler.train.errors import ConfigError

__all__ = ["EventLog", "WorkspaceLock", "json_line", "prepare_workspace", "writing"]

SUBFOLDERS = ("checkpoints", "galleries")


@contextlib.contextmanager
def writing(path: Path, what: str = "") -> Iterator[None]:
    """Turn a failed write (a full disk, a quota, a folder removed under the job) into one clear ConfigError."""
    try:
        yield
    except OSError as error:
        raise ConfigError(f"workspace: cannot write {path} ({error.strerror or error}){what}: free space or "
                          "choose another WORKSPACE, then resume") from None


class WorkspaceLock:
    """An exclusive, process-lifetime lock on a workspace folder."""

    def __init__(self, workspace: Path) -> None:
        self.path = workspace / ".lock"
        self.handle = None

    @property
    def held(self) -> bool:
        return self.handle is not None

    def acquire(self, *, wait_seconds: float = 0.0) -> None:
        """Take the lock; held by another process, retry for ``wait_seconds`` (a process that is going away)."""
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                handle, holder = lock_exclusively(self.path, f"pid {os.getpid()} on host {socket.gethostname()}",
                                                  unknown="an unknown process")
            except LockFileError as error:
                raise ConfigError(f"workspace: {error}") from None
            if handle is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if handle is None:
            raise ConfigError(
                f"workspace: {self.path.parent} is in use by another job ({holder}); wait for it to finish "
                "or set WORKSPACE / --set workspace=... to another folder"
            )
        self.handle = handle

    def release(self) -> None:
        if self.handle is not None:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_UN)
            self.handle.close()
            self.handle = None


def prepare_workspace(workspace: Path) -> WorkspaceLock:
    """Create the folders, take the lock and clear stale temporaries; ConfigError when unusable."""
    try:
        for sub in SUBFOLDERS:
            (workspace / sub).mkdir(parents=True, exist_ok=True)
        probe = workspace / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"workspace: {workspace} is not a writable folder ({error.strerror or error})") from None
    lock = WorkspaceLock(workspace)
    lock.acquire()
    for folder in (workspace, *(workspace / sub for sub in SUBFOLDERS)):
        remove_stale_temporaries(folder)
    return lock


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def json_line(record: dict[str, Any]) -> str:
    """One metrics.jsonl line of ``record`` (no newline); NaN and infinities become the strings "nan", "inf",
    "-inf" (JSON has no such numbers). Every writer of the log writes its lines with this."""
    return json.dumps({k: _json_number(v) for k, v in record.items()}, allow_nan=False)


class EventLog:
    """Rank-0 ``metrics.jsonl`` writer: one JSON object per line, flushed per line."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.handle = open(path, "a", encoding="utf-8") if enabled else None

    def write(self, **record: Any) -> None:
        """Append ``record``; NaN and infinities become the strings "nan", "inf", "-inf" (JSON has no such numbers)."""
        if self.handle is not None:
            self.handle.write(json_line(record) + "\n")
            self.handle.flush()

    def truncate_after(self, global_step: int) -> None:
        """Drop records of steps after ``global_step`` (a resumed run rolls back to its checkpoint)."""
        if self.handle is None or not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if int(record.get("global_step", 0)) <= global_step:
                kept.append(line)
        self.handle.close()
        with writing(self.path):
            atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))
        self.handle = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

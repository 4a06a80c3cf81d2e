"""Checkpoints that hold only tensors and plain data, written atomically, read without executing code.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts. numpy
arrays are stored as tensors (:func:`to_storable`) and come back as arrays
(:func:`to_numpy`). Reading uses ``torch.load(weights_only=True)``, whose
unpickler accepts nothing else, so a planted or tampered file cannot run
code; such a file is refused with a message naming it. Writing goes through
:mod:`pksampler.files`: a crash while saving leaves the previous checkpoint
intact.

:class:`CheckpointWriter` makes a checkpoint cheap for the loop: the state is
copied to host memory (fast: a memcpy per tensor), and serialising and
writing happen in one background thread, so training goes on meanwhile.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from pksampler.files import atomic_write_bytes

from pksampler.train.errors import ConfigError
from pksampler.train.runtime.workspace import writing

__all__ = ["CheckpointError", "CheckpointWriter", "check_training_checkpoint", "count_non_finite", "host_copy",
           "load_checkpoint", "save_checkpoint", "to_numpy", "to_storable"]


class CheckpointError(ConfigError):
    """A checkpoint is missing, unreadable or holds something other than tensors and plain data."""


def to_storable(value: Any) -> Any:
    """``value`` with numpy arrays as tensors and numpy scalars as Python numbers (weights_only-loadable)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value).copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {key: to_storable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_storable(item) for item in value]
    return value


def to_numpy(value: Any) -> Any:
    """The inverse of :func:`to_storable` for states that want numpy arrays back (samplers)."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, dict):
        return {key: to_numpy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [to_numpy(item) for item in value]
    return value


def count_non_finite(tensors: dict[str, Any]) -> int:
    """How many values of the floating-point tensors in ``tensors`` (a state dict) are NaN or infinite."""
    return sum(int((~torch.isfinite(t)).sum()) for t in tensors.values()
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()))


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Serialise ``state`` (after :func:`to_storable`) and write it atomically to ``path``."""
    buffer = io.BytesIO()
    torch.save(to_storable(state), buffer)
    return atomic_write_bytes(path, buffer.getvalue())


def load_checkpoint(path: str | os.PathLike, *, mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint on the CPU with ``weights_only=True``; refuse anything else, naming the file.

    ``mmap``: the tensors map the file instead of being read, so a rank that takes a few rows of a large head
    reads only those pages (``train.init_from``)."""
    path = Path(path)
    if not path.is_file():
        if not path.exists():
            raise CheckpointError(f"checkpoint not found: {path}")
        what = "a directory" if path.is_dir() else "not a regular file (a FIFO, socket or device)"
        raise CheckpointError(f"checkpoint {path} is {what}: name the checkpoint file itself")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        reason = str(error).splitlines()[0][:200]
        raise CheckpointError(
            f"checkpoint {path} was refused: it holds objects other than tensors and plain data, and loading "
            f"it could run code ({reason}). Delete it or start afresh with --no-resume or another WORKSPACE"
        ) from None
    except Exception as error:  # truncated, not a torch file, ...
        raise CheckpointError(f"checkpoint {path} could not be read: {type(error).__name__}: {error}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, expected a dict")
    return state


#: the sections of a training checkpoint and their types (see run_setup's checkpoint state)
_SECTIONS = {"model": dict, "optimizer": dict, "scheduler": dict, "loss": dict, "state": dict, "sampler": dict,
             "config": dict}


def check_training_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Refuse a checkpoint that loads safely but lacks a section, or holds one of the wrong type, naming both."""
    for key, kind in _SECTIONS.items():
        if not isinstance(state.get(key), kind):
            found = "nothing" if key not in state else f"a {type(state[key]).__name__}"
            raise CheckpointError(f"checkpoint {path}: section {key!r} must be a {kind.__name__}, it holds {found}; "
                                  "the file is damaged or not a pksampler training checkpoint: start afresh with "
                                  "--no-resume or another WORKSPACE")
    _check_state_section(state["state"], path)
    for name, value in state["model"].items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"checkpoint {path}: model entry {name!r} is a {type(value).__name__}, not a tensor; "
                                  "start afresh with --no-resume or another WORKSPACE")
#: the loop's position in a checkpoint's ``state`` section: counters the resumed loop does arithmetic on
_STATE_COUNTERS = ("epoch", "global_step", "consumed")


def _check_state_section(section: dict[str, Any], path: str | os.PathLike) -> None:
    """Refuse a ``state`` section whose counters are not whole numbers >= 0 (a string ``epoch`` gave a traceback)."""
    for key in _STATE_COUNTERS:
        value = section.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise CheckpointError(f"checkpoint {path}: state.{key} must be a whole number >= 0, it holds "
                                  f"{value!r} ({type(value).__name__}); the file is damaged or not a pksampler "
                                  "training checkpoint: start afresh with --no-resume or another WORKSPACE")


def host_copy(value: Any) -> Any:
    """A storable copy of ``value`` that shares no memory with it: tensors copied to the CPU, containers rebuilt.

    The loop keeps updating parameters, optimizer moments and histories in
    place while the background thread serialises, so nothing may be shared.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (np.ndarray, np.generic)):
        return to_storable(value)  # copies
    if isinstance(value, dict):
        return {key: host_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [host_copy(item) for item in value]
    return value


class CheckpointWriter:
    """Writes checkpoints from host copies in one background thread, atomically, one file at a time.

    1. :meth:`save` copies the state to host memory and queues it; the caller
       goes on training.
    2. One thread serialises and writes (:func:`save_checkpoint`, atomic), so
       at most one write is in flight and no two writers touch one file. A
       newer state for a file whose write has not started replaces the queued
       one (the older would be overwritten at once).
    3. A failed write is raised by the next :meth:`save` or by :meth:`close`,
       naming the file (a full disk: one line, the previous checkpoint intact).
       :meth:`close` waits for the last write; call it before the process ends.

    With ``background=False`` every save writes before it returns.
    """

    def __init__(self, *, background: bool = True) -> None:
        self.background = background
        self._queued: dict[Path, tuple[dict[str, Any], Callable[[], None] | None]] = {}
        self._writing: Path | None = None
        self._failure: tuple[Path, BaseException] | None = None
        self._closed = False
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None

    def save(self, path: str | os.PathLike, state: dict[str, Any], *, then: Callable[[], None] | None = None) -> None:
        """Queue ``state`` for ``path`` (or write it now without a background thread); ``then`` runs once it is
        on disk (dropped with a queued state that a newer one replaces)."""
        self._raise_failure()
        path, snapshot = Path(path), host_copy(state)
        if not self.background:
            self._write(path, snapshot, then)
            self._raise_failure()
            return
        with self._condition:
            if self._closed:
                raise RuntimeError("CheckpointWriter.save after close")
            self._queued.pop(path, None)  # superseded: keep the queue in submission order
            self._queued[path] = (snapshot, then)
            self._condition.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pksampler-checkpoint", daemon=True)
            self._thread.start()

    def wait(self) -> None:
        """Block until every queued state is on disk; raise a failed write's error."""
        with self._condition:
            self._condition.wait_for(lambda: not self._queued and self._writing is None)
        self._raise_failure()

    def close(self) -> None:
        """Wait for the last write and stop the thread; raise a failed write's error.

        Called while an exception is already on its way up, it only waits:
        the first error is the one to show.
        """
        propagating = sys.exc_info()[0] is not None
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join()
        if not propagating:
            self._raise_failure()

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._queued or self._closed)
                if not self._queued:
                    return
                path = next(iter(self._queued))
                state, then = self._queued.pop(path)
                self._writing = path
            try:
                self._write(path, state, then)
            finally:
                with self._condition:
                    self._writing = None
                    self._condition.notify_all()

    def _write(self, path: Path, state: dict[str, Any], then: Callable[[], None] | None) -> None:
        try:
            save_checkpoint(path, state)
            if then is not None:
                then()
        except BaseException as error:  # noqa: BLE001 - kept and raised in the training thread
            with self._condition:
                if self._failure is None:
                    self._failure = (path, error)

    def _raise_failure(self) -> None:
        with self._condition:
            failure, self._failure = self._failure, None
        if failure is None:
            return
        path, error = failure
        if isinstance(error, OSError):
            # the write goes to a temporary file first: an earlier checkpoint, if there is one, is untouched
            kept = "; the previous checkpoint is intact" if Path(path).is_file() else "; no earlier checkpoint exists"
            with writing(path, kept):
                raise error
        raise CheckpointError(f"checkpoint {path} could not be written: {type(error).__name__}: {error}") from error

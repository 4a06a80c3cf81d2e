"""Checkpoints that hold only tensors and plain data, written atomically, read without executing code.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts. numpy
arrays are stored as tensors (:func:`to_storable`) and come back as arrays
(:func:`to_numpy`). Reading uses ``torch.load(weights_only=True)``, whose
unpickler accepts nothing else, so a planted or tampered file cannot run
code; such a file is refused with a message naming it. Writing goes through
:mod:`pksampler.files`: a crash while saving leaves the previous checkpoint
intact.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pksampler.files import atomic_write_bytes

from .rules import ConfigError

__all__ = ["CheckpointError", "check_training_checkpoint", "count_non_finite", "load_checkpoint", "save_checkpoint", "to_numpy", "to_storable"]


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


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint on the CPU with ``weights_only=True``; refuse anything else, naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
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
    for name, value in state["model"].items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"checkpoint {path}: model entry {name!r} is a {type(value).__name__}, not a tensor; "
                                  "start afresh with --no-resume or another WORKSPACE")

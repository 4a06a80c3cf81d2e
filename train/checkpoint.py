"""Checkpoints written atomically: a temporary file in the same folder, fsync, rename.

A crash while saving leaves the previous checkpoint intact; a reader never
sees a half-written file.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from pksampler.files import atomic_write_bytes

__all__ = ["atomic_write_bytes", "load_checkpoint", "save_checkpoint"]


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Serialise ``state`` with ``torch.save`` and write it atomically to ``path``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return atomic_write_bytes(path, buffer.getvalue())


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (on the CPU)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise ValueError(f"checkpoint {path} could not be read: {error}") from None

"""TensorBoard event files for a run: training scalars, evaluation metrics, galleries.

A thin wrapper around ``torch.utils.tensorboard.SummaryWriter`` so the loop
calls three verbs and never formats tags itself:

* :meth:`TensorBoardWriter.scalars` -- per-step values under ``train/``
  (``loss``, ``lr``, ``images_per_sec``, whatever the caller names);
* :meth:`TensorBoardWriter.metrics` -- every numeric evaluation metric under ``eval/``;
* :meth:`TensorBoardWriter.image` -- a PNG file or an HxWx3 array (the result gallery).

Only rank 0 writes: other ranks construct it with ``enabled=False`` and every
call is a no-op. The events go to ``WORKSPACE/tensorboard/``; view them with
``tensorboard --logdir WORKSPACE/tensorboard``. The ``tensorboard`` package is
optional (``pip install pksampler[tensorboard]``); :func:`available` says
whether it is importable, which is the natural default for a config switch.

Example::

    board = TensorBoardWriter(workspace, enabled=rank == 0 and available())
    board.scalars(global_step, loss=0.43, lr=3e-3, images_per_sec=152.3)
    board.metrics(global_step, {"recall_at_1": 0.91, "map_at_r": 0.52}, epoch=3)
    board.image("gallery", global_step, workspace / "galleries" / "epoch_003.png")
    board.close()
"""

from __future__ import annotations

import importlib.util
import numbers
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from pksampler.arrays import as_numpy

__all__ = ["TensorBoardWriter", "available"]

SUBDIR = "tensorboard"


def available() -> bool:
    """True when the ``tensorboard`` package (needed by torch's SummaryWriter) is importable."""
    return importlib.util.find_spec("tensorboard") is not None


def _step(function: str, step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"TensorBoardWriter.{function}(step=) must be a non-negative int, got {step!r}")
    return int(step)


def _number(value: Any) -> float | None:
    """A float for numbers, numpy scalars and one-element tensors; None for anything else."""
    if hasattr(value, "item"):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # more than one element
            return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


class TensorBoardWriter:
    """Writes a run's scalars, metrics and images as TensorBoard events.

    Args:
        workspace: the run's folder; events go to ``workspace/tensorboard``.
        enabled: False on ranks other than 0 (every method is then a no-op).
        flush_secs: how often pending events reach the disk.

    Raises:
        ImportError: enabled but the ``tensorboard`` package is missing (the
            message says how to install it).
    """

    def __init__(self, workspace: str | os.PathLike, *, enabled: bool = True, flush_secs: int = 30) -> None:
        self.log_dir = Path(workspace) / SUBDIR
        self.enabled = bool(enabled)
        self._writer: Any = None
        if not self.enabled:
            return
        if not available():
            raise ImportError(
                "TensorBoardWriter(enabled=True) needs the 'tensorboard' package: "
                "pip install 'pksampler[tensorboard]' (or turn TensorBoard logging off)"
            )
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def scalars(self, step: int, **values: Any) -> None:
        """``train/<name>`` for each keyword, e.g. ``loss=``, ``lr=``, ``images_per_sec=``; None is skipped."""
        if self._writer is None:
            return
        step = _step("scalars", step)
        for name, value in values.items():
            number = _number(value)
            if value is not None and number is None:
                raise TypeError(f"TensorBoardWriter.scalars({name}=) must be a number, got {type(value).__name__}")
            if number is not None:
                self._writer.add_scalar(f"train/{name}", number, step)

    def metrics(self, step: int, metrics: Mapping[str, Any], *, epoch: int | None = None) -> None:
        """``eval/<name>`` for every numeric value of ``metrics`` (others are skipped); ``eval/epoch`` if given.

        ``step`` is the global step, so the evaluation lines up with the loss curve.
        """
        if self._writer is None:
            return
        step = _step("metrics", step)
        for name, value in metrics.items():
            number = _number(value)
            if number is not None:
                self._writer.add_scalar(f"eval/{name}", number, step)
        if epoch is not None:
            self._writer.add_scalar("eval/epoch", float(epoch), step)

    def image(self, tag: str, step: int, image: str | os.PathLike | Any) -> None:
        """One image: a PNG/JPEG path, a PIL image, or an ``(H, W, 3)`` uint8 (or [0, 1] float) array."""
        if self._writer is None:
            return
        step = _step("image", step)
        if isinstance(image, (str, os.PathLike)):
            from PIL import Image

            with Image.open(image) as opened:
                array = np.asarray(opened.convert("RGB"))
        elif hasattr(image, "convert") and hasattr(image, "size"):
            array = np.asarray(image.convert("RGB"))
        else:
            array = as_numpy(image, name="TensorBoardWriter.image(image=)", ndim=3)
            if array.shape[-1] != 3:
                raise ValueError(f"TensorBoardWriter.image(image=) must be (H, W, 3), got shape {array.shape}")
        self._writer.add_image(tag, array, step, dataformats="HWC")

    def flush(self) -> None:
        """Write pending events now."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "TensorBoardWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

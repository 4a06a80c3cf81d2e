"""ImageFolderDataset: one sub-folder per class, scanned without opening images."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from ._image import IMAGE_EXTENSIONS
from .base import ImageFileDataset

__all__ = ["ImageFolderDataset"]


class ImageFolderDataset(ImageFileDataset):
    """Images under ``root/<class name>/...``; class codes follow sorted folder names.

    Scanning uses ``os.scandir`` only (no image is opened, no per-file stat
    beyond the directory entry), so 10^6 files take seconds. Files are kept if
    their extension is an image extension; sub-folders of a class folder are
    walked too.

    Args:
        root: the folder holding one sub-folder per class.
        transform: applied to the decoded RGB PIL image (see :mod:`.transforms`).
        seed: augmentation seed (per-sample generators keyed by seed, epoch, index).
        skip_bad: decode every file at scan time and leave out unreadable ones,
            with a warning that counts them (slow: reads every file).

    Attributes:
        labels: int64 class code per sample. classes: folder names. paths: file paths.
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None, *, seed: int = 0,
                 skip_bad: bool = False) -> None:
        super().__init__(transform, seed=seed)
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"ImageFolderDataset(root=) is not a directory: {self.root}")
        class_dirs = sorted(entry.name for entry in os.scandir(self.root) if entry.is_dir() and not entry.name.startswith("."))
        if not class_dirs:
            raise ValueError(f"ImageFolderDataset(root=) has no class sub-folders: {self.root}")
        paths: list[str] = []
        labels: list[int] = []
        empty: list[str] = []
        for code, name in enumerate(class_dirs):
            found = _scan_images(self.root / name)
            if not found:
                empty.append(name)
            paths.extend(found)
            labels.extend([code] * len(found))
        if not paths:
            raise ValueError(f"ImageFolderDataset(root=) has class folders but no image files ({sorted(IMAGE_EXTENSIONS)}): {self.root}")
        if empty:
            warnings.warn(f"ImageFolderDataset: {len(empty)} class folder(s) hold no images, e.g. {empty[:3]}", stacklevel=2)
        self.paths = paths
        self.labels = np.asarray(labels, dtype=np.int64)
        self.classes = class_dirs
        if skip_bad:
            self._drop_unreadable(f"under {self.root}")


def _scan_images(folder: Path) -> list[str]:
    found: list[str] = []
    stack = [str(folder)]
    while stack:
        current = stack.pop()
        with os.scandir(current) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir():
                    stack.append(entry.path)
                elif os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS:
                    found.append(entry.path)
    found.sort()
    return found

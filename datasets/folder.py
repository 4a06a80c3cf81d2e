"""ImageFolderDataset: one sub-folder per class, scanned without opening images."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from ._image import IMAGE_EXTENSIONS, MAX_IMAGE_PIXELS
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
        on_bad: ``"replace"`` (default) or ``"raise"``: what a bad image does at load time
            (see :class:`~pksampler.datasets.base.LabelledDataset`).
        decode_size: decode JPEGs in Pillow's draft mode at no less than this side
            (set it to the training size; None decodes at full size).
        max_pixels: images declaring more pixels are bad images (decompression bombs).

    Entries that cannot be examined (a symlink loop, a dangling link, a folder
    reached twice through links, a FIFO or device) are left out with a warning
    naming their paths.

    Labels never move through links: every class folder (and the root and its
    parents) is registered by ``(device, inode)`` before the walk, and a
    folder link inside a class that leads to another class folder, into one,
    or to the root or a parent of it is left out with a warning naming it.
    Each class keeps exactly the images under its own folder.

    Attributes:
        labels: int64 class code per sample. classes: folder names. paths: file paths.
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None, *, seed: int = 0,
                 skip_bad: bool = False, on_bad: str = "replace", decode_size: int | None = None,
                 max_pixels: int = MAX_IMAGE_PIXELS) -> None:
        super().__init__(transform, seed=seed, on_bad=on_bad)
        self._set_decoding(decode_size, max_pixels)
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"ImageFolderDataset(root=) is not a directory: {self.root}")
        skipped: list[str] = []
        with os.scandir(self.root) as entries:
            class_dirs = sorted(entry.name for entry in entries
                                if not entry.name.startswith(".") and _is_dir(entry, skipped))
        if not class_dirs:
            raise ValueError(f"ImageFolderDataset(root=) has no class sub-folders: {self.root}")
        paths: list[str] = []
        labels: list[int] = []
        empty: list[str] = []
        seen: set[tuple[int, int]] = set()
        fences = _Fences(self.root, class_dirs)
        for code, name in enumerate(class_dirs):
            found = _scan_images(self.root / name, seen, skipped, fences=fences, owner=name)
            if not found:
                empty.append(name)
            paths.extend(found)
            labels.extend([code] * len(found))
        if not paths:
            raise ValueError(f"ImageFolderDataset(root=) has class folders but no image files ({sorted(IMAGE_EXTENSIONS)}): {self.root}")
        if skipped:
            warnings.warn(f"ImageFolderDataset: left out {len(skipped)} entr(ies) (symlink loops, dangling links, "
                          f"folders reached twice, links across class folders, non-regular files): {skipped[:5]}",
                          stacklevel=2)
        if empty:
            warnings.warn(f"ImageFolderDataset: {len(empty)} class folder(s) hold no images, e.g. {empty[:3]}", stacklevel=2)
        self.paths = paths
        self.labels = np.asarray(labels, dtype=np.int64)
        self.classes = class_dirs
        if skip_bad:
            self._drop_unreadable(f"under {self.root}")


def _is_dir(entry: os.DirEntry, skipped: list[str]) -> bool:
    """``entry.is_dir()``, recording the path instead of raising for a symlink loop (ELOOP) and the like."""
    try:
        return entry.is_dir()
    except OSError as error:
        skipped.append(f"{entry.path} ({error.strerror or error})")
        return False


class _Fences:
    """Where a class's walk must not go: other class folders, the root and its parents (by device and inode)."""

    def __init__(self, root: Path, class_dirs: list[str]) -> None:
        self.classes: dict[tuple[int, int], str] = {}
        for name in class_dirs:
            try:
                info = os.stat(root / name)
            except OSError:
                continue
            self.classes.setdefault((info.st_dev, info.st_ino), name)
        self.parents: set[tuple[int, int]] = set()
        for folder in (root.resolve(), *root.resolve().parents):
            info = os.stat(folder)
            self.parents.add((info.st_dev, info.st_ino))
        self.root_real = str(root.resolve())
        self.names = set(class_dirs)

    def refusal(self, path: str, key: tuple[int, int], owner: str, *, linked: bool) -> str | None:
        """Why the folder ``path`` (reached from class ``owner``) is not walked, or None."""
        other = self.classes.get(key)
        if other is not None and other != owner:
            return f"a link to class folder {other!r}: its images keep their own label"
        if key in self.parents:
            return "a link to the root or a parent of it: it would pull in other classes"
        if linked:
            real = os.path.realpath(path)
            inside = os.path.relpath(real, self.root_real).split(os.sep)[0]
            if inside in self.names and inside != owner and not inside.startswith(".."):
                return f"a link into class folder {inside!r}: its images keep their own label"
        return None


def _scan_images(folder: Path, seen: set[tuple[int, int]], skipped: list[str], *, fences: _Fences | None = None,
                 owner: str = "") -> list[str]:
    """Image files under ``folder``, sorted; each real folder is walked once (link cycles end)."""
    found: list[str] = []
    stack = [(str(folder), False)]
    while stack:
        current, linked = stack.pop()
        try:
            info = os.stat(current)
            key = (info.st_dev, info.st_ino)
            refusal = fences.refusal(current, key, owner, linked=linked) if fences is not None else None
            if refusal is not None:
                skipped.append(f"{current} ({refusal})")
                continue
            if key in seen:
                skipped.append(f"{current} (folder already scanned: a link cycle or duplicate)")
                continue
            seen.add(key)
            with os.scandir(current) as entries:
                for entry in entries:
                    if entry.name.startswith("."):
                        continue
                    if _is_dir(entry, skipped):
                        stack.append((entry.path, linked or entry.is_symlink()))
                    elif os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS:
                        if entry.is_symlink() and not os.path.exists(entry.path):
                            skipped.append(f"{entry.path} (dangling or looping link)")
                            continue
                        if not entry.is_file():  # a FIFO would block open() forever, a device never ends
                            skipped.append(f"{entry.path} (not a regular file: a FIFO, device or socket)")
                            continue
                        found.append(entry.path)
        except OSError as error:
            skipped.append(f"{current} ({error.strerror or error})")
    found.sort()
    return found

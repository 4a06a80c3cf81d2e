"""ListFileDataset: a CSV/TSV of ``path,label`` or the Stanford Online Products layout."""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path
from typing import Callable

import numpy as np

from ._image import MAX_IMAGE_PIXELS
from .base import ImageFileDataset

__all__ = ["ListFileDataset", "resolve_under"]


def resolve_under(root: Path, relative: str, *, where: str) -> Path:
    """``root / relative``, refusing anything that resolves outside ``root``."""
    candidate = Path(relative)
    resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
    root_resolved = root.resolve()
    if resolved != root_resolved and root_resolved not in resolved.parents:
        raise ValueError(f"{where}: path {relative!r} resolves to {resolved}, outside root {root_resolved}")
    return resolved


class ListFileDataset(ImageFileDataset):
    """Images listed in a text file.

    Accepted layouts (detected from the first line):

    * CSV or TSV with two columns ``path,label`` (a header line is optional);
    * Stanford Online Products ``Ebay_train.txt``/``Ebay_test.txt``: a header
      ``image_id class_id super_class_id path`` and space-separated rows.

    Labels may be any strings or integers; ``classes`` holds them sorted and
    ``labels`` their int64 codes. Relative paths resolve under ``root``
    (default: the list file's folder); a path that escapes ``root`` (``..``,
    an absolute path elsewhere) is refused with an error naming the line.
    The file must be UTF-8 (a leading byte-order mark is ignored); other bytes
    are an error naming the file and line. ``skip_bad``, ``on_bad``,
    ``decode_size`` and ``max_pixels`` are as in ImageFolderDataset.

    Args:
        list_file: the text file of ``path,label`` rows (or a Stanford Online Products list).
        root: the folder relative paths resolve under (default: the list file's folder).
    """

    def __init__(self, list_file: str | os.PathLike, root: str | os.PathLike | None = None,
                 transform: Callable | None = None, *, seed: int = 0, skip_bad: bool = False,
                 on_bad: str = "replace", decode_size: int | None = None,
                 max_pixels: int = MAX_IMAGE_PIXELS) -> None:
        super().__init__(transform, seed=seed, on_bad=on_bad)
        self._set_decoding(decode_size, max_pixels)
        self.list_file = Path(list_file)
        if not self.list_file.is_file():
            if self.list_file.exists():
                raise ValueError(f"ListFileDataset(list_file=) is not a regular file (a FIFO, device or folder): "
                                 f"{self.list_file}")
            raise FileNotFoundError(f"ListFileDataset(list_file=) not found: {self.list_file}")
        self.root = Path(root) if root is not None else self.list_file.parent
        if not self.root.is_dir():
            raise FileNotFoundError(f"ListFileDataset(root=) is not a directory: {self.root}")
        rows = _read_rows(self.list_file)
        paths: list[str] = []
        raw_labels: list[str] = []
        for line_number, path, label in rows:
            where = f"{self.list_file}:{line_number}"
            paths.append(str(resolve_under(self.root, path, where=where)))
            raw_labels.append(label)
        if not paths:
            raise ValueError(f"ListFileDataset(list_file=) lists no images: {self.list_file}")
        # Integers only when every label is written canonically: "010", "1_0" and "10" stay three classes.
        as_int = all(_CANONICAL_INT.fullmatch(v) for v in raw_labels)
        values = np.asarray([int(v) for v in raw_labels]) if as_int else np.asarray(raw_labels)
        classes, codes = np.unique(values, return_inverse=True)
        self.paths = paths
        self.labels = codes.astype(np.int64).reshape(-1)
        self.classes = [str(c) for c in classes]
        if skip_bad:
            self._drop_unreadable(f"listed in {self.list_file}")


_CANONICAL_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
#: characters a path or label may not hold: a newline inside quotes would silently make another path
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _check_field(list_file: Path, number: int, what: str, text: str) -> None:
    """Refuse control characters (NUL, newline, tab...) in a path or label, naming the file and line."""
    found = _CONTROL.search(text)
    if found:
        raise ValueError(f"{list_file}:{number}: the {what} {text[:80]!r} holds the control character "
                         f"{found.group()!r}; paths and labels must be single-line text without NUL")


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _read_text(list_file: Path) -> str:
    """The file as UTF-8 text without a byte-order mark; bad bytes are a ValueError naming file and line."""
    data = list_file.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise ValueError(f"{list_file}:{line}: list files must be UTF-8 text; byte {error.start} "
                         f"({data[error.start:error.start + 1]!r}) is not ({error.reason})") from None


def _read_rows(list_file: Path) -> list[tuple[int, str, str]]:
    lines = _read_text(list_file).splitlines()
    first = next((line for line in lines if line.strip()), "")
    header = first.strip().lower().split()
    if header[:4] == ["image_id", "class_id", "super_class_id", "path"]:
        rows = []
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 4:
                raise ValueError(f"{list_file}:{number}: expected 'image_id class_id super_class_id path', got {line!r}")
            _check_field(list_file, number, "path", parts[3])
            rows.append((number, parts[3], parts[1]))
        return rows
    delimiter = "\t" if "\t" in first else ","
    rows = []
    reader = csv.reader(io.StringIO("\n".join(lines)), delimiter=delimiter)
    while True:
        try:
            record = next(reader)
        except StopIteration:
            break
        except csv.Error as error:  # e.g. a field over the csv module's size limit
            raise ValueError(f"{list_file}:{reader.line_num}: not a readable CSV/TSV row ({error})") from None
        number = reader.line_num
        if not record or not "".join(record).strip():
            continue
        if len(record) != 2:
            raise ValueError(f"{list_file}:{number}: expected two columns 'path{delimiter}label', got {record!r}")
        path, label = record[0].strip(), record[1].strip()
        if number == 1 and path.lower() in ("path", "file", "filename", "image") and not _is_int(label):
            continue  # header
        if not path or not label:
            raise ValueError(f"{list_file}:{number}: empty path or label in {record!r}")
        _check_field(list_file, number, "path", path)
        _check_field(list_file, number, "label", label)
        rows.append((number, path, label))
    return rows

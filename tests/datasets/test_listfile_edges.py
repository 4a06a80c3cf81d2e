"""List-file edge cases: quoted newlines, NUL, huge fields, integer-looking labels that differ, and encodings (a
UTF-8 byte-order mark, bytes that are not UTF-8)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pksampler.datasets import ListFileDataset


def write_png(path: Path, value: int = 120, size: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size, 3), value, dtype=np.uint8)).save(path, format="PNG")


@pytest.fixture
def images(tmp_path: Path) -> Path:
    for name in ("a.png", "b.png", "c.png"):
        Image.fromarray(np.full((4, 4, 3), 9, np.uint8)).save(tmp_path / name)
    return tmp_path


def test_labels_written_differently_stay_different_classes(images):
    (images / "list.csv").write_text("a.png,1_0\nb.png,010\nc.png,10\n")
    dataset = ListFileDataset(images / "list.csv")
    assert dataset.num_classes == 3 and sorted(dataset.classes) == ["010", "10", "1_0"]
    (images / "ints.csv").write_text("a.png,10\nb.png,-2\nc.png,0\n")
    assert ListFileDataset(images / "ints.csv").classes == ["-2", "0", "10"]  # canonical integers sort as numbers


def test_a_quoted_newline_in_a_path_is_refused_naming_file_and_line(images):
    (images / "list.csv").write_text('a.png,x\n"b.png\nc.png",y\n')
    with pytest.raises(ValueError, match=r"list.csv:3: the path 'b.png\\nc.png' holds the control character '\\n'"):
        ListFileDataset(images / "list.csv")


def test_a_nul_in_a_path_is_refused_naming_file_and_line(images):
    (images / "list.csv").write_text("a.png,x\nb\0.png,y\n")
    with pytest.raises(ValueError, match=r"list.csv:2: the path 'b\\x00.png' holds the control character '\\x00'"):
        ListFileDataset(images / "list.csv")
    (images / "sop.txt").write_text("image_id class_id super_class_id path\n1 1 1 a.png\n2 1 1 b\0.png\n")
    with pytest.raises(ValueError, match=r"sop.txt:3: the path 'b\\x00.png' holds the control character"):
        ListFileDataset(images / "sop.txt")


def test_a_field_over_the_csv_limit_is_one_error_naming_file_and_line(images):
    (images / "list.csv").write_text("a.png,x\n\"" + "d" * 200_000 + "\",y\n")
    with pytest.raises(ValueError, match=r"list.csv:2: not a readable CSV/TSV row \(field larger than field limit"):
        ListFileDataset(images / "list.csv")


def test_list_file_utf8_bom_header_is_skipped(tmp_path):
    write_png(tmp_path / "a.png")
    listing = tmp_path / "list.csv"
    listing.write_bytes("\ufeffpath,label\na.png,cat\n".encode("utf-8"))
    dataset = ListFileDataset(listing)
    assert dataset.classes == ["cat"] and len(dataset) == 1


def test_list_file_not_utf8_names_file_and_line(tmp_path):
    write_png(tmp_path / "a.png")
    listing = tmp_path / "latin1.csv"
    listing.write_bytes("a.png,1\na.png,caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.csv:2: list files must be UTF-8") as caught:
        ListFileDataset(listing)
    assert not isinstance(caught.value, UnicodeDecodeError)

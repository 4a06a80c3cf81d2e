"""List-file edge cases: quoted newlines, NUL, huge fields, and integer-looking labels that differ."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pksampler.datasets import ListFileDataset


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

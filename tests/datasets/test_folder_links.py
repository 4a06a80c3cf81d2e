"""Folder links never move images between classes: class folders are registered before the walk; symlink loops are
skipped with their paths."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pksampler.datasets import ImageFolderDataset


def write_png(path: Path, value: int = 120, size: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size, 3), value, dtype=np.uint8)).save(path, format="PNG")


def write_pngs(folder: Path, count: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.fromarray(np.full((8, 8, 3), 30 * i, np.uint8)).save(folder / f"{i}.png")


def scan(root: Path) -> tuple[ImageFolderDataset, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = ImageFolderDataset(root)
    return dataset, " ".join(str(w.message) for w in caught)


def counts(dataset: ImageFolderDataset) -> dict[str, int]:
    return {name: int((dataset.labels == code).sum()) for code, name in enumerate(dataset.classes)}


def test_a_link_to_another_class_folder_does_not_relabel_it(tmp_path):
    write_pngs(tmp_path / "cats", 2)
    write_pngs(tmp_path / "kittens", 3)
    (tmp_path / "cats" / "more").symlink_to("../kittens")
    dataset, warning = scan(tmp_path)
    assert counts(dataset) == {"cats": 2, "kittens": 3}
    assert all("/kittens/" in p or "/cats/more" not in p for p in dataset.paths)
    assert f"{tmp_path / 'cats' / 'more'} (a link to class folder 'kittens': its images keep their own label)" in warning


def test_a_link_into_a_later_class_folder_does_not_take_its_images(tmp_path):
    write_pngs(tmp_path / "apes", 1)
    write_pngs(tmp_path / "zebras" / "young", 2)
    (tmp_path / "apes" / "borrowed").symlink_to("../zebras/young")
    dataset, warning = scan(tmp_path)
    assert counts(dataset) == {"apes": 1, "zebras": 2}
    assert f"{tmp_path / 'apes' / 'borrowed'} (a link into class folder 'zebras'" in warning


def test_a_link_to_the_root_or_a_parent_absorbs_nothing(tmp_path):
    root = tmp_path / "R"
    write_pngs(root / "b_birds", 2)
    write_pngs(root / "c_cows", 3)
    (root / "a_links").mkdir()
    (root / "a_links" / "up").symlink_to("..")
    (root / "a_links" / "upper").symlink_to("../..")
    dataset, warning = scan(root)
    assert counts(dataset) == {"a_links": 0, "b_birds": 2, "c_cows": 3}
    assert f"{root / 'a_links' / 'up'} (a link to the root or a parent of it" in warning
    assert f"{root / 'a_links' / 'upper'} (a link to the root or a parent of it" in warning


def test_a_link_inside_a_class_or_to_a_folder_outside_the_root_still_counts(tmp_path):
    root = tmp_path / "R"
    write_pngs(root / "cats" / "indoor", 2)
    write_pngs(tmp_path / "elsewhere", 2)
    (root / "cats" / "alias").symlink_to("indoor")  # the same real folder twice: walked once
    (root / "cats" / "external").symlink_to(tmp_path / "elsewhere")
    dataset, _ = scan(root)
    assert counts(dataset) == {"cats": 4}


def test_symlink_loops_in_class_folders_are_skipped_with_the_path(tmp_path):
    root = tmp_path / "data"
    write_png(root / "a" / "0.png")
    write_png(root / "b" / "0.png")
    os.symlink("loop.png", root / "a" / "loop.png")  # a link to itself: ELOOP
    os.symlink("..", root / "b" / "up")  # a folder cycle through the parent
    with pytest.warns(UserWarning, match=r"symlink loop.*loop\.png") as caught:
        dataset = ImageFolderDataset(root)
    message = str(caught[0].message)
    assert "up" in message
    assert sorted(Path(p).relative_to(root).as_posix() for p in dataset.paths) == ["a/0.png", "b/0.png"]

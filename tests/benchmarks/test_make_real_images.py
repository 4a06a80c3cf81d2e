"""The real-photo benchmark set: bundled photos only, deterministic, an image folder the trainer reads."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("skimage")  # a dev extra; the set is built from its bundled photos
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "sets"))
from make_real_images import make_real_images, set_is_complete  # noqa: E402

from pksampler.datasets import ImageFolderDataset  # noqa: E402


def _digest(folder: Path) -> str:
    files = sorted(p for p in folder.rglob("*.jpg"))
    return hashlib.sha256(b"".join(p.relative_to(folder).as_posix().encode() + p.read_bytes() for p in files)).hexdigest()


def test_set_is_an_image_folder_deterministic_from_the_seed(tmp_path):
    first = make_real_images(tmp_path / "a", classes=6, views=3, size=24, seed=1)
    again = make_real_images(tmp_path / "b", classes=6, views=3, size=24, seed=1)
    other = make_real_images(tmp_path / "c", classes=6, views=3, size=24, seed=2)
    assert _digest(first) == _digest(again) != _digest(other)
    dataset = ImageFolderDataset(first)
    assert dataset.num_classes == 6 and len(dataset) == 18
    image = dataset.load(0)
    assert image.size == (24, 24) and image.mode == "RGB"
    # Views of one class differ (random warps), and classes come from several photos.
    assert not np.array_equal(np.asarray(dataset.load(0)), np.asarray(dataset.load(1)))
    assert len({name.rsplit("_", 2)[0] for name in dataset.classes}) == 6


def test_manifest_marks_a_finished_set_with_its_parameters(tmp_path):
    out = make_real_images(tmp_path / "set", classes=3, views=2, size=16, seed=0)
    assert set_is_complete(out, 3, 2, 16, 0)
    assert not set_is_complete(out, 3, 2, 16, 1)
    (out / "manifest.json").unlink()
    assert not set_is_complete(out, 3, 2, 16, 0)


def test_bad_sizes_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match=r"make_real_images\(views=\) must be an integer >= 2, got 1"):
        make_real_images(tmp_path, classes=3, views=1)
    with pytest.raises(ValueError, match=r"asks for 100000 classes"):
        make_real_images(tmp_path, classes=100_000)

"""The typeface benchmark set: CJK characters in several typefaces, written as an image folder, deterministic."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "sets"))
from make_typeface_images import MANIFEST, TYPEFACES, make_typeface_images  # noqa: E402

from pksampler.datasets import ImageFolderDataset  # noqa: E402

# Three designs unlike each other (sans, brush script, serif); fonts come with scripts/setup.sh.
FACES = ("noto_sans", "ukai", "noto_serif")


def _digest(folder: Path) -> str:
    files = sorted(folder.rglob("*.jpg"))
    return hashlib.sha256(b"".join(p.relative_to(folder).as_posix().encode() + p.read_bytes() for p in files)).hexdigest()


def test_writes_one_folder_per_character_with_one_capture_per_typeface(tmp_path):
    out = make_typeface_images(tmp_path / "set", classes=4, size=32, seed=3, typefaces=FACES, min_faces=3,
                               install=False)
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    assert len(folders) == 4
    for folder in folders:
        code = int(folder.name[1:], 16)
        assert folder.name.startswith("u") and 0x3400 <= code <= 0x9FFF  # a CJK ideograph's code point
        assert sorted(p.name for p in folder.iterdir()) == sorted(f"{face}_0.jpg" for face in FACES)
        for path in folder.iterdir():
            with Image.open(path) as image:
                assert image.format == "JPEG" and image.size == (32, 32)
                image.load()
    dataset = ImageFolderDataset(out)
    assert dataset.num_classes == 4 and len(dataset) == 12
    assert sorted(dataset.classes) == [p.name for p in folders]
    np.testing.assert_array_equal(np.bincount(dataset.labels), [3, 3, 3, 3])
    manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    assert manifest["characters"] == 4 and manifest["images"] == 12
    assert [face["key"] for face in manifest["typefaces"]] == [k for k in TYPEFACES if k in FACES]


def test_same_seed_same_files_and_another_seed_others(tmp_path):
    args = dict(classes=3, size=24, typefaces=FACES, min_faces=3, install=False)
    first = make_typeface_images(tmp_path / "a", seed=1, **args)
    again = make_typeface_images(tmp_path / "b", seed=1, **args)
    other = make_typeface_images(tmp_path / "c", seed=2, **args)
    assert _digest(first) == _digest(again) != _digest(other)
    # The captures of one character differ (typeface and camera), and differ from a blank page.
    images = [np.asarray(Image.open(p), dtype=np.float32) for p in sorted(first.glob("*/*.jpg"))]
    assert all(image.std() > 10 for image in images)
    assert not np.array_equal(images[0], images[1])


def test_rebuilding_with_other_parameters_leaves_no_stale_images(tmp_path):
    out = tmp_path / "set"
    make_typeface_images(out, classes=3, size=24, seed=0, typefaces=FACES, min_faces=3, views_per_face=2,
                         install=False)
    assert len(list(out.glob("*/*.jpg"))) == 18
    make_typeface_images(out, classes=2, size=24, seed=5, typefaces=FACES, min_faces=3, install=False)
    assert len(list(out.glob("*/*.jpg"))) == 6 and len([p for p in out.iterdir() if p.is_dir()]) == 2


def test_bad_arguments_name_themselves(tmp_path):
    with pytest.raises(ValueError, match=r"classes=\) must be an integer >= 2, got 1"):
        make_typeface_images(tmp_path, classes=1, install=False)
    with pytest.raises(ValueError, match=r"typefaces= names unknown faces \['comic'\]"):
        make_typeface_images(tmp_path, classes=2, typefaces=("comic",), min_faces=1, install=False)

"""Image decoding (datasets/_image.py): deep grayscale scaled, decompression bombs refused as bad images, draft
decoding that keeps the requested side, and decoding arguments that name their rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pksampler.datasets import ImageFolderDataset, ImageLoadError, load_rgb


def write_png(path: Path, value: int = 120, size: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size, 3), value, dtype=np.uint8)).save(path, format="PNG")


# --- 16-bit grayscale ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["I;16", "I"])
def test_deep_grayscale_is_scaled_not_clipped(tmp_path, mode):
    ramp = np.linspace(0, 65535, 64, dtype=np.float64).reshape(8, 8)
    if mode == "I;16":
        image = Image.fromarray(ramp.astype(np.uint16))
    else:
        image = Image.fromarray(ramp.astype(np.int32))
    assert image.mode == mode
    path = tmp_path / ("deep16.png" if mode == "I;16" else "deep32.tif")  # Pillow writes mode I as TIFF only
    image.save(path)
    with Image.open(path) as reopened:
        assert reopened.mode in ("I;16", "I")
    rgb = np.asarray(load_rgb(path))
    assert rgb.dtype == np.uint8 and rgb.shape == (8, 8, 3)
    expected = np.rint(ramp / 257.0).astype(np.uint8)
    assert np.array_equal(rgb[..., 0], expected)
    assert len(np.unique(rgb)) > 32  # a ramp, not black and white
    assert rgb[0, 0, 0] == 0 and rgb[-1, -1, 0] == 255


# --- decompression bombs --------------------------------------------------------------------------

def test_bomb_is_a_bad_image_with_configurable_limit(tmp_path):
    path = tmp_path / "bomb" / "a" / "big.png"
    path.parent.mkdir(parents=True)
    Image.new("L", (400, 300)).save(path)  # a few hundred bytes, 120 000 pixels
    write_png(tmp_path / "bomb" / "a" / "ok.png")
    with pytest.raises(ImageLoadError, match=r"big.png: 400x300 = 120000 pixels exceeds the limit max_pixels=100000"):
        load_rgb(path, max_pixels=100_000)
    assert load_rgb(path, max_pixels=120_000).size == (400, 300)
    with pytest.warns(UserWarning, match="skipped 1 unreadable"):
        dataset = ImageFolderDataset(tmp_path / "bomb", skip_bad=True, max_pixels=100_000)
    assert [Path(p).name for p in dataset.paths] == ["ok.png"]


def test_pillow_decompression_bomb_error_is_an_image_load_error(tmp_path, monkeypatch):
    path = tmp_path / "big.png"
    Image.new("L", (300, 300)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)  # Pillow raises above twice this
    with pytest.raises(ImageLoadError, match="big.png"):
        load_rgb(path, max_pixels=10**9)


def test_bad_arguments_name_the_rule(tmp_path):
    with pytest.raises(ValueError, match=r"max_pixels=\) must be a positive int, got 0"):
        load_rgb(tmp_path / "x.png", max_pixels=0)
    write_png(tmp_path / "d" / "a" / "x.png")
    with pytest.raises(ValueError, match=r"decode_size=\) must be a positive int or None, got -3"):
        ImageFolderDataset(tmp_path / "d", decode_size=-3)
    with pytest.raises(ValueError, match=r"on_bad=\) must be one of .*got 'skip'"):
        ImageFolderDataset(tmp_path / "d", on_bad="skip")
    from pksampler.datasets import ShardedDataset

    with pytest.raises(ValueError, match=r"ShardedDataset\(max_pixels=\) must be a positive int, got True"):
        ShardedDataset(tmp_path / "d", max_pixels=True)


# --- draft decoding --------------------------------------------------------------------------------

def test_draft_decoding_keeps_at_least_the_requested_side(tmp_path):
    path = tmp_path / "large.jpg"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)).save(path, quality=90)
    full = load_rgb(path)
    drafted = load_rgb(path, draft_size=100)
    assert full.size == (640, 480)
    assert drafted.size == (160, 120)  # DCT scale 1/4: the smallest with both sides >= 100
    assert load_rgb(path, draft_size=300).size == (640, 480)  # 1/2 would give 240 < 300
    png = tmp_path / "large.png"
    Image.open(path).save(png)
    assert load_rgb(png, draft_size=100).size == (640, 480)  # not a JPEG: draft does nothing

"""Dataset input hardening: deep grayscale, decompression bombs, list-file encodings, symlink loops,
bad images during training (replacement, log line, shared counts), subset indexing, synthetic writes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import DataLoader

from pksampler.datasets import (
    ImageFolderDataset,
    ImageLoadError,
    LabelledSubset,
    ListFileDataset,
    SyntheticProducts,
    load_rgb,
)
from pksampler.datasets import synthetic as synthetic_module


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


# --- list files ---------------------------------------------------------------------------------

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


# --- symlink loops ---------------------------------------------------------------------------------

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


# --- bad images during training --------------------------------------------------------------------

@pytest.fixture
def folder_with_bad(tmp_path):
    root = tmp_path / "data"
    for c, name in enumerate(["a", "b", "c"]):
        for i in range(4):
            write_png(root / name / f"{i}.png", value=40 * c + 10 * i)
    bad = root / "b" / "1.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n broken")
    return root, bad


def test_bad_image_replaced_within_class_deterministically(folder_with_bad, capfd):
    root, bad = folder_with_bad
    dataset = ImageFolderDataset(root)
    index = dataset.paths.index(str(bad))
    image, label = dataset[index]
    assert label == dataset.labels[index] == 1
    value = int(np.asarray(image)[0, 0, 0])
    members = {40 + 10 * i for i in (0, 2, 3)}
    assert value in members  # another image of class "b"
    again, _ = dataset[index]
    assert np.array_equal(np.asarray(again), np.asarray(image))  # keyed by (seed, epoch, index)
    other = ImageFolderDataset(root)
    choices = set()
    for epoch in range(12):
        other.set_epoch(epoch)
        choices.add(int(np.asarray(other[index][0])[0, 0, 0]))
    assert choices <= members and len(choices) > 1  # the key includes the epoch
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "bad image" in line]
    assert len(lines) == 2 and str(bad) in lines[0] and "cannot decode" in lines[0]  # once per dataset object
    assert dataset.bad_image_counts() == (2, 2)
    dataset.set_epoch(1)
    assert dataset.bad_image_counts() == (0, 0)


def test_bad_image_raise_policy_and_no_replacement_left(folder_with_bad):
    root, bad = folder_with_bad
    dataset = ImageFolderDataset(root, on_bad="raise")
    with pytest.raises(ImageLoadError, match="1.png"):
        dataset[dataset.paths.index(str(bad))]
    for i in range(4):
        (root / "c" / f"{i}.png").write_bytes(b"junk")
    dataset = ImageFolderDataset(root)
    with pytest.raises(ImageLoadError, match=r"no loadable replacement among 3 other member\(s\) of class 2"):
        dataset[8]


def test_bad_image_counts_shared_across_workers_and_through_subset(folder_with_bad):
    root, bad = folder_with_bad
    dataset = ImageFolderDataset(root)
    index = dataset.paths.index(str(bad))
    subset = LabelledSubset(dataset, np.arange(len(dataset)))
    for view in (dataset, subset):
        loader = DataLoader(view, batch_size=3, num_workers=2, collate_fn=lambda batch: [y for _, y in batch])
        labels = [y for batch in loader for y in batch]
        assert labels == dataset.labels.tolist()  # shapes and labels kept
        assert view.bad_image_counts() == (1, len(dataset))
    assert subset.dataset.bad_image_counts() == (1, len(dataset))  # the parent's own counts are separate
    subset.set_epoch(3)
    assert subset.bad_image_counts() == (0, 0)
    position = int(np.flatnonzero(subset.indices == index)[0])
    assert subset[position][1] == 1 and subset.bad_image_counts() == (1, 1)


def test_subset_indices_follow_the_parent_rule():
    dataset = SyntheticProducts(3, 2, image_size=16)
    subset = LabelledSubset(dataset, [1, 4, 5])
    assert subset[-1][1] == subset[2][1] == 2
    with pytest.raises(IndexError, match="index 3 out of range for 3 samples"):
        subset[3]
    with pytest.raises(IndexError, match="index -4 out of range"):
        subset[-4]
    with pytest.raises(IndexError):
        dataset[len(dataset)]


# --- synthetic ---------------------------------------------------------------------------------------

def test_synthetic_writes_through_pksampler_files(tmp_path, monkeypatch):
    calls = []
    original = synthetic_module.atomic_writer

    def spy(path):
        calls.append(Path(path))
        return original(path)

    monkeypatch.setattr(synthetic_module, "atomic_writer", spy)
    SyntheticProducts(2, 2, image_size=16, root=tmp_path / "s")
    assert len(calls) == 4 and all(p.suffix == ".png" and p.is_file() for p in calls)
    assert not list((tmp_path / "s").rglob("*.tmp"))
    assert not hasattr(SyntheticProducts(2, 2), "num_products")


def test_synthetic_renders_in_memory_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dataset = SyntheticProducts(3, 2, image_size=32)
    assert dataset.root is None
    assert np.asarray(dataset[0][0]).shape == (32, 32, 3)
    assert list(tmp_path.iterdir()) == []

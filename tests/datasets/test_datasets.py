"""Datasets: real files on disk decoded by Pillow, labels without decoding, transforms, splits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image
from torch.utils.data import DataLoader

from pksampler import DistributedBalancedSampler
from pksampler.datasets import (
    ImageFolderDataset,
    ImageLoadError,
    LabelledSubset,
    ListFileDataset,
    SyntheticProducts,
    class_disjoint_split,
    eval_preset,
    train_preset,
)
from pksampler.datasets import synthetic as synthetic_module


def write_image(path: Path, colour: tuple[int, int, int], fmt: str, size: int = 20) -> np.ndarray:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(sum(colour))
    array = (np.array(colour, dtype=np.int16) + rng.integers(-5, 6, (size, size, 3))).clip(0, 255).astype(np.uint8)
    Image.fromarray(array).save(path, format=fmt)
    return array


@pytest.fixture
def folder(tmp_path):
    """Three classes of PNG and JPEG files, one nested, one non-image file."""
    arrays = {}
    for c, name in enumerate(["bottle", "cup", "shoe"]):
        for i in range(4):
            fmt, ext = ("PNG", "png") if i % 2 else ("JPEG", "jpg")
            sub = "nested/" if (c, i) == (2, 3) else ""
            path = tmp_path / "data" / name / f"{sub}{i}.{ext}"
            arrays[str(path)] = write_image(path, (40 * c, 100, 200 - 30 * i), fmt)
    (tmp_path / "data" / "cup" / "notes.txt").write_text("not an image")
    return tmp_path / "data", arrays


def test_image_folder_labels_without_opening_images(folder, monkeypatch):
    root, arrays = folder

    def refuse(*args, **kwargs):
        raise AssertionError("an image was opened while scanning")

    monkeypatch.setattr(Image, "open", refuse)
    dataset = ImageFolderDataset(root)
    assert dataset.classes == ["bottle", "cup", "shoe"]
    assert dataset.labels.dtype == np.int64
    assert dataset.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert any("nested" in p for p in dataset.paths)
    DistributedBalancedSampler(dataset, 2, 2, num_replicas=1, rank=0)  # labels reach the sampler, nothing decoded


def test_decode_round_trip_png_exact_jpeg_close(folder):
    root, arrays = folder
    dataset = ImageFolderDataset(root)
    for index, path in enumerate(dataset.paths):
        image, label = dataset[index]
        decoded = np.asarray(image)
        if path.endswith(".png"):
            assert np.array_equal(decoded, arrays[path])
        else:
            assert np.abs(decoded.astype(int) - arrays[path]).mean() < 6
        assert label == dataset.labels[index]


def test_corrupt_file_error_names_path_and_skip_option_counts(folder):
    root, _ = folder
    bad = root / "cup" / "9.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    dataset = ImageFolderDataset(root, on_bad="raise")
    index = dataset.paths.index(str(bad))
    with pytest.raises(ImageLoadError, match="9.png"):
        dataset[index]
    with pytest.warns(UserWarning, match="skipped 1 unreadable"):
        cleaned = ImageFolderDataset(root, skip_bad=True)
    assert str(bad) not in cleaned.paths and len(cleaned) == len(dataset) - 1


def test_missing_root_and_empty_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        ImageFolderDataset(tmp_path / "nope")
    with pytest.raises(ValueError, match="no class sub-folders"):
        ImageFolderDataset(tmp_path)
    (tmp_path / "empty_class").mkdir()
    with pytest.raises(ValueError, match="no image files"):
        ImageFolderDataset(tmp_path)


def test_list_file_csv_tsv_and_sop_layouts(folder):
    root, _ = folder
    csv_file = root / "list.csv"
    csv_file.write_text("path,label\nbottle/0.jpg,b\ncup/1.png,c\nshoe/2.jpg,b\n")
    dataset = ListFileDataset(csv_file)
    assert dataset.classes == ["b", "c"] and dataset.labels.tolist() == [0, 1, 0]
    assert np.asarray(dataset[1][0]).shape == (20, 20, 3)
    tsv_file = root / "list.tsv"
    tsv_file.write_text("bottle/0.jpg\t7\ncup/1.png\t3\n")
    assert ListFileDataset(tsv_file).labels.tolist() == [1, 0]
    sop = root / "Ebay_train.txt"
    sop.write_text("image_id class_id super_class_id path\n1 5 1 bottle/0.jpg\n2 5 1 bottle/1.png\n3 9 2 cup/0.jpg\n")
    dataset = ListFileDataset(sop, root=root)
    assert dataset.labels.tolist() == [0, 0, 1] and dataset.classes == ["5", "9"]


@pytest.mark.parametrize("escape", ["../outside.png", "/etc/passwd", "cup/../../x.png"])
def test_list_file_refuses_paths_outside_root(folder, escape):
    root, _ = folder
    listing = root / "bad.csv"
    listing.write_text(f"bottle/0.jpg,1\n{escape},2\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: path .* outside root"):
        ListFileDataset(listing)


def test_list_file_bad_rows(folder):
    root, _ = folder
    listing = root / "three.csv"
    listing.write_text("a.png,1,extra\n")
    with pytest.raises(ValueError, match=r"three.csv:1: expected two columns"):
        ListFileDataset(listing)


def test_synthetic_is_deterministic_and_written_files_match(tmp_path):
    a = SyntheticProducts(5, 3, image_size=32, seed=4)
    b = SyntheticProducts(5, 3, image_size=32, seed=4)
    other = SyntheticProducts(5, 3, image_size=32, seed=5)
    assert all(np.array_equal(np.asarray(a.load(i)), np.asarray(b.load(i))) for i in range(15))
    assert not np.array_equal(np.asarray(a.load(0)), np.asarray(other.load(0)))
    assert not np.array_equal(np.asarray(a.load(0)), np.asarray(a.load(1)))  # views differ
    on_disk = SyntheticProducts(5, 3, image_size=32, seed=4, root=tmp_path / "synthetic")
    files = sorted((tmp_path / "synthetic").rglob("*.png"))
    assert len(files) == 15 and all(tmp_path / "synthetic" in f.parents for f in files)
    folder = ImageFolderDataset(tmp_path / "synthetic")
    assert np.array_equal(folder.labels, on_disk.labels)
    for i in (0, 7, 14):
        assert np.array_equal(np.asarray(folder[i][0]), np.asarray(a.load(i)))


def test_synthetic_bad_arguments():
    with pytest.raises(ValueError, match=r"num_classes=\) must be an int >= 1, got 0"):
        SyntheticProducts(0, 3)
    with pytest.raises(ValueError, match=r"image_size=\) must be an int >= 8"):
        SyntheticProducts(2, 3, image_size=4)


def test_augmentation_keyed_by_seed_epoch_index():
    dataset = SyntheticProducts(4, 4, image_size=32, transform=train_preset(24))
    first = dataset[5][0]
    torch.manual_seed(123)
    np.random.seed(123)
    assert torch.equal(dataset[5][0], first)  # global RNGs play no part
    dataset.set_epoch(1)
    assert not torch.equal(dataset[5][0], first)
    dataset.set_epoch(0)
    subset = LabelledSubset(dataset, [5, 9])
    assert torch.equal(subset[0][0], first)  # same sample index -> same augmentation
    assert first.shape == (3, 24, 24) and first.dtype == torch.float32
    assert eval_preset(24)(dataset.load(5), None).shape == (3, 24, 24)


def test_dataloader_workers_match_single_process():
    dataset = SyntheticProducts(6, 4, image_size=32, transform=train_preset(24))
    dataset.set_epoch(2)
    sampler = DistributedBalancedSampler(dataset, 3, 2, num_replicas=1, rank=0)
    batches = []
    for workers in (0, 2):
        loader = DataLoader(dataset, sampler=sampler, batch_size=sampler.batch_size, num_workers=workers)
        batches.append([(x.clone(), y.clone()) for x, y in loader])
    assert len(batches[0]) == len(batches[1]) == sampler.num_batches
    for (x0, y0), (x2, y2) in zip(*batches):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)


@given(st.lists(st.integers(0, 30), min_size=2, max_size=300), st.floats(0.05, 0.95), st.integers(0, 100))
def test_class_disjoint_split_property(labels, fraction, seed):
    labels = np.asarray(labels)
    if np.unique(labels).size < 2:
        with pytest.raises(ValueError, match="at least 2 classes"):
            class_disjoint_split(labels, fraction, seed)
        return
    train, test = class_disjoint_split(labels, fraction, seed)
    assert train.size and test.size
    assert np.intersect1d(labels[train], labels[test]).size == 0
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(labels.size))
    again = class_disjoint_split(labels, fraction, seed)
    assert np.array_equal(again[0], train)


def test_split_bad_fraction():
    with pytest.raises(ValueError, match=r"test_fraction=\) must be in \(0, 1\), got 1.5"):
        class_disjoint_split([0, 1, 2], 1.5)


def test_normalize_equals_the_torch_formula_and_keeps_dtype():
    from pksampler.datasets.transforms import Normalize

    tensor = torch.rand(3, 17, 9, generator=torch.Generator().manual_seed(0))
    normalize = Normalize()
    mean = torch.tensor(normalize.mean)[:, None, None]
    std = torch.tensor(normalize.std)[:, None, None]
    out = normalize(tensor, None)
    assert out.dtype == torch.float32 and torch.equal(out, (tensor - mean) / std)


def test_split_uses_dense_class_codes_as_they_are():
    from pksampler.datasets.split import _class_codes

    rng = np.random.default_rng(0)
    for labels in (rng.integers(0, 50, 1000), rng.integers(5, 7, 10), np.array([3, 3, 9, 1]),
                   rng.integers(0, 10**6, 100), np.array(["b", "a", "b"])):
        classes, codes = _class_codes(labels)
        reference = np.unique(labels, return_inverse=True)
        np.testing.assert_array_equal(classes, reference[0])
        np.testing.assert_array_equal(codes, reference[1])


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

"""LabelledDataset and LabelledSubset (datasets/base.py): the bad-image policy, subset indexing, and what the
trainer asks a dataset, declared with defaults that do nothing.

Bad images during training are replaced by another member of the class, keyed
by (seed, epoch, index), named once on stderr and counted across workers; with
``on_bad="raise"`` they propagate. A local dataset answers "no object store, nothing to prefetch, no shards,
nothing to verify, fork the workers"; a packed shard set answers with its own;
a subset answers with its parent's (its own rows of them). The trainer calls
these instead of probing with ``hasattr``/``getattr`` (checked on its source).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from launch import ROOT
from PIL import Image
from torch.utils.data import DataLoader

from pksampler.datasets import ImageFolderDataset, ImageLoadError, LabelledSubset, ShardedDataset, SyntheticProducts
from pksampler.datasets.pack import pack
from pksampler.datasets.sharded import INDEX_FILE
from pksampler.train.builders import shard_ids_of
from pksampler.train.runtime.loader import KeyedSamples, worker_context


def write_png(path: Path, value: int = 120, size: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size, 3), value, dtype=np.uint8)).save(path, format="PNG")


CAPABILITIES = ("prefetch", "shard_ids", "store", "verify", "verifiable", "indices", "epoch", "bad_image_counts")


def grey_source(root: Path, classes: int = 4, per_class: int = 5) -> None:
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(np.full((8, 8, 3), 10 * c + i, np.uint8)).save(root / f"c{c}" / f"{i}.png")


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    source = tmp_path_factory.mktemp("capabilities-src")
    grey_source(source)
    out = tmp_path_factory.mktemp("capabilities-shards") / "shards"
    pack(source, out, shard_size="2KiB")
    return source, out


def test_a_local_dataset_has_every_capability_as_a_no_op(packed):
    for dataset in (SyntheticProducts(3, 2, image_size=16), ImageFolderDataset(packed[0])):
        assert dataset.store is None and dataset.worker_start_method is None
        assert dataset.shard_ids is None and shard_ids_of(dataset) is None
        assert dataset.verifiable is False and dataset.verify() is None
        assert dataset.prefetch([0, 1]) is None
        assert dataset.augmentation_key(1) == 1
        subset = LabelledSubset(dataset, [1, 0])
        assert subset.store is None and subset.shard_ids is None and subset.verifiable is False
        subset.prefetch([0, 1])
        assert worker_context(subset, 2) is None


def test_a_subset_of_a_shard_set_answers_with_its_parents_rows(packed):
    dataset = ShardedDataset(packed[1])
    assert dataset.verifiable and dataset.store is None and dataset.worker_start_method is None
    assert len(np.unique(dataset.shard_ids)) > 1, "the test needs several shards"
    subset = LabelledSubset(dataset, np.arange(3, len(dataset))[::-1])
    np.testing.assert_array_equal(subset.shard_ids, dataset.shard_ids[3:][::-1])
    np.testing.assert_array_equal(shard_ids_of(subset), subset.shard_ids)
    assert subset.verifiable and subset.augmentation_key(0) == len(dataset) - 1
    keyed = KeyedSamples(subset)
    assert keyed.key(0) == len(dataset) - 1 and keyed.key(len(subset)) == len(dataset) - 1  # wraps like indexing
    subset.verify()  # the parent's full check, clean


def test_a_subset_verifies_through_its_parent(packed, tmp_path):
    import shutil

    copy = tmp_path / "shards"
    shutil.copytree(packed[1], copy)
    dataset = ShardedDataset(copy)
    index = copy / INDEX_FILE
    data = bytearray(index.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte of the index: its full digest no longer matches the manifest's
    index.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(str(index))):
        LabelledSubset(dataset, [0, 1]).verify(shards=False)


def test_an_object_store_spawns_the_workers_of_any_subset():
    class Remote(SyntheticProducts):
        store = object()  # stands for an ObjectStore: its client cannot run in a forked worker

    dataset = Remote(3, 2, image_size=16)
    nested = LabelledSubset(LabelledSubset(dataset, [0, 1, 2]), [1])
    assert dataset.worker_start_method == "spawn" and nested.worker_start_method == "spawn"
    assert nested.store is dataset.store
    assert worker_context(nested, 1) == "spawn" and worker_context(nested, 0) is None


def test_the_trainer_calls_the_capabilities_instead_of_probing_for_them():
    pattern = re.compile(r"""(?:hasattr|getattr)\([^,]+,\s*["'](%s)["']""" % "|".join(CAPABILITIES))
    probes = {str(path.relative_to(ROOT)): pattern.findall(path.read_text(encoding="utf-8"))
              for folder in ("train", "datasets") for path in (ROOT / folder).rglob("*.py")}
    assert not {path: found for path, found in probes.items() if found}


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


def test_a_subsets_bad_image_is_replaced_by_a_member_of_the_subset(folder_with_bad):
    """A subset (the training images, data.heldout_images held out) replaced a bad image by any member of its class
    in the parent: a held-out query was trained on, and a continued run imprinted a new class's row from it."""
    root, bad = folder_with_bad
    dataset = ImageFolderDataset(root)
    index = dataset.paths.index(str(bad))
    held = [dataset.paths.index(str(root / "b" / f"{i}.png")) for i in (0, 2)]  # held out: not the subset's
    training = LabelledSubset(dataset, [i for i in range(len(dataset)) if i not in held])
    position = int(np.flatnonzero(training.indices == index)[0])
    choices = set()
    for epoch in range(12):
        training.set_epoch(epoch)
        choices.add(int(np.asarray(training[position][0])[0, 0, 0]))
    assert choices == {40 + 10 * 3}  # the one other training image of class "b"
    alone = LabelledSubset(dataset, [0, index])  # no other member of class "b" in the subset: nothing to use
    alone.set_epoch(0)
    with pytest.raises(ImageLoadError, match=r"no loadable replacement among 0 other member\(s\) of class 1"):
        alone[1]


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


class _ShardsAsAttribute(SyntheticProducts):
    """A user's dataset written before the capability defaults: it stores its shard ids as a plain attribute."""

    def __init__(self) -> None:
        super().__init__(3, 4, image_size=16)
        self.shard_ids = np.arange(len(self), dtype=np.int64) // 4


def test_a_dataset_that_assigns_its_shard_ids_keeps_working():
    dataset = _ShardsAsAttribute()  # the base's default must not be a read-only property
    assert shard_ids_of(dataset).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    subset = LabelledSubset(dataset, [9, 2])
    assert shard_ids_of(subset).tolist() == [2, 0]
    assert SyntheticProducts(3, 4, image_size=16).shard_ids is None  # the default is unchanged

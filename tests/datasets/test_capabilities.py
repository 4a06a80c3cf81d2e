"""What the trainer asks a dataset is declared on LabelledDataset, with defaults that do nothing.

A local dataset answers "no object store, nothing to prefetch, no shards,
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

from pksampler.datasets import ImageFolderDataset, LabelledSubset, ShardedDataset, SyntheticProducts
from pksampler.datasets.pack import pack
from pksampler.datasets.sharded import INDEX_FILE
from pksampler.train.builders import shard_ids_of
from pksampler.train.runtime.loader import KeyedSamples, worker_context

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

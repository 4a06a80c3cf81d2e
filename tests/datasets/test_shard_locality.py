"""A packed folder feeds the shard-local plan: shard ids from index.npy alone, visits read adjacent samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pksampler.datasets import ShardedDataset
from pksampler.datasets.base import LabelledSubset
from pksampler.datasets.pack import pack
from pksampler.samplers import DistributedBalancedBatchSampler
from pksampler.samplers.shard_plan import visits_of
from pksampler.train.builders import build_sampler, shard_ids_of
from pksampler.train.config.load import load_config
from pksampler.train.errors import ConfigError


def colour_source(root: Path, classes: int = 12, per_class: int = 6) -> None:
    """Class c, image i: a flat PNG of grey level 10 * c + i, so a decoded pixel names its sample."""
    for c in range(classes):
        (root / f"c{c:02d}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(np.full((8, 8, 3), 10 * c + i, np.uint8)).save(root / f"c{c:02d}" / f"{i}.png")


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("src")
    colour_source(source)
    out = source.parent / "shards"
    pack(source, out, shard_size="24KB")
    return out


def test_shard_local_batches_decode_from_adjacent_samples_of_one_shard(packed: Path) -> None:
    dataset = ShardedDataset(packed)
    shard_ids = dataset.shard_ids
    assert shard_ids.shape == (len(dataset),) and np.all(np.diff(shard_ids.astype(np.int64)) >= 0)
    assert len(np.unique(shard_ids)) > 2, "the test needs several shards"
    sampler = DistributedBalancedBatchSampler(dataset.labels, samples_per_class=3, classes_per_step=4, num_replicas=2,
                                              rank=1, locality="shard", shard_ids=shard_ids, window=2)
    batches = np.array(list(sampler)).reshape(len(sampler), 2, 3)
    for lane in range(2):
        for shard, chunks in visits_of(batches[:, lane], shard_ids):
            lane_samples = batches[:, lane][shard_ids[batches[:, lane, 0]] == shard].ravel()
            span = np.flatnonzero(shard_ids == shard)
            assert span[0] <= lane_samples.min() and lane_samples.max() <= span[-1], "a visit leaves its shard"
    pixel = {int(i): dataset.load(int(i)).getpixel((0, 0))[0] for i in np.unique(batches)}
    for index, value in pixel.items():  # decoded bytes are the indexed sample's
        label = int(dataset.labels[index])
        assert value // 10 == int(dataset.classes[label][1:])


def test_the_builder_passes_shard_ids_and_names_the_missing_shards(packed: Path) -> None:
    dataset = ShardedDataset(packed)
    subset = LabelledSubset(dataset, np.arange(6, len(dataset)))
    config = load_config(None, overrides=["sampler.classes_per_step=4", "sampler.samples_per_class=2",
                                          "sampler.args={locality: shard, window: 4}"])
    ids = shard_ids_of(subset)
    np.testing.assert_array_equal(ids, dataset.shard_ids[6:])
    sampler = build_sampler(config.sampler, subset.labels, 2, 0, 0, shard_ids=ids)
    assert sampler.locality == "shard" and len(sampler) > 0
    with pytest.raises(ConfigError, match=r"sampler.args.locality='shard' needs a packed dataset \(data.name: shards\)"):
        build_sampler(config.sampler, subset.labels, 2, 0, 0)

"""The node-local block cache over a real S3-compatible server (SeaweedFS on 127.0.0.1): each block fetched once
per host, bytes identical to the local shards, the folder within its limit, damaged blocks fetched again."""

from __future__ import annotations


import numpy as np
import pytest
from torch.utils.data import DataLoader

from pksampler import DistributedBalancedBatchSampler
from pksampler.datasets import ShardedDataset
from pksampler.datasets.blockcache import BlockCache
from synthetic_pack import synthetic_pack, uploaded

BLOCK = 64 << 10


@pytest.fixture(scope="module")
def local_pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("blockcache")
    return synthetic_pack(root / "folder", root / "shards", num_classes=24, images_per_class=8, image_size=48, shard_size="400KB")


@pytest.fixture(scope="module")
def remote_pack(local_pack, seaweed):
    return uploaded(local_pack, seaweed, "s3://pksampler-test/packs/blocks")


@pytest.fixture(autouse=True)
def node_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PKSAMPLER_CACHE", str(tmp_path / "cache"))


def blocks_of(dataset: ShardedDataset, indices) -> dict[tuple[int, int], int]:
    """(shard, block) -> the block's bytes, for every block the samples ``indices`` touch."""
    out = {}
    for i in indices:
        record = dataset.index[int(i)]
        shard, start, end = int(record["shard"]), int(record["offset"]), int(record["offset"] + record["size"])
        for block in range(start // BLOCK, (end - 1) // BLOCK + 1):
            out[shard, block] = min(BLOCK, int(dataset.shard_bytes[shard]) - block * BLOCK)
    return out


def test_every_block_is_fetched_once_and_every_sample_reads_back_byte_identical(local_pack, remote_pack, tmp_path):
    local = ShardedDataset(local_pack)
    remote = ShardedDataset(remote_pack, block_cache="16MB", block_size=BLOCK)
    assert remote.shard_bytes.max() > 3 * BLOCK  # several blocks per shard
    order = np.random.default_rng(0).permutation(len(local))
    gets0, bytes0 = remote.store.counts()
    assert [remote.read_bytes(int(i)) for i in order] == [local.read_bytes(int(i)) for i in order]
    gets, size = (now - before for now, before in zip(remote.store.counts(), (gets0, bytes0)))
    touched = blocks_of(local, order)
    assert size == sum(touched.values())  # each block once, nothing else
    assert gets <= len(touched)
    assert [remote.read_bytes(int(i)) for i in order[::-1]] == [local.read_bytes(int(i)) for i in order[::-1]]
    assert remote.store.counts()[0] == gets0 + gets  # a second pass: no GET
    # another process of the host (a fresh dataset on the same folder) finds the blocks there
    again = ShardedDataset(remote_pack, block_cache="16MB", block_size=BLOCK)
    before = again.store.counts()[0]
    assert again.__getitems__([int(i) for i in order[:40]]) is not None
    assert again.store.counts()[0] == before


def test_spawned_workers_share_the_cache_and_fetch_each_block_once(local_pack, remote_pack):
    local = ShardedDataset(local_pack)
    remote = ShardedDataset(remote_pack, block_cache="16MB", block_size=BLOCK)
    sampler = DistributedBalancedBatchSampler(local.labels, samples_per_class=4, classes_per_step=4, num_replicas=1,
                                              rank=0, seed=0, locality="shard", shard_ids=local.shard_ids, window=4)
    loader = lambda data: DataLoader(data, batch_sampler=sampler, num_workers=2, collate_fn=list,  # noqa: E731
                                     multiprocessing_context="spawn")
    before = remote.store.counts()[1]
    for got, want in zip(loader(remote), loader(local)):
        assert [label for _, label in got] == [label for _, label in want]
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for (a, _), (b, _) in zip(got, want))
    read = [i for batch in sampler for i in batch]
    assert remote.store.counts()[1] - before == sum(blocks_of(local, read).values())  # once per host, not per worker


def test_the_folder_stays_within_its_limit_and_evicted_or_damaged_blocks_are_fetched_again(local_pack, remote_pack,
                                                                                            tmp_path):
    local = ShardedDataset(local_pack)
    limit = 3 * BLOCK
    remote = ShardedDataset(remote_pack, block_cache=limit, block_size=BLOCK, cache_dir=tmp_path / "blocks")
    order = np.random.default_rng(1).permutation(len(local))
    for i in order:
        assert remote.read_bytes(int(i)) == local.read_bytes(int(i))
        assert remote.blocks.usage()[1] <= limit + 2 * BLOCK  # the limit, plus at most the blocks of this read
    assert remote.store.counts()[1] > sum(blocks_of(local, order).values())  # evicted blocks came back
    # a block file cut short (a full disk, a hand edit) is not served: it is fetched again
    files = sorted(p for p in remote.blocks.folder.iterdir() if p.is_file() and not p.name.startswith("."))
    shard, sample = files[0].name.split(".tar.")[0] + ".tar", None
    for i in range(len(local)):
        record = local.index[i]
        if local.shard_names[int(record["shard"])] == shard and int(record["offset"]) // BLOCK == \
                int(files[0].name.rsplit(".", 1)[1]):
            sample = i
            break
    files[0].write_bytes(files[0].read_bytes()[:100])
    assert remote.read_bytes(sample) == local.read_bytes(sample)


def test_bad_cache_arguments_are_named(local_pack, remote_pack, tmp_path):
    with pytest.raises(ValueError, match=r"block_cache='1GB'\) caches an object store's shards"):
        ShardedDataset(local_pack, block_cache="1GB")
    with pytest.raises(ValueError, match=r"ShardedDataset\(block_cache=\): must be at least 33554432 bytes, got '1MB'"):
        ShardedDataset(remote_pack, block_cache="1MB")
    with pytest.raises(ValueError, match=r"ShardedDataset\(block_size=\): expected a size such as 512MB"):
        ShardedDataset(remote_pack, block_cache="1GB", block_size="big")
    with pytest.raises(ValueError, match=r"cache_dir=\) is the block cache's folder: give block_cache= a size"):
        ShardedDataset(remote_pack, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"outside the object's 10 bytes"):
        BlockCache(tmp_path, limit_bytes=2 * BLOCK, block_bytes=BLOCK).read(None, "x.tar", "v", 10, [(0, 11)])

"""A pack whose objects change on a real S3-compatible server (SeaweedFS on 127.0.0.1) while or before a job reads
it: refused in one line naming the object, never read as other images."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pksampler.datasets import ShardedDataset
from pksampler.datasets.objectstore import ObjectChangedError, ObjectStore
from synthetic_pack import synthetic_pack, uploaded

BLOCK = 64 << 10


@pytest.fixture(scope="module")
def local_pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("changes")
    return synthetic_pack(root / "folder", root / "shards", num_classes=12, images_per_class=6, image_size=48,
                          shard_size="200KB")


@pytest.fixture(autouse=True)
def node_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PKSAMPLER_CACHE", str(tmp_path / "cache"))


def flipped(data: bytes) -> bytes:
    """Other bytes of the same size (what a same-size replacement of a shard looks like)."""
    return (np.frombuffer(data, dtype=np.uint8) ^ np.uint8(0x5A)).tobytes()


def upload_without_etags(local, url: str) -> None:
    """The pack as an upload made before manifests carried the shards' ETags."""
    store = ObjectStore(url)
    manifest = json.loads((local / "manifest.json").read_text())
    for name in [entry["name"] for entry in manifest["shards"]] + ["index.npy", "labels.npy", "manifest.json"]:
        store.put(name, (local / name).read_bytes())


def first_sample_of(dataset: ShardedDataset, shard: int) -> int:
    return int(np.flatnonzero(dataset.index["shard"] == shard)[0])


@pytest.mark.parametrize("cached", [False, True], ids=["ranged-gets", "block-cache"])
def test_a_shard_replaced_on_the_store_is_refused_in_one_line(local_pack, seaweed, tmp_path, cached):
    local = ShardedDataset(local_pack)
    options = {"block_cache": 8 * BLOCK, "block_size": BLOCK, "cache_dir": tmp_path / "blocks"} if cached else {}
    shard = local.shard_names[1]
    # an upload that recorded ETags: the replacement happens before the job opens the pack
    url = uploaded(local_pack, seaweed, f"s3://pksampler-test/packs/changed-{int(cached)}")
    assert all("etag" in entry for entry in ShardedDataset(url).manifest["shards"])
    ObjectStore(url).put(shard, flipped((local_pack / shard).read_bytes()))
    remote = ShardedDataset(url, **options)
    assert remote.read_bytes(0) == local.read_bytes(0)  # shard 0 is untouched
    with pytest.raises(ObjectChangedError) as caught:
        remote.read_bytes(first_sample_of(local, 1))
    message = str(caught.value)
    assert message.startswith(f"{url}/{shard}: its ETag no longer matches (412 Precondition Failed): the object "
                              "changed on the store") and "\n" not in message
    # an older upload without ETags: the first read of a shard records its ETag, a replacement mid-run is refused
    old = f"s3://pksampler-test/packs/changed-old-{int(cached)}"
    upload_without_etags(local_pack, old)
    remote = ShardedDataset(old, **options)
    assert remote.read_bytes(first_sample_of(local, 1)) == local.read_bytes(first_sample_of(local, 1))
    ObjectStore(old).put(shard, flipped((local_pack / shard).read_bytes()))
    later = [i for i in np.flatnonzero(local.index["shard"] == 1)
             if int(local.index[i]["offset"]) // BLOCK != int(local.index[first_sample_of(local, 1)]["offset"]) // BLOCK]
    with pytest.raises(ObjectChangedError, match=rf"^{old}/{shard}: its ETag no longer matches"):
        remote.read_bytes(int(later[-1]))
    # ... and one cut short before the job started is refused at its first read
    ObjectStore(old).put(shard, (local_pack / shard).read_bytes()[:1000])
    with pytest.raises(ObjectChangedError, match=rf"^{old}/{shard}: it has 1000 bytes, the manifest says "
                                                 rf"{int(local.shard_bytes[1])}: the object changed on the store"):
        ShardedDataset(old, **options).read_bytes(first_sample_of(local, 1))


def test_a_damaged_cached_index_is_fetched_again_and_a_damaged_remote_one_names_the_object(local_pack, seaweed):
    # The cached index.npy was trusted while manifest.json was unchanged: every start failed until the user found
    # the node's cache folder by hand.
    url = uploaded(local_pack, seaweed, "s3://pksampler-test/packs/index-damage")
    remote = ShardedDataset(url)
    cached = remote.root / "index.npy"
    damaged = bytearray(cached.read_bytes())
    damaged[-5] ^= 0xFF
    cached.write_bytes(bytes(damaged))
    with pytest.warns(RuntimeWarning, match=rf"cached copies of {url}/index\.npy and labels\.npy in .* failed their "
                                            r"check \(.*\); fetched them again"):
        again = ShardedDataset(url)
    assert np.array_equal(again.index, ShardedDataset(local_pack).index)
    # the store's own copy damaged: one line naming the s3:// objects, after one more fetch
    ObjectStore(url).put("index.npy", bytes(damaged))
    cached.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=rf"^ShardedDataset: {url}/index\.npy and labels\.npy, as fetched from the "
                                         rf"store, do not match {url}/manifest\.json: ") as caught:
        with pytest.warns(RuntimeWarning, match="fetched them again"):
            ShardedDataset(url)
    assert "\n" not in str(caught.value)


def test_an_outage_past_its_budget_is_one_line_and_a_refusal_after_success_is_an_outage(local_pack, seaweed,
                                                                                        monkeypatch):
    # A store down for longer than obstore's ~16-35 s of retries was a DataLoader-worker traceback; the budget is
    # now a documented, configurable length. A gateway that refuses signed requests while it restarts is part of
    # that outage once the credentials have worked, not an "access denied" at once.
    import pickle

    from pksampler.datasets.objectstore import ObjectStoreError

    url = uploaded(local_pack, seaweed, "s3://pksampler-test/packs/outage")
    remote = ShardedDataset(url, outage_seconds=2)
    assert remote.read_bytes(0) == ShardedDataset(local_pack).read_bytes(0)
    seaweed.kill()
    try:
        with pytest.raises(ObjectStoreError, match=rf"^{url}/shard-\d+\.tar: the store did not answer \(connection refused, reset or timed "
                                                   r"out\); the store failed for \d+ s, past "
                                                   r"the outage budget of 2 s \(data\.args\.outage_seconds, "
                                                   r"ShardedDataset\(outage_seconds=\)\)$"):
            remote.read_bytes(len(remote) - 1)
    finally:
        seaweed.start()
    with pytest.raises(ValueError, match=r"ObjectStore\(outage_seconds=\) must be a number of seconds in "
                                         r"\(0, 604800\], got 0"):
        ShardedDataset(url, outage_seconds=0)
    # a refusal: reported as such by a store that never answered, retried as an outage by one that did
    proven = pickle.loads(pickle.dumps(remote.store))  # what a DataLoader worker receives
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    never = ObjectStore(url, outage_seconds=2)
    with pytest.raises(ObjectStoreError, match=rf"^{url}/manifest\.json: (access denied|the credentials were "
                                               r"refused) \(check AWS_[^)]*\)$"):
        never.get("manifest.json")
    with pytest.raises(ObjectStoreError, match=r"\(check AWS_.*\); the store failed for \d+ s, past the outage budget"):
        proven.get("manifest.json")

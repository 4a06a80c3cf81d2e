"""Ranged reads from a real SeaweedFS: byte-identical to the local shards, one GET per visit, one-line refusals."""

from __future__ import annotations

import os
from pathlib import Path

import obstore
import pytest

from pksampler.datasets import ShardedDataset
from pksampler.datasets.objectstore import ObjectStoreError, RetryingReader, parse_s3_url, plan_visits, split_visit

from .test_objectstore_plan import shards  # noqa: F401  (the packed fixture)


@pytest.fixture
def store_env(seaweed, monkeypatch):
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    return seaweed


def _upload(reader: RetryingReader, folder: Path) -> None:
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "manifest.json") + ["manifest.json"]  # manifest last
    for name in names:
        obstore.put(reader._client(), reader.location.key(name), (folder / name).read_bytes())


def test_visits_from_seaweedfs_are_byte_identical_one_get_each(store_env, shards):  # noqa: F811
    reader = RetryingReader(parse_s3_url("s3://shards/plan-test"))
    _upload(reader, shards)
    dataset = ShardedDataset(shards)
    batch = [0, 1, 2, 3, 17, 18, 40, len(dataset) - 2, len(dataset) - 1]
    visits = plan_visits(dataset.index, batch)
    fetched = {}
    for visit in visits:
        data = reader.get(dataset.shard_names[visit.shard], visit.start, visit.end)
        fetched.update(split_visit(visit, dataset.index, data))
    assert fetched == {i: dataset.read_bytes(i) for i in batch}
    assert reader.stats.gets == len(visits) and reader.stats.retries == 0
    assert reader.stats.bytes == sum(v.end - v.start for v in visits) < int(dataset.shard_bytes.sum())


def test_missing_key_and_wrong_secret_are_one_line(store_env, monkeypatch, shards):  # noqa: F811
    reader = RetryingReader(parse_s3_url("s3://shards/absent"))
    with pytest.raises(ObjectStoreError) as missing:
        reader.get("manifest.json")
    assert str(missing.value) == "s3://shards/absent/manifest.json: no such object"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    denied = RetryingReader(parse_s3_url("s3://shards/plan-test"), attempts=2, backoff=0.01)
    with pytest.raises(ObjectStoreError) as refused:
        denied.get("manifest.json")
    message = str(refused.value)
    assert "access denied" in message and "\n" not in message and "s3://shards/plan-test/manifest.json" in message
    assert store_env.env()["AWS_SECRET_ACCESS_KEY"] not in message and "not-the-secret" not in message

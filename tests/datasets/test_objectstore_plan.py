"""Visits (coalesced ranged reads) over real packed shards, s3:// parsing and retry classification."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pksampler.datasets import ShardedDataset, SyntheticProducts
from pksampler.datasets.objectstore import (ObjectStoreError, ReadStats, RetryingReader, parse_s3_url, plan_visits,
                                           split_visit)
from pksampler.datasets.pack import pack


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plan") / "folder"
    synthetic = SyntheticProducts(num_classes=12, images_per_class=6, image_size=24, seed=3)
    for index in range(len(synthetic)):
        cls, view = divmod(index, 6)
        path = root / synthetic.classes[cls] / f"{view:05d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        synthetic.render(index).save(path, format="PNG")
    out = root.parent / "shards"
    pack(root, out, shard_size="16KB")
    return out


def test_visits_coalesce_adjacent_indices_and_cut_bytes_identical(shards):
    dataset = ShardedDataset(shards)
    assert len(set(dataset.index["shard"].tolist())) > 2
    batch = [5, 3, 4, 30, 31, 32, 33, 60, 4, len(dataset) - 1]
    visits = plan_visits(dataset.index, batch)
    covered = [i for visit in visits for i in visit.indices]
    assert covered == sorted(set(batch))
    for visit in visits:  # each visit is one run of consecutive samples in one shard
        assert list(visit.indices) == list(range(visit.indices[0], visit.indices[-1] + 1))
        assert set(dataset.index["shard"][list(visit.indices)].tolist()) == {visit.shard}
        assert visit.end - visit.start < int(dataset.shard_bytes[visit.shard])  # never the whole shard
        with open(shards / dataset.shard_names[visit.shard], "rb") as handle:
            handle.seek(visit.start)
            data = handle.read(visit.end - visit.start)
        for sample, payload in split_visit(visit, dataset.index, data).items():
            assert payload == dataset.read_bytes(sample)
    runs = 1 + sum(1 for a, b in zip(sorted(set(batch)), sorted(set(batch))[1:])
                   if b != a + 1 or dataset.index["shard"][a] != dataset.index["shard"][b])
    assert len(visits) == runs


def test_visit_size_bound_splits_runs(shards):
    dataset = ShardedDataset(shards)
    largest = int(dataset.index["size"].max())
    visits = plan_visits(dataset.index, range(len(dataset)), max_visit_bytes=largest)
    assert len(visits) == len(dataset)  # the bound leaves room for one payload only
    with pytest.raises(ValueError, match="max_visit_bytes"):
        plan_visits(dataset.index, [0], max_visit_bytes=0)


def test_split_visit_refuses_short_data(shards):
    dataset = ShardedDataset(shards)
    visit = plan_visits(dataset.index, [0, 1])[0]
    with pytest.raises(ValueError, match="truncated"):
        split_visit(visit, dataset.index, b"\0" * (visit.end - visit.start - 1))


def test_parse_s3_url_names_argument_and_value():
    location = parse_s3_url("s3://bucket/a/b/")
    assert (location.bucket, location.prefix, location.key("x.tar")) == ("bucket", "a/b", "a/b/x.tar")
    for bad in ("/data/shards", "s3://", "s3://b/../x"):
        with pytest.raises(ValueError, match=r"data\.root=.*s3://bucket/prefix"):
            parse_s3_url(bad)


class _Flaky(RetryingReader):
    """A reader whose transport fails with the given errors first (the classification and backoff under test)."""

    def __init__(self, errors):
        self.waits: list[float] = []
        super().__init__(parse_s3_url("s3://b/p"), attempts=4, backoff=0.01, sleep=self.waits.append)
        self.errors = list(errors)

    def _client(self):
        if self.errors:
            raise self.errors.pop(0)
        raise RuntimeError("404 Not Found")


def test_retry_classification_backoff_and_one_line():
    reader = _Flaky([RuntimeError("503 Service Unavailable"), ConnectionError("Connection refused")])
    with pytest.raises(ObjectStoreError) as caught:
        reader.get("manifest.json")
    assert str(caught.value) == "s3://b/p/manifest.json: no such object" and "\n" not in str(caught.value)
    assert reader.stats.retries == 2 and reader.stats.gets == 3 and reader.waits == [0.01, 0.02]
    denied = _Flaky([RuntimeError("403 Forbidden")])
    with pytest.raises(ObjectStoreError, match="access denied"):
        denied.get("index.npy")
    assert denied.stats.retries == 0


def test_stats_metrics_and_cost():
    stats = ReadStats(gets=2000, bytes=10, seconds=4.0)
    stats.add(ReadStats(gets=500, retries=1, seconds=1.0))
    metrics = stats.as_metrics()
    assert metrics["store/gets"] == 2500 and metrics["store/gets_per_s"] == 500.0
    assert metrics["store/cost_usd"] == pytest.approx(0.001)

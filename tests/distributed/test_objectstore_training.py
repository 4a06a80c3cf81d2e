"""``horovodrun -np 2 python train/retrieval.py`` trains from s3:// (a real SeaweedFS) the model it trains from disk.

Both runs use the shard-local plan; the remote one reads through the node-local block cache, as at scale.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import yaml
from launch import ROOT, launch
from synthetic_pack import synthetic_pack

from pksampler.datasets.upload import upload

pytestmark = pytest.mark.horovod
SCRIPT = ROOT / "train" / "retrieval.py"


def test_training_from_the_object_store_equals_training_from_the_local_shards(tmp_path, seaweed):
    synthetic_pack(tmp_path / "folder", tmp_path / "shards", num_classes=16, images_per_class=6, image_size=32,
                   shard_size="96KB")
    environment = {**seaweed.environment(), "PKSAMPLER_CACHE": str(tmp_path / "cache")}
    os.environ.update(environment)
    upload(tmp_path / "shards", "s3://pksampler-test/train/demo")
    config = {"seed": 1, "data": {"name": "shards", "args": {}, "test_fraction": 0.25, "image_size": 24, "workers": 1},
              "sampler": {"classes_per_step": 4, "samples_per_class": 3, "args": {"locality": "shard", "window": 4}},
              "model": {"width": 8, "depth": [1], "embedding_dim": 16},
              "train": {"epochs": 1, "max_steps": 4, "checkpoint_every": 0, "eval_every": 1, "tensorboard": False}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    runs = {"local": (str(tmp_path / "shards"), "{}"),
            "remote": ("s3://pksampler-test/train/demo", "{block_cache: 1MiB, block_size: 64KiB}")}
    for name, (root, args) in runs.items():
        result = launch("horovodrun", SCRIPT, "--config", str(path), "--set", f"data.root={root}",
                        "--set", f"data.args={args}", "--set", f"workspace={tmp_path / name}", env=environment,
                        timeout=400)
        assert result.returncode == 0, result.stdout[-4000:]
        assert environment["AWS_SECRET_ACCESS_KEY"] not in result.stdout
    local, remote = (torch.load(tmp_path / n / "checkpoints" / "last.pt", weights_only=True) for n in runs)
    assert all(torch.equal(local["model"][k], remote["model"][k]) for k in local["model"])
    records = [json.loads(line) for line in (tmp_path / "remote" / "metrics.jsonl").read_text().splitlines()]
    accounting = [r for r in records if r.get("type") == "objectstore"]
    assert accounting and accounting[-1]["gets"] > 0 and accounting[-1]["cost_usd"] > 0
    blocks = list((tmp_path / "cache" / "objectstore").glob("*/blocks/pksampler-blocks-v1/shard-*"))
    assert blocks and sum(b.stat().st_size for b in blocks) <= 2**20 + 2 * 2**16  # the cache was used, within limit
    for written in (tmp_path / "remote").rglob("*"):  # no secret in the config dump, metrics or checkpoints
        if written.is_file():
            assert environment["AWS_SECRET_ACCESS_KEY"].encode() not in written.read_bytes(), written


def test_a_shard_deleted_from_the_store_is_one_line_per_rank_not_a_worker_traceback(tmp_path, seaweed):
    # An ObjectStoreError raised in a DataLoader worker reached rank 0 as a ~50-line traceback, and the other rank
    # reported a HorovodInternalError as if it were the cause.
    import obstore

    synthetic_pack(tmp_path / "folder", tmp_path / "shards", num_classes=8, images_per_class=6, image_size=32,
                   shard_size="32KB")
    environment = {**seaweed.environment(), "PKSAMPLER_CACHE": str(tmp_path / "cache")}
    os.environ.update(environment)
    upload(tmp_path / "shards", "s3://pksampler-test/train/deleted")
    shards = sorted(path.name for path in (tmp_path / "shards").glob("shard-*.tar"))
    assert len(shards) > 1
    for name in shards[1:]:
        obstore.delete(seaweed.client("pksampler-test"), f"train/deleted/{name}")
    config = {"seed": 1, "data": {"name": "shards", "root": "s3://pksampler-test/train/deleted", "args": {},
                                  "test_fraction": 0.25, "image_size": 24, "workers": 1},
              "sampler": {"classes_per_step": 4, "samples_per_class": 3},
              "model": {"width": 8, "depth": [1], "embedding_dim": 16}, "workspace": str(tmp_path / "ws"),
              "train": {"epochs": 1, "checkpoint_every": 0, "tensorboard": False}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = launch("horovodrun", SCRIPT, "--config", str(path), env=environment, timeout=400)
    assert result.returncode != 0, result.stdout[-4000:]
    ranks = "\n".join(line for line in result.stdout.splitlines() if line.startswith(("[0]", "[1]")))
    assert "Traceback" not in ranks and "HorovodInternalError:" not in ranks, result.stdout[-4000:]
    errors = [line for line in result.stdout.splitlines() if "error: rank" in line]
    assert errors and all(re.search(r"error: rank [01]: s3://pksampler-test/train/deleted/shard-\d+\.tar: no such "
                                    r"object( or bucket)?$", line) for line in errors), result.stdout[-4000:]

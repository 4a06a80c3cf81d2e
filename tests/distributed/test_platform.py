"""The training platform's contract with real launches: two datasets in DATASETS, BACKEND, the legacy launcher.

Four launches in all: horovodrun -np 2 trains one epoch on the union of an image folder and a packed shard set;
torchrun -np 2 with BACKEND=gloo resumes it to the second epoch; ``python -m torch.distributed.launch`` (which
passes ``--local-rank=N``) trains; BACKEND=nccl on this CPU machine stops in one line.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from catalogue_fixtures import render_folder
from launch import LEGACY, ROOT, launch, rank_tracebacks
from synthetic_pack import synthetic_pack

from pksampler.train.builders import DataParts, build_data
from pksampler.train.config.agreement import check_resume_compatible
from pksampler.train.config.load import ConfigError, load_config

pytestmark = pytest.mark.horovod
SCRIPT = ROOT / "train" / "retrieval.py"
NAMES = "photos,glyphs"
TINY = {
    "seed": 3,
    "data": {"name": "folder", "args": {}, "test_fraction": 0.3, "image_size": 24, "workers": 0},
    "sampler": {"name": "balanced", "classes_per_step": 4, "samples_per_class": 3},
    "model": {"width": 8, "depth": [1, 1], "embedding_dim": 16, "norm": "group"},
    "loss": {"name": "batch_hard", "args": {"margin": "soft"}},
    "optim": {"lr": 0.003, "base_batch": 12, "warmup_steps": 3},
    "train": {"epochs": 1, "eval_every": 1, "checkpoint_every": 0, "gallery_queries": 3, "tensorboard": False},
}


@pytest.fixture(scope="module")
def mounted(tmp_path_factory) -> dict:
    """DATASETS_PATH holding an image folder (photos) and a packed shard set (glyphs), the run config, a workspace."""
    root = tmp_path_factory.mktemp("platform")
    datasets = root / "datasets"
    render_folder(datasets / "photos", classes=10, per_class=5, image_size=32)
    synthetic_pack(root / "glyph-source", datasets / "glyphs", num_classes=8, images_per_class=5, image_size=32,
                   shard_size="20KB")
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    return {"root": root, "datasets": datasets, "config": config, "workspace": root / "workspace"}


def platform_env(mounted: dict, **extra: str) -> dict[str, str]:
    return {"DATASETS_PATH": str(mounted["datasets"]), "DATASETS": NAMES, "WORKSPACE": str(mounted["workspace"]),
            **extra}


@pytest.fixture(scope="module")
def union(mounted) -> DataParts:
    """The same union opened in this process: the counts every launch must report."""
    return build_data(load_config(mounted["config"], environ=platform_env(mounted)))


@pytest.fixture(scope="module")
def first(mounted) -> subprocess.CompletedProcess:
    return launch("horovodrun", SCRIPT, "--config", str(mounted["config"]), env=platform_env(mounted))


@pytest.fixture(scope="module")
def resumed(mounted, first) -> subprocess.CompletedProcess:
    assert first.returncode == 0, first.stdout[-4000:]
    return launch("torchrun", SCRIPT, "--config", str(mounted["config"]),
                  env=platform_env(mounted, EPOCHS="2", BACKEND="gloo"))


def counts_line(data: DataParts) -> str:
    classes = [np.unique(part.labels).size for part in (data.train, data.test)]
    return f"train={len(data.train)} images ({classes[0]} classes) test={len(data.test)} images ({classes[1]} classes)"


def test_horovodrun_trains_the_union_with_its_counts_and_names(first, union, mounted):
    assert first.returncode == 0, first.stdout[-4000:]
    assert "backend=horovod world=2" in first.stdout and counts_line(union) in first.stdout
    assert first.stdout.count("datasets: photos 50 images 10 classes, glyphs 40 images 8 classes; trained as one "
                              "set of 90 images, 18 classes named <dataset>/<class>") == 1  # rank 0 alone
    saved = torch.load(mounted["workspace"] / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert saved["config"]["data"]["datasets"] == ["photos", "glyphs"]  # the checkpoint names its datasets
    assert saved["config"]["data"]["root"] == str(mounted["datasets"])


def test_the_held_out_set_and_final_metrics_cover_both_datasets(first, union, mounted):
    assert first.returncode == 0, first.stdout[-4000:]
    assert np.unique(union.test.labels).size == round(0.3 * 18)  # 30 % of the union's classes, all 5 images each
    assert len(union.test) == 5 * round(0.3 * 18)
    final = json.loads((mounted["workspace"] / "final_metrics.json").read_text())
    assert final["num_queries"] == len(union.test)  # every held-out image of the union is a query


def test_torchrun_with_backend_gloo_resumes_the_union(resumed, union, mounted):
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "backend=torch world=2" in resumed.stdout and "process_group=gloo" in resumed.stdout
    assert counts_line(union) in resumed.stdout and "resumed at epoch 1" in resumed.stdout
    records = [json.loads(line) for line in (mounted["workspace"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["type"] == "eval"] == [1, 2]
    assert resumed.stdout.count("[pksampler] final:") == 1


def test_resuming_with_another_dataset_list_is_one_line(resumed, mounted):
    """The real run's checkpoint against the config another DATASETS gives (checked in this process)."""
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    path = mounted["workspace"] / "checkpoints" / "last.pt"
    saved = torch.load(path, map_location="cpu", weights_only=True)["config"]
    other = load_config(mounted["config"], environ=platform_env(mounted, DATASETS="photos"))
    with pytest.raises(ConfigError, match=r"cannot resume from .*last.pt: the config changes data.datasets") as caught:
        check_resume_compatible(saved, other.to_dict(), str(path))
    assert "\n" not in str(caught.value)


def test_the_legacy_launcher_passes_local_rank_and_trains(mounted, tmp_path):
    result = launch(LEGACY, SCRIPT, "--config", str(mounted["config"]),
                    env=platform_env(mounted, WORKSPACE=str(tmp_path / "legacy")))
    assert result.returncode == 0, result.stdout[-4000:]
    assert "unrecognized arguments" not in result.stdout
    assert "backend=torch world=2" in result.stdout and result.stdout.count("[pksampler] final:") == 1
    assert (tmp_path / "legacy" / "final_metrics.json").is_file()


def test_backend_nccl_without_a_gpu_stops_every_rank_in_one_line(mounted, tmp_path):
    result = launch("torchrun", SCRIPT, "--config", str(mounted["config"]), timeout=120,
                    env=platform_env(mounted, WORKSPACE=str(tmp_path / "nccl"), BACKEND="nccl"))
    assert result.returncode != 0
    lines = re.findall(r"^.*BACKEND='nccl'.*$", result.stdout, flags=re.MULTILINE)
    assert lines == ["error: environment variable BACKEND='nccl' needs a CUDA GPU, but this rank runs on cpu "
                     "(CUDA available: False); set BACKEND=gloo for CPUs"]
    assert rank_tracebacks(result.stdout) == 0 and "[pksampler] epoch" not in result.stdout

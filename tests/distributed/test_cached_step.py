"""Gradient-cached steps in real processes: -np 2 (horovodrun) and -np 3 (torchrun) train what one process does.

The reference is one process with the plain step over the whole global
batch (trained in the same plain process as its untrained start,
trace_runs.py); the chunked runs split the same global batches over 2 and 3 ranks
(G = 6: 3 + 3 and 2 + 2 + 2 classes) and embed 4 images at a time, so the
chunks are uneven and Horovod's optimizer must count one backward pass per
chunk while DDP reduces once per step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from launch import ROOT, launch
from tiny_runs import read_trained
from trainer_runs import trace_launch

pytestmark = pytest.mark.horovod
SCRIPT = ROOT / "train" / "retrieval.py"
TINY = {
    "seed": 3,
    "data": {"name": "synthetic", "args": {"num_classes": 24, "images_per_class": 6, "image_size": 32},
             "test_fraction": 0.3, "image_size": 24, "workers": 0},
    "sampler": {"name": "balanced", "classes_per_step": 6, "samples_per_class": 3},
    "model": {"width": 8, "depth": [1, 1], "embedding_dim": 16, "norm": "group"},
    "loss": {"name": "multi_similarity", "args": {}},
    "optim": {"name": "sgd", "lr": 0.2, "base_batch": 18, "warmup_steps": 1},
    "train": {"epochs": 4, "max_steps": 4, "eval_every": 100, "checkpoint_every": 0, "tensorboard": False},
}


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(TINY))))
    return path


def checkpoint(workspace: Path) -> dict:
    return read_trained(workspace / "checkpoints" / "last.pt")


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)



def test_chunked_steps_on_two_and_three_ranks_equal_one_process_without_chunks(tmp_path):
    config = write_config(tmp_path)
    # the reference and the same config for no step ("start"), one after the other in one plain process
    one = trace_launch(tmp_path, "one", {"plain": (config, []), "start": (config, ["train.max_steps=0"])},
                       launcher=None)
    assert one.returncode == 0, one.stdout[-4000:]
    runs = {"horovodrun": 2, "torchrun": 3}
    for launcher, ranks in runs.items():
        result = launch(launcher, SCRIPT, "--config", str(config), "--set", f"workspace={tmp_path / launcher}",
                        "--set", "train.chunk_size=4", np=ranks)
        assert result.returncode == 0, result.stdout[-4000:]
        assert f"world={ranks}" in result.stdout and "global=18" in result.stdout and "chunk=4" in result.stdout
    reference = checkpoint(tmp_path / "one" / "plain")["model"]
    differences = {launcher: max_difference(checkpoint(tmp_path / launcher)["model"], reference) for launcher in runs}
    assert max(differences.values()) < 1e-4, differences
    moved = max_difference(checkpoint(tmp_path / "one" / "start")["model"], reference)
    assert moved > 100 * max(differences.values()), (moved, differences)  # the steps really moved the model

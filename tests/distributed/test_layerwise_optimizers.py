"""LAMB and LARS under horovodrun -np 2: Horovod's DistributedOptimizer wraps them and the model equals one process's.

One launch trains both optimizers, one after the other (trace_runs.py): a launch costs seconds of start-up per rank.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from launch import ROOT, shared_run
from trainer_runs import trace_launch

from pksampler.train.config.load import load_config
from pksampler.train.run_setup import train
from pksampler.train.runtime.distributed import Backend

pytestmark = pytest.mark.horovod

SETTINGS = [
    "seed=3", "data.args={num_classes: 24, images_per_class: 6, image_size: 32}", "data.image_size=24",
    "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=3", "model.width=8",
    "model.depth=[1, 1]", "model.embedding_dim=16", "optim.base_batch=3", "optim.warmup_fraction=0.5",
    "train.max_steps=4", "train.checkpoint_every=0", "train.tensorboard=false",
]
#: each optimizer's learning rate
OPTIMIZERS = {"lamb": 0.01, "lars": 0.5}


def settings(name: str) -> list[str]:
    return [*SETTINGS, f"optim.name={name}", f"optim.lr={OPTIMIZERS[name]}"]


@shared_run()
def two_ranks(folder: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Both optimizers trained on two Horovod ranks in one launch, each as train/retrieval.py trains it
    (configs/demo.yaml, then the settings): the workspaces' root and the launch's output."""
    runs = {name: (ROOT / "configs" / "demo.yaml", settings(name)) for name in OPTIMIZERS}
    return folder / "two", trace_launch(folder, "two", runs, launcher="horovodrun")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_two_horovod_ranks_step_lamb_and_lars_like_one_process(tmp_path, two_ranks, name):
    root, result = two_ranks
    assert result.returncode == 0, result.stdout[-4000:]
    assert "world=2" in result.stdout
    train(load_config(None, [*settings(name), f"workspace={tmp_path / 'one'}"], environ={}), Backend())

    def model(workspace: Path) -> dict:
        return torch.load(workspace / "checkpoints" / "last.pt", weights_only=True)["model"]

    two, one = model(root / name), model(tmp_path / "one")
    first = torch.load(tmp_path / "one" / "checkpoints" / "last.pt", weights_only=True)
    assert first["state"]["global_step"] == 4
    assert max(float((two[k].float() - one[k].float()).abs().max()) for k in one) < 1e-4

"""LAMB and LARS under horovodrun -np 2: Horovod's DistributedOptimizer wraps them and the model equals one process's."""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, launch

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


@pytest.mark.parametrize(("name", "lr"), [("lamb", 0.01), ("lars", 0.5)])
def test_two_horovod_ranks_step_lamb_and_lars_like_one_process(tmp_path, name, lr):
    settings = [*SETTINGS, f"optim.name={name}", f"optim.lr={lr}"]
    args = [item for setting in settings for item in ("--set", setting)]
    result = launch("horovodrun", ROOT / "train" / "retrieval.py", *args, "--set", f"workspace={tmp_path / 'two'}")
    assert result.returncode == 0, result.stdout[-4000:]
    assert "world=2" in result.stdout
    train(load_config(None, [*settings, f"workspace={tmp_path / 'one'}"], environ={}), Backend())

    def model(run: str) -> dict:
        return torch.load(tmp_path / run / "checkpoints" / "last.pt", weights_only=True)["model"]

    two, one = model("two"), model("one")
    first = torch.load(tmp_path / "one" / "checkpoints" / "last.pt", weights_only=True)
    assert first["state"]["global_step"] == 4
    assert max(float((two[k].float() - one[k].float()).abs().max()) for k in one) < 1e-4

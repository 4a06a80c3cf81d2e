"""Fine-tuning a pretrained ResNet under horovodrun -np 2: rank 0 reads the file, frozen steps keep allreduce in step."""

from __future__ import annotations

import pytest
import torch
from launch import ROOT, launch

from pksampler.train.config.load import load_config
from pksampler.train.runtime.distributed import Backend
from pksampler.train.modeling.resnet import resnet
from pksampler.train.run_setup import train

pytestmark = pytest.mark.horovod

SETTINGS = [
    "seed=3", "data.args={num_classes: 24, images_per_class: 6, image_size: 32}", "data.image_size=32",
    "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=3",
    "model.backbone=resnet18", "model.norm=batch", "model.freeze_norm=true", "model.embedding_dim=16",
    "model.freeze_backbone_steps=2", "optim.backbone_lr_scale=0.5", "optim.name=sgd", "optim.lr=0.01",
    "optim.base_batch=12", "optim.warmup_steps=1", "loss.name=multi_similarity", "train.max_steps=3",
    "train.checkpoint_every=0", "train.tensorboard=false",
]


def test_two_horovod_ranks_fine_tune_a_pretrained_resnet_like_one_process(tmp_path):
    torch.manual_seed(7)
    trunk = resnet("resnet18").eval()
    with torch.no_grad():
        for name, tensor in trunk.state_dict().items():
            if name.endswith("running_var"):
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("running_mean"):
                tensor.uniform_(-0.2, 0.2)
    weights = tmp_path / "resnet18.pth"
    torch.save(trunk.state_dict(), weights)
    settings = [*SETTINGS, f"model.pretrained={weights}"]
    args = [item for setting in settings for item in ("--set", setting)]
    result = launch("horovodrun", ROOT / "train" / "retrieval.py", *args, "--set", f"workspace={tmp_path / 'two'}")
    assert result.returncode == 0, result.stdout[-4000:]
    assert "world=2" in result.stdout
    train(load_config(None, [*settings, f"workspace={tmp_path / 'one'}"], environ={}), Backend())

    def model(name: str) -> dict:
        return torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)["model"]

    two, one = model("two"), model("one")
    # Frozen BatchNorm makes the backbone independent of how the batch is split over ranks.
    assert max(float((two[k].float() - one[k].float()).abs().max()) for k in one) < 1e-4
    loaded = trunk.state_dict()
    norms = [k for k in loaded if ".bn" in k or k.startswith("bn1.") or "downsample.1" in k]
    assert all(torch.equal(two[f"backbone.{k}"], loaded[k]) for k in norms)  # the file's statistics, kept
    assert not torch.equal(two["backbone.conv1.weight"], loaded["conv1.weight"])  # trained at step 3, after the freeze

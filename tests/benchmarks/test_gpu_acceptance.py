"""The GPU acceptance script's parts, run on the CPU with tiny sizes (the GPU run itself needs a GPU machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from reference_models import import_timm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_acceptance  # noqa: E402

TINY_DEMO = ["data.args={num_classes: 24, images_per_class: 6, image_size: 32}", "data.image_size=24",
             "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=3", "model.width=8",
             "model.depth=[1, 1]", "model.embedding_dim=16", "optim.warmup_steps=2", "train.epochs=1",
             "train.eval_every=1", "train.gallery_queries=2"]


def test_part1_parity_of_our_resnet50_with_a_reference_through_a_saved_file(tmp_path):
    torch.manual_seed(0)
    reference = import_timm().create_model("resnet50", pretrained=False, num_classes=0)  # pooled features
    result = gpu_acceptance.parity(reference, tmp_path, device="cpu", image_size=32, batch=2, torchvision_too=False)
    assert result["passed"] and result["resnet50_max_abs_diff"] <= 1e-5, result
    assert (tmp_path / "resnet50_reference.pth").is_file()


def test_part1_fails_when_the_weights_do_not_give_the_references_outputs(tmp_path):
    class Shifted(torch.nn.Module):  # the same weights, an output that differs from a ResNet-50's by 1e-3
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = import_timm().create_model("resnet50", pretrained=False, num_classes=0)

        def state_dict(self, *args, **kwargs):
            return self.net.state_dict(*args, **kwargs)

        def forward(self, images):
            return self.net(images) + 1e-3

    result = gpu_acceptance.parity(Shifted(), tmp_path, device="cpu", image_size=32, batch=1, torchvision_too=False)
    assert not result["passed"] and result["resnet50_max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.horovod  # launches a real rank (torchrun)
def test_part2_runs_the_demo_under_torchrun_and_reads_its_recall(tmp_path):
    # bf16 autocast runs on the CPU too, so the GPU runs' code path is exercised here.
    run = gpu_acceptance.demo_recall(tmp_path / "bf16", device="cpu", precision="bf16", overrides=TINY_DEMO)
    assert "error" not in run, run
    assert "backend=torch world=1" in run["announced"] and "precision=bf16" in run["announced"]
    assert 0.0 <= run["recall_at_1"] <= 1.0 and (tmp_path / "bf16" / "final_metrics.json").is_file()


def test_part3_measures_the_loader_from_shards_against_inputs_on_the_device(tmp_path):
    shards = gpu_acceptance.make_shards(tmp_path, classes=6, per_class=4, side=48, workers=1)
    assert (shards / "manifest.json").is_file()
    assert gpu_acceptance.make_shards(tmp_path, classes=6, per_class=4, side=48) == shards  # reused
    result = gpu_acceptance.pipeline_ratio(shards, backbone="resnet18", image_size=32, classes_per_step=2,
                                           samples_per_class=2, workers=1, steps=2, warmup=1, device="cpu",
                                           precision="fp32")
    assert result["batch"] == 4 and result["device"] == "cpu" and not result["channels_last"]
    assert result["synthetic_images_per_s"] > 0 and result["loader_images_per_s"] > 0
    # unrounded numbers: the ratio is the quotient of the two rates by construction, and passed follows it
    assert result["ratio"] == result["loader_images_per_s"] / result["synthetic_images_per_s"]
    assert result["passed"] == (result["ratio"] >= result["goal"])
    assert result["cpu_cores"] >= 1 and result["loader_workers"] == 1


def test_part4_reads_the_horovod_build_and_refuses_a_build_without_nccl(tmp_path):
    horovodrun = Path(sys.executable).with_name("horovodrun")
    build = gpu_acceptance.check_build(horovodrun)
    assert build["Available Frameworks"]["PyTorch"] and build["Available Controllers"]["Gloo"]
    assert build["Available Tensor Operations"]["Gloo"] and not build["Available Tensor Operations"]["NCCL"]
    result = gpu_acceptance.horovod_nccl(tmp_path, horovodrun=horovodrun, build=build)
    assert result == {"nccl": False, "gloo": True, "pytorch": True, "passed": False, "note": result["note"]}
    assert "PKSAMPLER_HOROVOD_GPU=nccl" in result["note"]

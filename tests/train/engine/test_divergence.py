"""The divergence guard: embeddings and parameters as well as the loss; valid JSON; no NaN checkpoints."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from pksampler.files import atomic_write_bytes
from pksampler.train.engine.checkpoint import CheckpointError, load_checkpoint
from pksampler.train.config.load import ConfigError, load_config
from pksampler.train.runtime.distributed import Backend
from pksampler.train.engine.hooks import HookBase
from pksampler.train.run_setup import train
from pksampler.train.engine.trainer import TrainingDiverged
from pksampler.train.runtime.workspace import EventLog

TINY = [
    "seed=3", "data.args={num_classes: 24, images_per_class: 6, image_size: 32}", "data.image_size=24",
    "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=3", "model.width=8",
    "model.depth=[1, 1]", "model.embedding_dim=16", "optim.lr=0.003", "optim.base_batch=12",
    "optim.warmup_steps=3", "train.epochs=2", "train.eval_every=1", "train.checkpoint_every=2",
    "train.gallery_queries=3", "train.tensorboard=false",
]


def tiny(tmp_path: Path, *extra: str):
    return load_config(None, [*TINY, f"workspace={tmp_path / 'run'}", *extra], environ={})


def last(tmp_path: Path) -> dict:
    return load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")


def all_finite(state: dict) -> bool:
    return all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


class PoisonParameters(HookBase):
    """After global step 2, one parameter becomes NaN (the default loss then stays finite: 0.0)."""

    def after_step(self):
        if self.trainer.state.global_step == 2:
            with torch.no_grad():
                next(self.trainer.parts.model.parameters()).fill_(float("nan"))


def test_nan_embeddings_stop_the_default_loss_and_last_pt_stays_finite(tmp_path):
    config = tiny(tmp_path)
    assert config.loss.name == "multi_similarity"
    with pytest.raises(TrainingDiverged, match=r"the embeddings hold NaN or infinite values at global step 3 "
                                               r"\(epoch 1; the loss is 0.0\)"):
        train(config, Backend(), extra_hooks=[PoisonParameters()])
    state = last(tmp_path)
    assert state["state"]["global_step"] == 2 and all_finite(state)


class NanGradientLoss(HookBase):
    """From global step 2 on, a loss that is 0.0 with finite embeddings but infinite gradients."""

    def after_step(self):
        if self.trainer.state.global_step == 2:
            self.trainer.parts.loss_fn = lambda e, labels: torch.sqrt((e - e.detach()).sum().abs())


def test_non_finite_parameters_are_never_written_to_last_pt(tmp_path):
    with pytest.raises(TrainingDiverged, match=r"the model holds \d+ NaN or infinite parameter value\(s\) at global "
                                               r"step 3; last.pt was not written"):
        train(tiny(tmp_path, "train.max_steps=3", "train.checkpoint_every=0"), Backend(), extra_hooks=[NanGradientLoss()])
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()


def test_an_infinite_effective_learning_rate_is_refused_at_set_up(tmp_path):
    with pytest.raises(ConfigError, match=r"optim.lr: 1e\+308 x 12 images per step / optim.base_batch=1 gives the "
                                          r"learning rate inf, which is not a finite number"):
        tiny(tmp_path, "optim.lr=1.0e+308", "optim.base_batch=1")


def test_a_checkpoint_with_nan_parameters_is_refused_on_resume(tmp_path):
    train(tiny(tmp_path, "train.max_steps=2"), Backend())
    path = tmp_path / "run" / "checkpoints" / "last.pt"
    state = torch.load(path, weights_only=True)
    first = next(iter(state["model"]))
    state["model"][first] = torch.full_like(state["model"][first], float("nan"))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(path, buffer.getvalue())
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} holds \d+ NaN or infinite parameter value\(s\)"):
        train(tiny(tmp_path, "train.max_steps=4"), Backend())


def test_the_metrics_log_stays_valid_json_for_non_finite_numbers(tmp_path):
    log = EventLog(tmp_path / "metrics.jsonl", True)
    log.write(type="step", loss=float("nan"), lr=float("inf"), other=-float("inf"), fine=0.5)
    log.close()

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    record = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert record == {"type": "step", "loss": "nan", "lr": "inf", "other": "-inf", "fine": 0.5}
    assert float(record["loss"]) != float(record["loss"]) and float(record["lr"]) == float("inf")


def test_a_weight_decay_that_zeroes_or_flips_the_weights_in_one_step_is_refused_at_set_up(tmp_path):
    """Before: optim.weight_decay=1e9 was accepted and the run stopped at step 4 advising a lower optim.lr."""
    with pytest.raises(ConfigError, match=r"^optim.weight_decay: 1000000000.0 times the peak rate 0.003 \(optim.lr "
                                          r"0.003 x 12 images / optim.base_batch 12, optim.scaling sqrt\) must be "
                                          r"below 1: each adamw step scales a weight by 1 − rate × decay, which "
                                          r"would zero or flip it$"):
        tiny(tmp_path, "optim.weight_decay=1e9")
    with pytest.raises(ConfigError, match=r"optim.weight_decay: 300.0 times the peak rate 0.006 .* x "
                                          r"optim.backbone_lr_scale 2.0\) must be below 1: each sgd step"):
        tiny(tmp_path, "optim.name=sgd", "optim.weight_decay=300", "optim.backbone_lr_scale=2")
    assert tiny(tmp_path, "optim.name=sgd", "optim.weight_decay=300").optim.weight_decay == 300  # 0.9 < 1
    assert tiny(tmp_path, "optim.name=lars", "optim.weight_decay=1e9").optim.name == "lars"  # inside the trust ratio


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_a_weight_decay_past_float32_is_refused_at_set_up_for_the_layerwise_optimizers(tmp_path, name):
    """Before: LAMB and LARS, outside the rate x decay rule, took optim.weight_decay=1e39 and the first step ended in
    torch's traceback ('value cannot be converted to type float without overflow')."""
    with pytest.raises(ConfigError, match=rf"^optim.weight_decay: 1e\+39 must be below float32's largest value "
                                          rf"3.403e\+38: each {name} step multiplies the float32 weights by it$"):
        tiny(tmp_path, f"optim.name={name}", "optim.weight_decay=1e39")


@pytest.mark.parametrize("decay, advice", [(100.0, r"each step scales the weights by 1 − lr × decay = 0.7 at the peak "
                                                   r"rate: lower optim.weight_decay \(or optim.lr\)"),
                                           (0.0005, r"lower optim.lr, raise optim.warmup_steps or check the data")])
def test_the_non_finite_stop_names_the_weight_decay_when_each_step_removes_a_large_share_of_every_weight(
        tmp_path, decay, advice):
    """Before: every non-finite stop advised a lower optim.lr, whatever the decay did to the weights."""
    with pytest.raises(TrainingDiverged, match=r"the embeddings hold NaN or infinite values at global step 3 .* "
                                               rf"The last good checkpoint is kept: {advice}, then resume"):
        train(tiny(tmp_path, f"optim.weight_decay={decay}", "train.max_steps=4"), Backend(),
              extra_hooks=[PoisonParameters()])

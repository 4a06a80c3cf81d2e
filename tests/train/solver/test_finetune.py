"""Fine-tuning options: optim.backbone_lr_scale, model.freeze_norm, model.freeze_backbone_steps (with resume)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pksampler.train.builders import build_optimizer, build_schedule
from pksampler.train.engine.checkpoint import load_checkpoint
from pksampler.train.config.load import ConfigError, load_config
from pksampler.train.runtime.distributed import Backend
from pksampler.train.engine.hooks import FreezeBackboneHook
from pksampler.train.modeling.frozen_norm import FrozenBatchNorm2d
from pksampler.train.modeling.model import build_model
from pksampler.train.run_setup import train
from tiny_runs import TINY


def _config(*extra: str):
    return load_config(None, [*TINY, *extra], environ={})


def _is_backbone(name: str) -> bool:
    return name.startswith(("stem.", "stages.", "backbone."))


def _norm_keys(model: torch.nn.Module) -> set[str]:
    """State-dict keys of the frozen norm layers."""
    layers = [n for n, m in model.named_modules() if isinstance(m, FrozenBatchNorm2d)]
    return {k for k in model.state_dict() if any(k.startswith(f"{layer}.") for layer in layers)}


def test_backbone_lr_scale_makes_two_groups_that_the_schedule_scales_together():
    config = _config("optim.backbone_lr_scale=0.1", "model.neck=batch", "model.pooling=gem")
    model = build_model(config.model)
    extra = torch.nn.Parameter(torch.zeros(3))  # a loss's own parameter (proxies, ...) learns with the head
    optimizer = build_optimizer(config.optim, model, global_batch=24, extra_parameters=[extra])
    head, backbone = optimizer.param_groups
    assert (head["name"], backbone["name"]) == ("head", "backbone")
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(_is_backbone(names[id(p)]) for p in backbone["params"])
    assert {names.get(id(p), "loss") for p in head["params"]} == {"pool.gem.p", "head.weight", "head.bias",
                                                                   "neck.weight", "neck.bias", "loss"}
    assert len(head["params"]) + len(backbone["params"]) == len(list(model.parameters())) + 1
    assert head["lr"] == pytest.approx(0.003 * (24 / 12) ** 0.5) and backbone["lr"] == pytest.approx(0.1 * head["lr"])
    schedule = build_schedule(optimizer, warmup_steps=3, total_steps=10)
    for _ in range(9):
        optimizer.step()
        schedule.step()
        assert backbone["lr"] == pytest.approx(0.1 * head["lr"]) and head["lr"] > 0
    assert len(build_optimizer(_config().optim, model, global_batch=24).param_groups) == 1  # no option: one group


def test_frozen_norm_keeps_statistics_and_affine_across_train_and_eval_switches():
    model = build_model(_config("model.norm=batch", "model.freeze_norm=true").model)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(isinstance(m, FrozenBatchNorm2d) for m in norms)
    with torch.no_grad():
        for m in norms:
            m.running_mean.uniform_(-1, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = build_optimizer(_config().optim, model, global_batch=12)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for mode in (True, False, True):
        model.train(mode)
        assert not any(m.training for m in norms)
        out = model(torch.randn(6, 3, 24, 24))
        (out[:, :3].sum() - out[:, 3:].sum()).backward()
    for m in norms:
        assert m.weight.grad is None and m.bias.grad is None and id(m.weight) not in optimized
    after = model.state_dict()
    assert len(_norm_keys(model)) == 5 * len(norms)
    assert all(torch.equal(before[k], after[k]) for k in _norm_keys(model))
    # Same tensor names as the unfrozen model, so files and checkpoints load either way.
    assert list(after) == list(build_model(_config("model.norm=batch").model).state_dict())


def test_freeze_norm_needs_batch_norm_and_fine_tuning_needs_a_backbone():
    with pytest.raises(ConfigError, match=r"model\.freeze_norm: backbone 'resnet' with model\.norm='group' has no "
                                          "BatchNorm layer"):
        build_model(_config("model.freeze_norm=true").model)
    with pytest.raises(ConfigError, match=r"optim\.backbone_lr_scale / model\.freeze_backbone_steps: the model has "
                                          "no backbone"):
        build_optimizer(_config("optim.backbone_lr_scale=0.5").optim, torch.nn.Linear(3, 3), global_batch=12)
    with pytest.raises(ConfigError, match=r"model\.freeze_backbone_steps: must be an integer >= 0, got -1"):
        _config("model.freeze_backbone_steps=-1")
    with pytest.raises(ConfigError, match=r"optim\.backbone_lr_scale: must be a finite number >= 0, got -0\.5"):
        _config("optim.backbone_lr_scale=-0.5")


def test_freeze_hook_zeroes_only_the_backbone_group_until_the_step_count_is_reached():
    class Loop:  # the hook reads the step count from trainer.state
        class state:
            global_step = 0

    optimizer = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.ones(1))], "name": "head", "lr": 0.1},
                                 {"params": [torch.nn.Parameter(torch.ones(1))], "name": "backbone", "lr": 0.05}])
    hook = FreezeBackboneHook(optimizer, steps=2)
    hook.trainer = Loop()
    seen = []
    for step in range(4):
        Loop.state.global_step = step
        for group, lr in zip(optimizer.param_groups, (0.1, 0.05)):
            group["lr"] = lr  # what the schedule sets before the hooks run
        hook.after_step()
        seen.append([group["lr"] for group in optimizer.param_groups])
    assert seen == [[0.1, 0.0], [0.1, 0.0], [0.1, 0.05], [0.1, 0.05]]


def _run(tmp_path: Path, name: str, *extra: str):
    workspace = tmp_path / name
    train(_config(*FINETUNE, f"workspace={workspace}", *extra), Backend())
    return load_checkpoint(workspace / "checkpoints" / "last.pt")


FINETUNE = ["model.norm=batch", "model.freeze_norm=true", "optim.backbone_lr_scale=0.5",
            "model.freeze_backbone_steps=4", "optim.name=sgd"]


def _split(model: dict) -> tuple[dict, dict]:
    return ({k: v for k, v in model.items() if _is_backbone(k)}, {k: v for k, v in model.items() if not _is_backbone(k)})


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fine_tuning_options_survive_resume_and_match_an_uninterrupted_run(tmp_path):
    start_backbone, start_head = _split(_run(tmp_path, "start", "train.max_steps=0")["model"])
    early = _run(tmp_path, "parts", "train.max_steps=2")  # stopped at s = 2 < N = 4
    backbone, head = _split(early["model"])
    assert _same(backbone, start_backbone) and not _same(head, start_head)
    frozen = _run(tmp_path, "parts", "train.max_steps=4")  # resumed at 2: still frozen through step N
    assert _same(_split(frozen["model"])[0], start_backbone)
    assert [g["name"] for g in frozen["optimizer"]["param_groups"]] == ["head", "backbone"]
    final = _run(tmp_path, "parts", "train.max_steps=7")  # resumed at N: the backbone trains
    backbone, _ = _split(final["model"])
    moved = [k for k in backbone if not torch.equal(backbone[k], start_backbone[k])]
    norms = _norm_keys(build_model(_config(*FINETUNE).model))
    assert norms and not norms & set(moved)  # the norms stay frozen
    assert set(moved) == {k for k in backbone if k not in norms}  # every convolution trains
    whole = _run(tmp_path, "whole", "train.max_steps=7")
    assert _same(final["model"], whole["model"])
    groups = final["optimizer"]["param_groups"]
    assert groups == whole["optimizer"]["param_groups"]
    assert groups[1]["lr"] == pytest.approx(0.5 * groups[0]["lr"]) and groups[1]["lr"] > 0


def test_the_documented_fine_tuning_snippet_is_a_valid_config(tmp_path):
    import re

    import yaml

    manual = (Path(__file__).resolve().parents[3] / "docs" / "trainer.md").read_text()
    snippet = next(b for b in re.findall(r"```yaml\n(.*?)```", manual, flags=re.S) if "backbone: resnet50" in b)
    tree = yaml.safe_load(snippet)
    weights = tmp_path / "resnet50.pth"
    tree["model"]["pretrained"] = str(weights)
    path = tmp_path / "finetune.yaml"
    path.write_text(yaml.safe_dump(tree))
    config = load_config(path, environ={})
    assert config.model.backbone == "resnet50" and config.optim.backbone_lr_scale == 0.1
    model = build_model(config.model, image_size=config.data.image_size)
    assert isinstance(model.backbone.bn1, FrozenBatchNorm2d)
    groups = build_optimizer(config.optim, model, global_batch=64,
                             freeze_backbone_steps=config.model.freeze_backbone_steps).param_groups
    assert [g["name"] for g in groups] == ["head", "backbone"]

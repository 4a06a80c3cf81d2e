"""Standard backbones: torchvision/timm tensor names, pretrained files through model.pretrained, timm parity.

timm is the reference (tests/reference_models.py): its ResNets carry
torchvision's names and computation, its ViT defines the ViT names. The
tests make timm models with random weights (and random BatchNorm
statistics, so that loading them matters), write their state dicts as
``.pth`` and ``.safetensors`` files, load those through ``model.pretrained``
and compare the outputs in fp32.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from reference_models import import_timm
from safetensors.torch import save_file

from pksampler.train.config.load import ConfigError, load_config
from pksampler.train.runtime.distributed import Backend
from pksampler.train.modeling.model import build_model
from pksampler.train.modeling.pretrained import load_backbone_weights, load_pretrained
from pksampler.train.modeling.resnet import resnet
from pksampler.train.modeling.vit import VisionTransformer, vit

TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def _shapes(state: dict) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in state.items()}


def _randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights and BatchNorm statistics, so that a wrongly mapped tensor shows in the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point():
                noise = torch.rand(tensor.shape, generator=generator)
                tensor.copy_(noise + 0.5 if name.endswith("running_var") else (noise - 0.5) * 0.2)
    return model.eval()


def _timm(name: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return import_timm().create_model(name, pretrained=False, **kwargs)


def _config(backbone: str, pretrained: Path | None = None, *extra: str):
    overrides = [f"model.backbone={backbone}", *extra]
    if pretrained is not None:
        overrides.append(f"model.pretrained={pretrained}")
    return load_config(None, overrides, environ={}).model


def _loaded(backbone: str, path: Path, *, image_size: int = 224, **kwargs) -> torch.nn.Module:
    model = build_model(_config(backbone, path, *[f"model.{k}={v}" for k, v in kwargs.items()]), image_size=image_size)
    load_pretrained(model, str(path), Backend(), name=backbone)
    return model.eval()


# Names and shapes only: built on the meta device (no memory, no initialisation).
@pytest.mark.parametrize("name", ["resnet18", "resnet34", "resnet50", "resnet101"])
def test_resnet_tensor_names_and_shapes_are_torchvisions(name):
    with torch.device("meta"):
        reference, ours = _timm(name).state_dict(), resnet(name).state_dict()
    assert _shapes(ours) == {k: v for k, v in _shapes(reference).items() if not k.startswith("fc.")}


@pytest.mark.parametrize("name", ["vit_small_patch16", "vit_base_patch16"])
def test_vit_tensor_names_and_shapes_are_timms(name):
    with torch.device("meta"):
        reference, ours = _timm(f"{name}_224").state_dict(), vit(name).state_dict()
    assert _shapes(ours) == {k: v for k, v in _shapes(reference).items() if not k.startswith("head.")}


@pytest.mark.parametrize("name, suffix", [("resnet50", ".pth"), ("resnet18", ".safetensors")])
def test_a_resnet_file_loads_through_model_pretrained_and_gives_the_references_outputs(tmp_path, name, suffix):
    reference = _randomised(_timm(name), seed=1)
    path = tmp_path / f"{name}{suffix}"
    state = reference.state_dict()
    save_file(state, str(path)) if suffix == ".safetensors" else torch.save(state, path)
    model = _loaded(name, path)
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.backbone(images), reference.forward_features(images), **TOLERANCE)
        # The classifier was left out; everything else came from the file.
        ours = model.backbone.state_dict()
        assert all(torch.equal(ours[k], state[k]) for k in ours)


def test_a_vit_safetensors_file_gives_timms_tokens(tmp_path):
    reference = _randomised(_timm("vit_small_patch16_224", img_size=32), seed=2)
    path = tmp_path / "vit_small.safetensors"
    save_file(reference.state_dict(), str(path))
    model = _loaded("vit_small_patch16", path, image_size=32)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.backbone.forward_tokens(images), reference.forward_features(images),
                                   **TOLERANCE)
        # The embedding pools the patch tokens: timm's global_pool='avg' over the same tokens.
        pooled = reference.forward_features(images)[:, 1:].mean(dim=1)
        torch.testing.assert_close(model.pool(model.backbone(images)), pooled, **TOLERANCE)


def test_vit_position_embeddings_are_resampled_for_another_image_size_as_timm_does(tmp_path):
    # Weights learnt at 224 px (14 x 14 patches), fine-tuned at 48 px (3 x 3): timm resamples at run time.
    # Two blocks suffice to see the position embeddings act.
    reference = _randomised(_timm("vit_small_patch16_224", dynamic_img_size=True, depth=2), seed=3)
    path = tmp_path / "vit_224.pth"
    torch.save(reference.state_dict(), path)
    trunk = VisionTransformer(384, 2, 6, image_size=48)
    load_backbone_weights(trunk, path)
    assert trunk.pos_embed.shape == (1, 1 + 9, 384)
    assert torch.equal(trunk.pos_embed[:, 0], reference.pos_embed[:, 0])  # the class token's row is kept
    images = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        torch.testing.assert_close(trunk.forward_tokens(images), reference.forward_features(images), **TOLERANCE)
        # An image of yet another size is resampled from the 3 x 3 grid at run time, as timm's
        # dynamic_img_size does with the same weights.
        at_48 = _timm("vit_small_patch16_224", img_size=48, dynamic_img_size=True, depth=2).eval()
        missing, unexpected = at_48.load_state_dict(trunk.state_dict(), strict=False)
        assert sorted(missing) == ["head.bias", "head.weight"] and not unexpected
        other = torch.randn(1, 3, 80, 64)
        torch.testing.assert_close(trunk.forward_tokens(other), at_48.forward_features(other), **TOLERANCE)


def _resnet18_file(tmp_path: Path, change) -> Path:
    state = dict(_randomised(_timm("resnet18"), seed=4).state_dict())
    change(state)
    path = tmp_path / "weights.pth"
    torch.save(state, path)
    return path


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("layer4.1.bn2.running_var"), r"1 missing from the file: layer4\.1\.bn2\.running_var"),
    (lambda s: s.update({"layer5.0.conv1.weight": torch.zeros(3)}), r"1 unexpected: layer5\.0\.conv1\.weight"),
    (lambda s: s.update({"conv1.weight": torch.zeros(64, 3, 3, 3)}),
     r"1 of another shape: conv1\.weight \(file \(64, 3, 3, 3\), backbone \(64, 3, 7, 7\)\)"),
])
def test_a_file_that_does_not_fit_is_refused_naming_the_tensor_and_the_file(tmp_path, change, message):
    path = _resnet18_file(tmp_path, change)
    model = build_model(_config("resnet18", path))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=rf"model\.pretrained: {path} does not fit backbone 'resnet18': {message}"):
        load_pretrained(model, str(path), Backend(), name="resnet18")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing half-loaded


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pth"
    torch.save({"conv1.weight": torch.zeros(1), "payload": _Payload()}, path)
    with pytest.raises(ConfigError, match=rf"model\.pretrained: {path} was refused: it holds objects other than "
                                          "tensors"):
        load_backbone_weights(resnet("resnet18"), path)
    assert not (tmp_path / "pwned").exists()


def test_checkpoint_wrappers_and_ddp_prefixes_are_unwrapped_and_the_classifier_ignored(tmp_path):
    state = _randomised(_timm("resnet18"), seed=5).state_dict()
    wrapped = {"epoch": 3, "state_dict": {f"module.{k}": v for k, v in state.items()}}
    path = tmp_path / "checkpoint.pth"
    torch.save(wrapped, path)
    trunk = resnet("resnet18")
    ignored = load_backbone_weights(trunk, path)
    assert ignored == ["fc.bias", "fc.weight"]
    assert torch.equal(trunk.layer3[1].bn2.running_mean, state["layer3.1.bn2.running_mean"])
    torch.save({"model": state, "optimizer": {"lr": 0.1}}, path)
    load_backbone_weights(resnet("resnet18"), path)
    # num_batches_tracked is optional (timm's files leave it out).
    save_file({k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}, str(tmp_path / "t.safetensors"))
    load_backbone_weights(resnet("resnet18"), tmp_path / "t.safetensors")


def test_unreadable_or_missing_files_and_wrong_options_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.pretrained: no such file: .*nothing\.pth"):
        load_backbone_weights(resnet("resnet18"), tmp_path / "nothing.pth")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match=r"model\.pretrained: .*bad\.safetensors is not a readable \.safetensors"):
        load_backbone_weights(resnet("resnet18"), tmp_path / "bad.safetensors")
    with pytest.raises(ConfigError, match=r"model\.norm: pretrained ResNet weights were trained with BatchNorm"):
        build_model(_config("resnet50", tmp_path / "x.pth", "model.norm=group"))
    with pytest.raises(ConfigError, match=r"model\.pretrained: the demo backbone 'resnet' has no published weights"):
        build_model(_config("resnet", tmp_path / "x.pth"))
    with pytest.raises(ConfigError, match=r"model\.pooling: 'gem' needs non-negative features"):
        build_model(_config("vit_small_patch16", None, "model.pooling=gem"))
    with pytest.raises(ConfigError, match=r"model\.backbone: must be one of \['resnet', 'resnet18'.* or "
                                          r"torchvision:<Name>, got 'resnet152'"):
        _config("resnet152")


@pytest.mark.parametrize("norm", ["group", "batch", "none"])
def test_model_norm_sets_the_resnets_normalisation(norm):
    model = build_model(_config("resnet18", None, f"model.norm={norm}", "model.pooling=gem"), image_size=32)
    kind = {"group": torch.nn.GroupNorm, "batch": torch.nn.BatchNorm2d, "none": torch.nn.Identity}[norm]
    assert type(model.backbone.layer2[0].bn1) is kind and type(model.backbone.layer2[0].downsample[1]) is kind
    out = model.train()(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 64) and torch.allclose(out.norm(dim=1), torch.ones(2), atol=1e-5)


def test_a_pretrained_file_reaches_the_model_through_the_trainer(tmp_path):
    from pksampler.train.engine.checkpoint import load_checkpoint
    from pksampler.train.run_setup import train

    state = _randomised(_timm("resnet18"), seed=6).state_dict()
    path = tmp_path / "resnet18.safetensors"
    save_file(state, str(path))
    config = load_config(None, [
        "data.args={num_classes: 12, images_per_class: 4, image_size: 32}", "data.image_size=32",
        "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=2",
        "model.backbone=resnet18", "model.norm=batch", f"model.pretrained={path}", "train.max_steps=0",
        "train.tensorboard=false", f"workspace={tmp_path / 'run'}"], environ={})
    train(config, Backend())
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["model"]
    assert all(torch.equal(saved[f"backbone.{k}"], v) for k, v in state.items() if not k.startswith("fc."))


def test_a_plain_pretrained_resnet50_trains_with_its_own_frozen_batch_norm(tmp_path):
    """``model.backbone=resnet50 model.pretrained=FILE`` and nothing else: BatchNorm, frozen, every tensor loaded."""
    from pksampler.train.engine.checkpoint import load_checkpoint
    from pksampler.train.modeling.frozen_norm import FrozenBatchNorm2d
    from pksampler.train.run_setup import train

    with torch.device("meta"):
        names = list(_timm("resnet50").state_dict())
    state = _randomised(resnet("resnet50"), seed=3).state_dict()
    path = tmp_path / "resnet50.pth"
    torch.save({k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}, path)
    config = load_config(None, [
        "data.args={num_classes: 8, images_per_class: 4, image_size: 32}", "data.image_size=32", "data.workers=0",
        "sampler.classes_per_step=2", "sampler.samples_per_class=2", "model.backbone=resnet50",
        f"model.pretrained={path}", "train.max_steps=1", "train.tensorboard=false", f"workspace={tmp_path / 'run'}"],
        environ={})
    assert config.model.norm == "auto" and config.model.freeze_norm is None
    model = build_model(config.model, image_size=32)
    assert all(type(m) is FrozenBatchNorm2d for m in model.backbone.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert type(model.backbone.bn1) is FrozenBatchNorm2d
    result = train(config, Backend())
    assert result.global_step == 1
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["model"]
    loaded = [k for k in names if not k.startswith("fc.")]
    assert len(loaded) == 318 and all(f"backbone.{k}" in saved for k in loaded)
    # frozen statistics stay exactly as loaded after a training step
    assert all(torch.equal(saved[f"backbone.{k}"], state[k]) for k in loaded if "running_" in k)


@pytest.mark.parametrize(("backbone", "pretrained", "extra", "norm", "frozen"), [
    ("resnet", False, [], "group", False),  # the demo network keeps group norm (small per-rank batches)
    ("resnet18", False, [], "batch", False),  # a ResNet from scratch: its own BatchNorm, training
    ("resnet18", True, [], "batch", True),  # fine-tuning: frozen, as detectron2 does
    ("resnet18", True, ["model.freeze_norm=false"], "batch", False),  # an explicit value wins
    ("resnet18", False, ["model.norm=group"], "group", False),
    ("vit_small_patch16", True, [], "none", False),  # LayerNorm is the ViT's own; nothing to freeze
])
def test_model_norm_auto_is_the_backbones_own(tmp_path, backbone, pretrained, extra, norm, frozen):
    from pksampler.train.modeling.model import resolve_norm

    overrides = [f"model.backbone={backbone}", *extra] + ([f"model.pretrained={tmp_path / 'w.pth'}"] if pretrained else [])
    resolved = resolve_norm(load_config(None, overrides, environ={}).model)
    assert (resolved.norm, resolved.freeze_norm) == (norm, frozen)


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update({7: torch.zeros(1)}), r"tensor names must be strings, found 7"),
    (lambda s: s.update({"conv1.weight": torch.empty(64, 3, 7, 7, device="meta")}),
     r"tensors must be dense and hold values, found conv1\.weight \(meta\)"),
    (lambda s: s.update({"conv1.weight": torch.zeros(64, 3, 7, 7).to_sparse()}),
     r"tensors must be dense and hold values, found conv1\.weight \(torch\.sparse_coo\)"),
])
def test_pretrained_files_with_odd_names_or_tensors_are_refused_in_one_line(tmp_path, change, message):
    backbone = resnet("resnet18")
    state = dict(backbone.state_dict())
    change(state)
    path = tmp_path / "weights.pth"
    torch.save(state, path)
    with pytest.raises(ConfigError, match=rf"model\.pretrained: {path}: {message}"):
        load_backbone_weights(backbone, path)


def test_a_vit_pos_embed_holding_only_the_class_token_is_named_as_mis_shaped(tmp_path):
    backbone = vit("vit_small_patch16", image_size=32)
    state = dict(backbone.state_dict())
    state["pos_embed"] = state["pos_embed"][:, :1].clone()
    path = tmp_path / "weights.pth"
    torch.save(state, path)
    with pytest.raises(ConfigError, match=r"1 of another shape: pos_embed \(file \(1, 1, 384\)"):
        load_backbone_weights(backbone, path)

"""EmbeddingNet options: pooling (avg, GeM, avg+max), embedding neck, norm layers, config wiring."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pksampler.train.config.load import ConfigError, ModelConfig, load_config
from pksampler.train.modeling.model import GeM, EmbeddingNet, build_model, norm_factory

POOLINGS = ("avg", "gem", "avgmax")
NECKS = ("none", "batch", "layer")


def _net(**options) -> EmbeddingNet:
    torch.manual_seed(0)
    return EmbeddingNet(width=8, depth=(1, 1), embedding_dim=12, **options)


@pytest.mark.parametrize("neck", NECKS)
@pytest.mark.parametrize("pooling", POOLINGS)
def test_every_option_gives_unit_embeddings_and_gradients_reach_every_parameter(pooling, neck):
    model = _net(pooling=pooling, neck=neck)
    images = torch.randn(6, 3, 20, 20)
    out = model(images)
    assert out.shape == (6, 12)
    assert torch.allclose(out.norm(dim=1), torch.ones(6), atol=1e-5)
    # A loss that depends on every output coordinate, so every parameter gets a gradient.
    (out @ torch.randn(12, 12) * out).sum().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing
    assert all(float(p.grad.abs().sum()) > 0 for name, p in model.named_parameters() if name.startswith(("head", "stem")))


def test_stem_stride_halves_the_resolution_the_stages_see():
    images = torch.randn(2, 3, 32, 32)
    full, strided = _net(), _net(stem_stride=2)
    assert full.stem(images).shape[-2:] == (32, 32) and strided.stem(images).shape[-2:] == (16, 16)
    assert strided(images).shape == (2, 12)
    config = load_config(None, ["model.stem_stride=2", "model.width=8", "model.depth=[1]"], environ={}).model
    assert build_model(config).stem[0].stride == (2, 2)
    with pytest.raises(ConfigError, match=r"model.stem_stride: must be an integer in \[1, 4\], got 0"):
        load_config(None, ["model.stem_stride=0"], environ={})


def test_avgmax_concatenates_two_poolings():
    assert _net(pooling="avgmax").head.in_features == 2 * _net().head.in_features


def test_gem_pooling_matches_its_definition_and_learns_p():
    pool = GeM(p=3.0)
    x = torch.rand(2, 4, 5, 5) + 0.1
    assert torch.allclose(pool(x), x.pow(3).mean(dim=(2, 3)).pow(1 / 3), atol=1e-6)
    # p = 1 is average pooling; a large p approaches max pooling.
    assert torch.allclose(GeM(p=1.0)(x), x.mean(dim=(2, 3)), atol=1e-6)
    assert torch.allclose(GeM(p=80.0)(x), x.amax(dim=(2, 3)), rtol=0.06)
    pool(x).sum().backward()
    assert pool.p.grad is not None and float(pool.p.grad.abs()) > 0


def test_gem_is_finite_on_zero_features():
    out = GeM()(torch.zeros(2, 3, 4, 4))
    assert torch.isfinite(out).all()


def test_batch_neck_uses_batch_statistics_in_training_and_running_ones_in_eval():
    model = _net(neck="batch")
    assert isinstance(model.neck, torch.nn.BatchNorm1d)
    images = torch.randn(8, 3, 20, 20)
    model.train()
    first = model(images)
    model.eval()
    second = model(images)
    assert not torch.allclose(first, second, atol=1e-4)  # running statistics after one step differ from the batch's
    assert torch.allclose(model(images[:1]), second[:1], atol=1e-5)  # eval: an item's embedding ignores the batch


def test_layer_neck_does_not_depend_on_the_batch():
    model = _net(neck="layer").train()
    images = torch.randn(6, 3, 20, 20)
    assert torch.allclose(model(images)[:2], model(images[:2]), atol=1e-5)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_pool_norm_centres_each_pooled_feature_per_image_and_adds_no_parameters(pooling):
    plain, normed = _net(pooling=pooling), _net(pooling=pooling, pool_norm=True)
    images = torch.randn(5, 3, 20, 20)
    features = normed.stages(normed.stem(images))
    pooled = normed.pool(features)
    assert torch.allclose(pooled.mean(dim=1), torch.zeros(5), atol=1e-5)
    assert torch.allclose(pooled.var(dim=1, unbiased=False), torch.ones(5), atol=1e-3)
    assert not torch.allclose(plain.pool(features).mean(dim=1), torch.zeros(5), atol=1e-2)  # ReLU maps: positive
    assert normed.state_dict().keys() == plain.state_dict().keys()  # a checkpoint loads either way
    assert torch.allclose(normed(images)[:2], normed(images[:2]), atol=1e-5)  # per image: no batch statistics
    config = load_config(None, ["model.pool_norm=true", "model.width=8", "model.depth=[1]"], environ={})
    assert build_model(config.model).pool.layer_norm is True
    with pytest.raises(ConfigError, match="model.pool_norm"):
        load_config(None, ["model.pool_norm=maybe"], environ={})


def test_default_model_is_unchanged_by_the_new_options():
    default, explicit = _net(), _net(pooling="avg", neck="none")
    assert isinstance(default.neck, torch.nn.Identity)
    images = torch.randn(3, 3, 20, 20)
    assert torch.equal(default(images), explicit(images))
    assert [n for n, _ in default.named_parameters()] == [n for n, _ in explicit.named_parameters()]


@pytest.mark.parametrize("norm", ["group", "batch", "none"])
def test_norm_options_build_and_train(norm):
    config = dataclasses.replace(ModelConfig(), width=8, depth=(1, 1), embedding_dim=10, norm=norm, pooling="gem")
    model = build_model(config)
    out = model(torch.randn(4, 3, 16, 16))
    assert out.shape == (4, 10)
    out.sum().backward()
    assert model.stem[0].weight.grad is not None


def test_bad_options_name_the_key_and_value():
    with pytest.raises(ValueError, match=r"model.pooling must be one of .*'max'"):
        _net(pooling="max")
    with pytest.raises(ValueError, match=r"model.neck must be one of .*'bn'"):
        _net(neck="bn")


def test_config_fields_reach_the_model(tmp_path):
    config = load_config(None, ["model.pooling=avgmax", "model.neck=layer", "model.width=8", "model.depth=[1]"],
                         environ={})
    model = build_model(config.model)
    assert isinstance(model.neck, torch.nn.LayerNorm) and model.head.in_features == 16
    with pytest.raises(ConfigError, match="unknown config key model.'pool'"):
        load_config(None, ["model.pool=gem"], environ={})


def test_folder_config_loads_and_builds():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    config = load_config(root / "configs" / "folder.yaml", ["data.root=/nonexistent"], environ={})
    assert config.data.name == "folder" and dict(config.data.args) == {}
    model = build_model(config.model)
    assert model(torch.randn(2, 3, config.data.image_size, config.data.image_size)).shape == (2, config.model.embedding_dim)


def test_batch_neck_stays_batchnorm1d_with_a_sync_class_and_torchvision_refuses_other_poolings():
    class FakeSync(torch.nn.BatchNorm1d):
        pass

    config = dataclasses.replace(ModelConfig(), width=8, depth=(1,), neck="batch")
    assert type(build_model(config, sync_batch_norm=FakeSync).neck) is torch.nn.BatchNorm1d  # the step syncs it
    assert type(build_model(config).neck) is torch.nn.BatchNorm1d
    with pytest.raises(ValueError, match="model.pooling='gem' applies to our own backbones only"):
        build_model(dataclasses.replace(config, backbone="torchvision:resnet18", pooling="gem"))


def test_model_outputs_unit_embeddings():
    model = EmbeddingNet(width=8, depth=(1, 1), embedding_dim=12)
    out = model(torch.randn(5, 3, 24, 24))
    assert out.shape == (5, 12)
    assert torch.allclose(out.norm(dim=1), torch.ones(5), atol=1e-5)
    with pytest.raises(ValueError, match="model.norm must be one of"):
        norm_factory("layer")

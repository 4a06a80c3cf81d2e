"""A checkpoint written before the head recipe (issue 37) still loads for embedding, search and export.

Its config has ``head.lr_scale`` (a key since replaced by ``head.lr``, ``head.momentum`` and
``head.weight_decay``) and no ``model.projection_bias`` (every run before the key had the bias, head or not).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pksampler.train.catalogue.model import load_model
from pksampler.train.config.load import build_config
from pksampler.train.engine.checkpoint import save_checkpoint
from pksampler.train.modeling.model import build_model


def _old_checkpoint(path, head_name):
    config = build_config({"data": {"image_size": 24}, "model": {"width": 8, "depth": [1, 1], "embedding_dim": 16}})
    model_config = dataclasses.replace(config.model, projection_bias=True)  # the bias every old run had
    torch.manual_seed(0)
    model = build_model(model_config, image_size=24)
    tree = config.to_dict()
    tree["model"].pop("projection_bias")
    tree["head"] = {"name": head_name, "scale": 30.0, "margin": 0.3, "negatives": 8192, "subcentres": 1,
                    "weight": 1.0, "lr_scale": 1.0, "bnneck": False}  # the head block as it was saved then
    save_checkpoint(path, {"format": 2, "config": tree, "model": model.state_dict()})
    return model


@pytest.mark.parametrize("head_name", [None, "arcface"])
def test_a_checkpoint_from_before_the_head_recipe_loads_and_embeds_as_it_did(tmp_path, head_name):
    model = _old_checkpoint(tmp_path / "best.pt", head_name)
    loaded = load_model(tmp_path / "best.pt")
    images = torch.rand(3, 3, 24, 24)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(loaded.network(images), model(images), atol=1e-6)

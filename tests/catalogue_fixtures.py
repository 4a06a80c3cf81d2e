"""A checkpoint and a folder of real image files for the catalogue tests, made in a second or two."""

from __future__ import annotations

from pathlib import Path

import torch

from pksampler.datasets import SyntheticProducts
from pksampler.train.config.load import build_config
from pksampler.train.engine.checkpoint import save_checkpoint
from pksampler.train.modeling.model import build_model


def make_checkpoint(path: Path, *, image_size: int = 24, embedding_dim: int = 16, seed: int = 0) -> Path:
    """A training checkpoint (model tensors and config) of a small demo network with seeded random weights."""
    config = build_config({"data": {"image_size": image_size},
                           "model": {"width": 8, "depth": [1, 1], "embedding_dim": embedding_dim}})
    torch.manual_seed(seed)
    model = build_model(config.model, image_size=image_size)
    save_checkpoint(path, {"format": 2, "config": config.to_dict(), "model": model.state_dict()})
    return path


def render_folder(root: Path, *, classes: int, per_class: int, image_size: int = 40) -> Path:
    """``root/<class>/<view>.png``: real PNG files of the synthetic products."""
    SyntheticProducts(classes, per_class, image_size=image_size, root=root)
    return root

"""Frozen BatchNorm (``model.freeze_norm``): stored statistics and affine parameters, never updated.

Fine-tuning with a few dozen images per rank gives poor batch statistics;
detectron2 and most retrieval recipes freeze the pretrained ones instead.
The frozen layer is a BatchNorm2d subclass, so its tensors keep BatchNorm's
names (``weight``, ``bias``, ``running_mean``, ``running_var``,
``num_batches_tracked``) and pretrained files and checkpoints load unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["FrozenBatchNorm2d", "freeze_batch_norm"]


class FrozenBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d that always normalises with its stored statistics and never learns its affine parameters.

    ``train()`` leaves it in eval mode, so switching the model between
    training and evaluation never updates the running statistics; the weight
    and bias do not require gradients, so the optimizer never sees them.
    """

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__(num_features, eps=eps)
        self.weight.requires_grad_(False)
        self.bias.requires_grad_(False)
        super().train(False)

    def train(self, mode: bool = True) -> "FrozenBatchNorm2d":
        return super().train(False)

    @classmethod
    def from_batch_norm(cls, layer: _BatchNorm) -> "FrozenBatchNorm2d":
        frozen = cls(layer.num_features, eps=layer.eps)
        with torch.no_grad():
            if layer.affine:
                frozen.weight.copy_(layer.weight)
                frozen.bias.copy_(layer.bias)
            if layer.track_running_stats:
                frozen.running_mean.copy_(layer.running_mean)
                frozen.running_var.copy_(layer.running_var)
                frozen.num_batches_tracked.copy_(layer.num_batches_tracked)
        return frozen.to(device=layer.running_mean.device if layer.running_mean is not None else None)


def freeze_batch_norm(module: nn.Module) -> int:
    """Replace every BatchNorm (SyncBatchNorm included) under ``module`` by a FrozenBatchNorm2d; returns how many."""
    replaced = 0
    for name, child in module.named_children():
        if isinstance(child, _BatchNorm) and not isinstance(child, FrozenBatchNorm2d):
            if isinstance(child, nn.BatchNorm1d):
                continue  # a 1-d norm is an embedding neck, not part of a convolutional trunk
            setattr(module, name, FrozenBatchNorm2d.from_batch_norm(child))
            replaced += 1
        else:
            replaced += freeze_batch_norm(child)
    return replaced

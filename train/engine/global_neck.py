"""The model's BatchNorm neck applied by the step to the all-gathered global batch.

A ``BatchNorm1d`` inside each rank's forward pass normalises that rank's
P×K rows: its statistics, and so the model, change with the world size (at
G = 16 classes and 16 ranks a rank's batch is one class). The step already
all-gathers the embeddings with their gradient; the neck applied to the
gathered G·K rows is one process's batch norm on the global batch, with the
same running statistics on every rank and no new collective (the
``BatchNorm1d``-after-the-gather that SimCLR's and MoCo's synced BN
approximate).

Gradient scale: every rank computes the neck on the same rows, so every rank
holds the whole gradient of its weight and bias, times the trainer's
gathered-loss factor (Horovod: W, which its optimizer then averages; torch:
1). :class:`GlobalNeck` divides by that factor, and torch's DDP is told to
leave the neck out of its averaging (:attr:`GlobalNeck.names`): both give
one process's gradient.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pksampler.train.modeling.frozen_norm import FrozenBatchNorm2d
from pksampler.train.modeling.model import NeckedEmbedding, global_neck

__all__ = ["GlobalNeck", "per_rank_norms"]


class GlobalNeck:
    """``model.finish`` (the neck and the L2 norm) for the gathered batch, its gradient brought to one process's.

    Args:
        model: one of our networks with a BatchNorm neck (:func:`~pksampler.train.modeling.model.global_neck`
            has switched its train-mode forward to stop before the neck).
        grad_divisor: the gathered loss's factor now (``Backend.gathered_loss_scale``; read at every backward,
            so a Horovod elastic reset that changes the world changes it).
    """

    def __init__(self, model: NeckedEmbedding, grad_divisor: Callable[[], float]) -> None:
        self.module: nn.Module = model.neck
        self.finish = model.finish
        self.grad_divisor = grad_divisor
        #: the neck's tensors by their names in the model's state dict (for DDP to leave alone)
        self.names = [f"neck.{name}" for name, _ in model.neck.named_parameters()] + \
                     [f"neck.{name}" for name, _ in model.neck.named_buffers()]
        for parameter in model.neck.parameters():
            parameter.register_hook(self._rescale)

    @classmethod
    def of(cls, model: nn.Module, grad_divisor: Callable[[], float]) -> "GlobalNeck | None":
        """The global neck of ``model``, or None when it has none that depends on the batch."""
        return cls(model, grad_divisor) if global_neck(model) is not None else None

    def _rescale(self, grad: torch.Tensor) -> torch.Tensor:
        divisor = self.grad_divisor()
        return grad if divisor == 1 else grad / divisor

    def __call__(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The neck (batch statistics of all of ``embeddings``, at least two rows) and the L2 norm."""
        if embeddings.shape[0] < 2:
            raise ValueError(f"model.neck: 'batch' normalises over the global batch and needs at least 2 "
                             f"embeddings, got {embeddings.shape[0]}")
        return self.finish(embeddings)


def per_rank_norms(model: nn.Module, *, apart: nn.Module | None = None) -> list[str]:
    """Names of ``model``'s BatchNorm layers that normalise each rank's own batch in training, ``apart`` aside.

    Frozen BatchNorm (a pretrained backbone's default) keeps its statistics and
    SyncBatchNorm combines every rank's: neither is named. What remains makes
    the model depend on the world size (docs/trainer.md).
    """
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module is not apart
            and not isinstance(module, (nn.SyncBatchNorm, FrozenBatchNorm2d))]

"""BatchNorm running statistics averaged over the ranks after each epoch.

A BatchNorm layer in train mode inside the forward pass (``model.norm: batch``)
normalises each rank's own batch and keeps running statistics of it, so the
ranks' running statistics drift apart: torch's DDP copies rank 0's to every
rank at each forward, Horovod copies nothing. Evaluation embeds the held-out
set on every rank with the statistics that rank holds, and ``last.pt`` keeps
rank 0's. :class:`NormStatisticsHook` replaces every rank's running mean and
variance by their mean over the ranks after each epoch (timm's
``distribute_bn(reduce=True)``), before the epoch's checkpoint and
evaluation, so both read statistics of the whole world's batches, the same on
every rank. The neck on the gathered batch
(:mod:`.global_neck`) is left out: its statistics already are the same on
every rank.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pksampler.train.engine.hooks import HookBase

__all__ = ["NormStatisticsHook", "running_statistics"]


def running_statistics(model: nn.Module, *, apart: nn.Module | None = None) -> list[torch.Tensor]:
    """The running mean and variance of every BatchNorm layer of ``model`` that keeps them, but ``apart``."""
    return [buffer for module in model.modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None
            and module is not apart
            for buffer in (module.running_mean, module.running_var)]


class NormStatisticsHook(HookBase):
    """After each epoch, every rank's BatchNorm running statistics become their mean over the ranks."""

    def __init__(self, model: nn.Module, allreduce_mean: Callable[[torch.Tensor], Any], *,
                 apart: nn.Module | None = None) -> None:
        self.model, self.allreduce_mean, self.apart = model, allreduce_mean, apart

    def after_epoch(self) -> None:
        buffers = running_statistics(self.model, apart=self.apart)
        with torch.no_grad():  # one all-reduce for every layer's statistics, then each back in its place
            mean = self.allreduce_mean(torch.cat([buffer.detach().flatten() for buffer in buffers]))
            for buffer, part in zip(buffers, mean.split([buffer.numel() for buffer in buffers])):
                buffer.copy_(part.view_as(buffer))

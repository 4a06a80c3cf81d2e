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

Each rank's statistics are checked before they are averaged: one rank's NaN
(a batch of non-finite activations) would otherwise become every rank's. The
check rides in the same all-reduce (a slot per rank) and stops every rank with
:class:`~.trainer.TrainingDiverged` naming the rank and the statistic. The
mean is checked too: finite statistics near float32's largest value sum to
infinity, and that mean would become every rank's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pksampler.train.engine.hooks import HookBase
from pksampler.train.engine.trainer import TrainingDiverged
from pksampler.world import World

__all__ = ["NormStatisticsHook", "running_statistics"]


def _named_statistics(model: nn.Module, apart: nn.Module | None = None) -> list[tuple[str, torch.Tensor]]:
    return [(f"{name}.{kind}" if name else kind, getattr(module, kind)) for name, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None
            and module is not apart
            for kind in ("running_mean", "running_var")]


def running_statistics(model: nn.Module, *, apart: nn.Module | None = None) -> list[torch.Tensor]:
    """The running mean and variance of every BatchNorm layer of ``model`` that keeps them, but ``apart``."""
    return [buffer for _, buffer in _named_statistics(model, apart)]


class NormStatisticsHook(HookBase):
    """After each epoch, every rank's BatchNorm running statistics become their mean over the ranks.

    ``world`` gives the live rank and size (the backend's), for the per-rank finiteness slots; ``apart`` is a
    layer left out (the neck on the gathered batch, whose statistics agree already).
    """

    def __init__(self, model: nn.Module, allreduce_mean: Callable[[torch.Tensor], Any],
                 world: Callable[[], World], *, apart: nn.Module | None = None) -> None:
        self.model, self.allreduce_mean, self.world, self.apart = model, allreduce_mean, world, apart

    def after_epoch(self) -> None:
        names, buffers = zip(*_named_statistics(self.model, self.apart))
        world = self.world()
        with torch.no_grad():  # one all-reduce for every layer's statistics and the ranks' slots
            flat = torch.cat([buffer.detach().flatten().float() for buffer in buffers])
            bad = [i for i, buffer in enumerate(buffers) if not torch.isfinite(buffer).all()]
            slots = torch.zeros(world.size, dtype=flat.dtype, device=flat.device)
            slots[world.rank] = bad[0] + 1 if bad else 0  # the first non-finite statistic + 1
            mean = self.allreduce_mean(torch.cat([flat, slots]))
            found = torch.round(mean[flat.numel():] * world.size).long().tolist()
            if any(found):
                rank = next(r for r, code in enumerate(found) if code)
                raise TrainingDiverged(
                    f"rank {rank}'s BatchNorm running statistic {names[found[rank] - 1]} holds NaN or infinite "
                    f"values at the end of the epoch ({sum(map(bool, found))} of {world.size} ranks); nothing was "
                    "averaged or written: a batch of non-finite activations reached it on that rank (check that "
                    "rank's data, or fp16 overflow: train.precision)")
            parts = mean[:flat.numel()].split([buffer.numel() for buffer in buffers])
            overflowed = next((i for i, part in enumerate(parts) if not torch.isfinite(part).all()), None)
            if overflowed is not None:  # the same mean on every rank: every rank stops here
                raise TrainingDiverged(
                    f"BatchNorm running statistic {names[overflowed]} is finite on every rank but its mean over the "
                    f"{world.size} ranks is not (the sum overflowed float32); nothing was averaged or written: "
                    "activations near float32's largest value reached it (lower optim.lr, or check the data's scale)")
            for buffer, part in zip(buffers, parts):
                buffer.copy_(part.view_as(buffer))

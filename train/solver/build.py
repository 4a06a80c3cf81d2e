"""The optimizer and its learning-rate schedule (detectron2's ``solver/build.py``).

:data:`OPTIMIZERS` is the one list of optimizer names: the configuration's
``optim.name`` choices come from it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from pksampler.train.solver.finetune import parameter_groups

if TYPE_CHECKING:
    from pksampler.train.config.schema import OptimConfig

__all__ = ["OPTIMIZERS", "build_optimizer", "build_schedule"]


def _sgd(parameters: Any, lr: float, optim: "OptimConfig") -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=lr, momentum=optim.momentum, weight_decay=optim.weight_decay)


def _adamw(parameters: Any, lr: float, optim: "OptimConfig") -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=optim.weight_decay)


#: optim.name -> factory(parameter groups, lr, optim config)
OPTIMIZERS: dict[str, Callable[[Any, float, "OptimConfig"], torch.optim.Optimizer]] = {"adamw": _adamw, "sgd": _sgd}


def build_optimizer(optim: OptimConfig, model: torch.nn.Module, global_batch: int,
                    extra_parameters: Iterable[torch.nn.Parameter] = (), *,
                    freeze_backbone_steps: int = 0) -> torch.optim.Optimizer:
    """AdamW or SGD with the learning rate scaled linearly from ``base_batch`` to the global batch.

    With ``optim.backbone_lr_scale`` != 1 or ``freeze_backbone_steps`` > 0 the
    parameters form two groups, ``head`` at ``lr`` and ``backbone`` at
    ``lr * backbone_lr_scale`` (:func:`.finetune.parameter_groups`).
    """
    lr = optim.lr * global_batch / optim.base_batch
    split = optim.backbone_lr_scale != 1.0 or freeze_backbone_steps > 0
    parameters = parameter_groups(model, extra_parameters, lr, backbone_lr_scale=optim.backbone_lr_scale, split=split)
    return OPTIMIZERS[optim.name](parameters, lr, optim)


def build_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int,
                   total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps``, then cosine decay to zero at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

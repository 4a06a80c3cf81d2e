"""The optimizer and its learning-rate schedule (detectron2's ``solver/build.py``).

:data:`OPTIMIZERS` is the one list of optimizer names: the configuration's
``optim.name`` choices come from it. :data:`DEFAULT_SCALING` says how each
one's rate follows the global batch when ``optim.scaling: auto``
(:mod:`.scaling`): linearly for the SGD family (Goyal et al. 2017), by the
square root for the Adam family (Malladi et al. 2022; LAMB's own paper).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from pksampler.train.solver.finetune import parameter_groups
from pksampler.train.solver.layerwise import Lamb, Lars

if TYPE_CHECKING:
    from pksampler.train.config.schema import OptimConfig

__all__ = ["DEFAULT_SCALING", "OPTIMIZERS", "SCALING_RULES", "build_optimizer", "build_schedule", "check_learning_rate",
           "learning_rate", "scaled_lr", "scaling_rule", "warmup_length"]


def _sgd(parameters: Any, lr: float, optim: "OptimConfig") -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=lr, momentum=optim.momentum, weight_decay=optim.weight_decay)


def _adamw(parameters: Any, lr: float, optim: "OptimConfig") -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=optim.weight_decay)


def _lamb(parameters: Any, lr: float, optim: "OptimConfig") -> torch.optim.Optimizer:
    return Lamb(parameters, lr=lr, weight_decay=optim.weight_decay)


def _lars(parameters: Any, lr: float, optim: "OptimConfig") -> torch.optim.Optimizer:
    return Lars(parameters, lr=lr, momentum=optim.momentum, weight_decay=optim.weight_decay)


#: optim.name -> factory(parameter groups, lr, optim config)
OPTIMIZERS: dict[str, Callable[[Any, float, "OptimConfig"], torch.optim.Optimizer]] = {
    "adamw": _adamw, "sgd": _sgd, "lamb": _lamb, "lars": _lars}
#: optim.name -> the batch-size rule that ``optim.scaling: auto`` picks for it
DEFAULT_SCALING: dict[str, str] = {"adamw": "sqrt", "sgd": "linear", "lamb": "sqrt", "lars": "linear"}


#: optim.scaling choices: the exponent of (global batch / base_batch) that multiplies optim.lr
SCALING_RULES: dict[str, float | None] = {"auto": None, "linear": 1.0, "sqrt": 0.5, "none": 0.0}


def scaled_lr(lr: float, global_batch: int, base_batch: int, rule: str) -> float:
    """``lr x (global_batch / base_batch) ** p``: p = 1 (``linear``), 1/2 (``sqrt``) or 0 (``none``).

    Goyal et al. 2017 keep SGD's step per image constant (linear); Malladi et
    al. 2022 derive the square root for Adam, whose step does not grow with
    the gradient's size, only its noise shrinks.
    """
    exponent = SCALING_RULES.get(rule)
    if exponent is None:
        raise ValueError(f"optim.scaling: expected one of linear, sqrt, none here, got {rule!r}")
    return lr * (global_batch / base_batch) ** exponent


def scaling_rule(optim: "OptimConfig") -> str:
    """``optim.scaling``, or the optimizer's own rule (:data:`DEFAULT_SCALING`) when it is ``auto``."""
    return DEFAULT_SCALING[optim.name] if optim.scaling == "auto" else optim.scaling


def learning_rate(optim: "OptimConfig", global_batch: int) -> float:
    """The peak rate for ``global_batch`` images per step: ``optim.lr`` moved from ``base_batch`` by the rule."""
    return scaled_lr(optim.lr, global_batch, optim.base_batch, scaling_rule(optim))


#: the optimizers whose step multiplies each decayed weight by 1 − rate × decay (LAMB and LARS add the decay to
#: the update inside the trust ratio, which bounds the step)
MULTIPLICATIVE_DECAY = frozenset({"sgd", "adamw"})


def check_learning_rate(value: tuple["OptimConfig", int]) -> None:
    """Raise ValueError when ``(optim, images per step)`` gives a rate that is not a finite number, or a rate
    that with ``optim.weight_decay`` zeroes or flips the weights in one step (config check)."""
    optim, images = value
    rule = scaling_rule(optim)
    lr = learning_rate(optim, images)
    if not math.isfinite(lr):
        raise ValueError(f"optim.lr: {optim.lr!r} x {images} images per step / optim.base_batch={optim.base_batch} "
                         f"gives the learning rate {lr}, which is not a finite number (optim.scaling: {rule}, "
                         f"{optim.scaling!r} in the config); lower optim.lr")
    largest = float(torch.finfo(torch.float32).max)
    if optim.weight_decay > largest:  # the step multiplies float32 weights by it: torch cannot even convert it
        raise ValueError(f"optim.weight_decay: {optim.weight_decay!r} must be below float32's largest value "
                         f"{largest:.4g}: each {optim.name} step multiplies the float32 weights by it")
    rate = lr * max(1.0, optim.backbone_lr_scale)  # the fastest group's peak
    if optim.name in MULTIPLICATIVE_DECAY and rate * optim.weight_decay >= 1:
        raise ValueError(f"optim.weight_decay: {optim.weight_decay!r} times the peak rate {rate:g} (optim.lr "
                         f"{optim.lr!r} x {images} images / optim.base_batch {optim.base_batch}, optim.scaling {rule}"
                         f"{'' if optim.backbone_lr_scale <= 1 else f', x optim.backbone_lr_scale {optim.backbone_lr_scale!r}'}"
                         f") must be below 1: each {optim.name} step scales a weight by 1 − rate × decay, which would "
                         "zero or flip it")


def warmup_length(optim: "OptimConfig", total_steps: int) -> int:
    """Warm-up length: ``warmup_fraction`` of the run (rounded, at most the run) when set, else ``warmup_steps``."""
    if optim.warmup_fraction is None:
        return optim.warmup_steps
    return min(total_steps, round(optim.warmup_fraction * total_steps))


def build_optimizer(optim: OptimConfig, model: torch.nn.Module, global_batch: int,
                    extra_parameters: Iterable[torch.nn.Parameter] = (), *,
                    freeze_backbone_steps: int = 0) -> torch.optim.Optimizer:
    """The ``optim.name`` optimizer at :func:`learning_rate` (``optim.lr`` moved from ``base_batch`` to the global batch).

    With ``optim.backbone_lr_scale`` != 1 or ``freeze_backbone_steps`` > 0 the
    parameters form two groups, ``head`` at ``lr`` and ``backbone`` at
    ``lr * backbone_lr_scale`` (:func:`.finetune.parameter_groups`).
    """
    lr = learning_rate(optim, global_batch)
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

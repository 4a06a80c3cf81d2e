"""LARS and LAMB: optimizers whose step per layer follows the layer's own weight norm (``optim.name: lars|lamb``).

Large global batches take large learning rates, and one rate is then too
large for some layers and too small for others. LARS (You, Gitman & Ginsburg
2017) and LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning")
multiply each parameter tensor's step by a *trust ratio* ``‖w‖ / ‖update‖``,
so every layer moves by about the same fraction of its weights. SimCLR trains
at 4,096 images per step with LARS; BERT at 32k with LAMB.

Why our own implementation: timm's ``timm.optim.Lamb`` and ``timm.optim.Lars``
are the well-kept ones, but ``import timm`` imports torchvision, whose wheel
does not load against the CPU torch this project installs (docs/install.md),
and timm is a test-only dependency. These classes
follow timm's update rules and corner cases (the trainer passes every
hyper-parameter, so the defaults matter little), and
``tests/train/solver/test_large_batch.py`` checks one step against the papers'
formulas written out and several steps against timm's own classes.

The rules, for a parameter ``w`` with gradient ``g`` at step ``t``, learning
rate ``lr`` and weight decay ``λ``:

* **LAMB**: ``m = β₁m + (1−β₁)g``, ``v = β₂v + (1−β₂)g²``,
  ``u = (m / (1−β₁ᵗ)) / (√(v / (1−β₂ᵗ)) + ε) + λw``,
  ``w ← w − lr · r · u`` with ``r = ‖w‖ / ‖u‖``.
* **LARS**: ``r = η‖w‖ / (‖g‖ + λ‖w‖ + ε)``, ``d = r · (g + λw)``,
  ``b = μb + d`` (``b = d`` at the first step), ``w ← w − lr · b``.

Corner cases (as in timm): ``r = 1`` when ``‖w‖ = 0`` or the update is zero
(a freshly zeroed bias still learns). Tensors with one dimension or none
(biases, norm scales, GeM's exponent) get neither weight decay nor the trust
ratio: the practice of SimCLR's LARS and of BERT's LAMB, whose norms say
little about a step's right size. (timm decides by the group's weight decay;
its usual parameter groups give 1-D tensors none, which comes to the same.) Neither class clips the gradient norm
(timm's ``Lamb`` does by default; here that is a separate option of the trainer).

Example::

    optimizer = Lamb(model.parameters(), lr=2e-3, weight_decay=0.01)
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

__all__ = ["Lamb", "Lars"]


def _check(name: str, value: float, low: float, high: float | None = None) -> None:
    """Constructor arguments: a clear ValueError naming the argument, the value and the interval."""
    ok = math.isfinite(value) and value >= low and (high is None or value < high)
    if not ok:
        rule = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be a finite number {rule}, got {value!r}")


def _trust_ratio(weight_norm: torch.Tensor, update_norm: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """``ratio`` where both norms are positive, else 1 (a zero tensor or a zero step keeps the plain rate)."""
    one = torch.ones_like(ratio)
    return torch.where(weight_norm > 0, torch.where(update_norm > 0, ratio, one), one)


def _adapted(parameter: torch.Tensor, weight_decay: float) -> bool:
    """Weight decay and the trust ratio apply to matrices and kernels with a decay, not to 1-D tensors."""
    return parameter.ndim > 1 and weight_decay != 0


class Lamb(torch.optim.Optimizer):
    """Adam's step, plus decoupled weight decay, scaled per tensor by ``‖w‖ / ‖update‖`` (the module's LAMB rule).

    Args:
        params: parameters or parameter groups.
        lr: the learning rate (after the trainer's batch-size rule and schedule).
        betas: the moments' decay rates (β₁, β₂).
        eps: added to the root of the second moment.
        weight_decay: λ, added to the update before the trust ratio.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01) -> None:
        _check("lr", lr, 0.0)
        _check("betas[0]", betas[0], 0.0, 1.0)
        _check("betas[1]", betas[1], 0.0, 1.0)
        _check("eps", eps, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One LAMB update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v, grad = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v.sqrt() / math.sqrt(1 - beta2 ** state["step"])).add_(group["eps"])
                update = (m / (1 - beta1 ** state["step"])).div_(denom)
                if _adapted(p, group["weight_decay"]):
                    update.add_(p, alpha=group["weight_decay"])
                    w_norm, u_norm = p.norm(2.0), update.norm(2.0)
                    update.mul_(_trust_ratio(w_norm, u_norm, w_norm / u_norm))
                p.add_(update, alpha=-group["lr"])
        return loss


class Lars(torch.optim.Optimizer):
    """SGD with momentum whose gradient is scaled per tensor by ``η‖w‖ / (‖g‖ + λ‖w‖ + ε)`` (the module's LARS rule).

    Args:
        params: parameters or parameter groups.
        lr: the learning rate (after the trainer's batch-size rule and schedule).
        momentum: μ, applied after the trust ratio (as in timm and NVIDIA's LARC).
        weight_decay: λ, added to the gradient inside the trust ratio.
        trust_coefficient: η, the trust ratio's scale (0.001 in the paper and timm).
        eps: keeps the ratio finite when ``‖g‖ + λ‖w‖`` is tiny.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1.0, *, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8) -> None:
        _check("lr", lr, 0.0)
        _check("momentum", momentum, 0.0, 1.0)
        _check("weight_decay", weight_decay, 0.0)
        _check("trust_coefficient", trust_coefficient, 0.0)
        _check("eps", eps, 0.0)
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "trust_coefficient": trust_coefficient, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One LARS update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            decay, momentum = group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                direction = p.grad.clone()
                if _adapted(p, decay):
                    w_norm, g_norm = p.norm(2.0), p.grad.norm(2.0)
                    ratio = group["trust_coefficient"] * w_norm / (g_norm + w_norm * decay + group["eps"])
                    direction.add_(p, alpha=decay).mul_(_trust_ratio(w_norm, g_norm, ratio))
                if momentum != 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = direction.clone()
                    else:
                        state["momentum_buffer"].mul_(momentum).add_(direction)
                    direction = state["momentum_buffer"]
                p.add_(direction, alpha=-group["lr"])
        return loss

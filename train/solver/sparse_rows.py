"""SGD with momentum for a row-sharded head: only the rows a step used move, weight decay applied lazily and exactly.

A step that sampled rows S (:attr:`ShardedMarginHead.pending`) updates, for
each row in S,

    m ← μ·m + g,    w ← w·Π(1 − lr_t·λ over the steps since the row last moved) − lr·m

and nothing else: no dense C/W-sized gradient or momentum pass, ever. The
update is a function over the sampled rows and their momentum
(:func:`momentum_sgd`); the head owns the rows, the momentum, the step and the
decay log and applies it (:meth:`ShardedMarginHead.apply_update`), as Partial
FC keeps the head's optimizer state with its rows. The decoupled weight decay
(SGDW, Loshchilov & Hutter) that an eager optimizer would apply to every row
at every step is applied to a row when a step next samples it
(:class:`~pksampler.train.modeling.lazy_decay.LazyDecay`); a checkpoint
settles every row, so the saved rows are those of the eager optimizer.
Momentum belongs to the rows a step used: a row's momentum changes only when
the row is sampled.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from pksampler.train.modeling.sharded_head import ShardedMarginHead

if TYPE_CHECKING:
    from pksampler.train.config.schema import RunConfig

__all__ = ["SparseRowSGD", "momentum_sgd"]


def momentum_sgd(rows: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, *, lr: float,
                 mu: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One SGD step with momentum of the sampled ``rows`` (already decayed): their new rows and momentum."""
    buffer = momentum * mu + grad
    return rows - lr * buffer, buffer


class SparseRowSGD:
    """Row-sparse SGD with momentum and lazy decoupled weight decay for a :class:`ShardedMarginHead`.

    It holds the rule's numbers only (rate, momentum, decay); the state it steps is the head's.
    """

    def __init__(self, head: ShardedMarginHead, *, lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 or lr == float("inf"):
            raise ValueError(f"SparseRowSGD(lr=) expects a finite number > 0, got {lr!r}")
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not (
                0 <= weight_decay and lr * weight_decay < 1):
            # the lazy decay keeps log(1 − lr·λ): at lr·λ >= 1 (or NaN) a row reads NaN at its next step
            raise ValueError(f"SparseRowSGD(weight_decay=) expects a number >= 0 whose product with lr={lr!r} is "
                             f"below 1, got {weight_decay!r}")
        self.head, self.momentum, self.weight_decay = head, momentum, weight_decay
        self.lr = float(lr)  # the rows' peak rate: scheduled_step(f) steps at lr·f (f: the run's schedule factor)

    @classmethod
    def from_config(cls, config: "RunConfig", head: ShardedMarginHead, *, global_batch: int) -> "SparseRowSGD":
        """``head.lr`` for ``optim.base_batch`` images, linear in the global batch; ``head.momentum``,
        ``head.weight_decay``."""
        return cls(head, lr=config.head.lr * global_batch / config.optim.base_batch, momentum=config.head.momentum,
                   weight_decay=config.head.weight_decay)

    def scheduled_step(self, factor: float, *, grad_scale: float = 1.0, skipped: bool = False) -> None:
        """One step at ``lr · factor``, ``factor`` the run's warm-up/cosine schedule now (the trainer's call);
        ``grad_scale``: the GradScaler's factor this step's backward carried (fp16), 1 without one; ``skipped``:
        the GradScaler skipped the dense step (an fp16 overflow), so the rows skip theirs."""
        self.step(self.lr * factor, grad_scale=grad_scale, skipped=skipped)

    def step(self, lr: float, *, grad_scale: float = 1.0, skipped: bool = False) -> None:
        """Apply the pending gradient of the sampled rows at learning rate ``lr``, divided by ``grad_scale``
        (see :meth:`ShardedMarginHead.apply_update`; ``skipped``: no update and no decay, the step counts)."""
        self.head.apply_update(functools.partial(momentum_sgd, mu=self.momentum), lr=lr,
                               weight_decay=self.weight_decay, grad_scale=grad_scale, skipped=skipped)

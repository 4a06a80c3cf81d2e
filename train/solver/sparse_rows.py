"""SGD with momentum for a row-sharded head: only the rows a step used move, weight decay applied lazily and exactly.

A step that sampled rows S (:attr:`ShardedMarginHead.pending`) updates, for
each row in S,

    m ← μ·m + g,    w ← w·Π(1 − lr_t·λ over the steps since the row last moved) − lr·m

and nothing else: no dense C/W-sized gradient or momentum pass, ever. The
decoupled weight decay (SGDW, Loshchilov & Hutter) that an eager optimizer
would apply to every row at every step is applied to a row when a step next
samples it, before the forward pass reads it (the gradient of a normalised row
depends on its length), as the product of the factors it missed, read from a
running log-product of ``(1 − lr_t·λ)`` over steps; :meth:`settle` applies the pending
decay to every row (before a checkpoint), so the saved rows are those of the
eager optimizer. Momentum belongs to the rows a step used (Partial FC keeps it
the same way): a row's momentum changes only when the row is sampled.
"""

from __future__ import annotations

from typing import Any

import torch

from pksampler.world import World

from pksampler.train.modeling.head_replicas import RangeCopy
from pksampler.train.modeling.sharded_head import ShardedMarginHead

__all__ = ["SparseRowSGD"]


class SparseRowSGD:
    """Row-sparse SGD with momentum and lazy decoupled weight decay for a :class:`ShardedMarginHead`."""

    def __init__(self, head: ShardedMarginHead, *, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 grad_divisor: float = 1.0, loss_weight: float = 1.0) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 or lr == float("inf"):
            raise ValueError(f"SparseRowSGD(lr=) expects a finite number > 0, got {lr!r}")
        self.head, self.momentum, self.weight_decay = head, momentum, weight_decay
        self.lr = float(lr)  # the rows' peak rate: scheduled_step(f) steps at lr·f (f: the run's schedule factor)
        self.grad_divisor = grad_divisor  # the loss scale the backward carried (Horovod: the world size)
        # head.weight, which the head's loss carried into the backward: divided out of the rows' gradient, so the
        # weight balances the two losses in the network's gradient only and the rows learn at their own rate
        self.loss_weight = loss_weight
        self.buffer = torch.zeros_like(head.rows)
        # steps whose decay a row has; on the host with the decay log (indexed with host copies of row ids)
        self.moved_at = torch.zeros(head.rows.shape[0], dtype=torch.int64)
        self._log = torch.zeros(1024, dtype=torch.float64)  # [t]: log-product of (1 - lr_i * wd), i = 1..t
        self.steps = 0
        head.before_read = self.settle_rows

    @property
    def log_decay(self) -> torch.Tensor:
        return self._log[: self.steps + 1]

    def _record(self, lr: float) -> None:
        if self.steps + 1 >= self._log.numel():
            self._log = torch.cat([self._log, torch.zeros_like(self._log)])
        factor = torch.log1p(torch.tensor(-lr * self.weight_decay, dtype=torch.float64))
        self._log[self.steps + 1] = self._log[self.steps] + factor
        self.steps += 1

    def _decay_since(self, host_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The decay factor each of ``host_rows`` (row ids on the host; all rows: None) missed, on the rows' device."""
        steps = self.moved_at if host_rows is None else self.moved_at[host_rows]
        factor = torch.exp(self._log[self.steps] - self._log[steps])
        return factor.to(device=self.head.rows.device, dtype=self.head.rows.dtype)

    def scheduled_step(self, factor: float, *, grad_scale: float = 1.0, skipped: bool = False) -> None:
        """One step at ``lr · factor``, ``factor`` the run's warm-up/cosine schedule now (the trainer's call);
        ``grad_scale``: the GradScaler's factor this step's backward carried (fp16), 1 without one; ``skipped``:
        the GradScaler skipped the dense step (an fp16 overflow), so the rows skip theirs."""
        self.step(self.lr * factor, grad_scale=grad_scale, skipped=skipped)

    def step(self, lr: float, *, grad_scale: float = 1.0, skipped: bool = False) -> None:
        """Apply the pending gradient of the sampled rows at learning rate ``lr``, divided by ``grad_scale``.

        ``skipped`` (the GradScaler found an overflow in the reduced dense gradients, the same decision on every
        rank): no update and no decay; the step still counts. A rank never decides this from its own rows alone,
        so the ranks' decay logs stay equal."""
        pending, self.head.pending = self.head.pending, None
        grad = None
        if skipped:
            lr = 0.0
        elif pending is not None and pending[1].grad is not None:
            grad = pending[1].grad / (self.grad_divisor * grad_scale * self.loss_weight)
        self._record(lr)
        self.head.step += 1
        if grad is None:
            return
        rows = pending[0]
        host = rows.cpu()
        weights = self.head.rows[rows] * self._decay_since(host)[:, None, None]
        buffer = self.buffer[rows] * self.momentum + grad
        self.buffer[rows] = buffer
        self.head.rows[rows] = weights - lr * buffer
        self.moved_at[host] = self.steps

    def begin_world(self, world: World | None = None) -> None:
        """This rank's range in ``world`` (default: the collectives' current one): rows and momentum zero until
        loaded."""
        collectives = self.head.collectives
        self.head.set_world(world if world is not None else World(rank=collectives.rank, size=collectives.size))
        self.buffer = torch.zeros_like(self.head.rows)
        self.moved_at = torch.zeros(self.head.rows.shape[0], dtype=torch.int64)

    def load_initial(self) -> None:
        """The head's initial rows for the current range (a reset before any step was committed)."""
        if self.steps != 0:
            raise RuntimeError(f"the sharded head took {self.steps} steps but has no committed copy to re-shard from")
        self.head.rows.copy_(self.head.initial_rows())

    def settle_rows(self, rows: torch.Tensor) -> None:
        """Apply the pending weight decay of ``rows`` before a step reads them (the gradient of a normalised
        row depends on its length, so the forward must see the decayed row)."""
        host = rows.cpu()
        self.head.rows[rows] *= self._decay_since(host)[:, None, None]
        self.moved_at[host] = self.steps

    def settle(self) -> None:
        """Apply every row's pending weight decay (then the rows are the eager optimizer's)."""
        self.head.rows.mul_(self._decay_since()[:, None, None])
        self.moved_at.fill_(self.steps)

    def state_dict(self, *, everywhere: bool = False) -> dict[str, Any]:
        """Rows and momentum of the whole head, keyed by class id, decay settled (a collective: every rank calls
        it). Gathered to rank 0 in blocks (``rows`` and ``momentum`` are None on the others), or to every rank
        with ``everywhere`` (one all-gather; Horovod elastic's commit keeps a range and a replica instead,
        :mod:`~pksampler.train.modeling.head_replicas`)."""
        self.settle()
        return {**self.head.state_dict_rows(everywhere=everywhere),
                "momentum": self.head.gather_rows(self.buffer, everywhere=everywhere),
                "log_decay": self.log_decay.clone(), "momentum_of_own_loss": True}

    def own_range(self) -> tuple[dict[str, Any], RangeCopy]:
        """Horovod elastic's commit of this rank (no collective): the head's state but its rows and momentum
        (``meta``, the same on every rank), and a host copy of this rank's rows and momentum, decay settled."""
        self.settle()
        head = self.head
        meta = {"step": head.step, "num_classes": head.num_classes, "subcentres": head.subcentres,
                "dim": head.dim, "log_decay": self.log_decay.clone()}
        return meta, RangeCopy(head.lo, head.hi, head.rows.detach().to("cpu", copy=True),
                               self.buffer.detach().to("cpu", copy=True))

    def load_meta(self, meta: dict[str, Any]) -> None:
        """The step and decay log of :meth:`own_range`'s ``meta`` (the rows are loaded apart, every row settled)."""
        self.head.step = int(meta["step"])
        self._load_log(meta["log_decay"])

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """:meth:`state_dict`'s head, this rank's range. A head saved before the rows stepped on their own loss
        (no ``momentum_of_own_loss``) holds momentum of ``head.weight`` × that loss: divided back, so it continues
        in the units of the rule now in force."""
        self.head.load_state_dict_rows(saved)
        momentum = saved["momentum"][self.head.lo:self.head.hi]
        self.buffer.copy_(momentum if saved.get("momentum_of_own_loss") else momentum / self.loss_weight)
        self._load_log(saved["log_decay"])

    def _load_log(self, log_decay: torch.Tensor) -> None:
        log_decay = log_decay.to(torch.float64)
        self.steps = log_decay.numel() - 1
        self._log = torch.cat([log_decay, torch.zeros(max(1024, log_decay.numel()), dtype=torch.float64)])
        self.moved_at.fill_(self.steps)

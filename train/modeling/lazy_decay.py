"""Decoupled weight decay applied lazily and exactly to rows that move only when a step samples them.

An eager SGDW (Loshchilov & Hutter) scales every row by ``1 − lr_t·λ`` at every step. A row-sharded head samples a
few thousand of its 10⁶ rows a step, so the decay a row missed is applied when a step next reads it: the product of
the factors since it last moved, read from a running log-product over steps. :class:`LazyDecay` is that
bookkeeping, on the host (it is indexed with host copies of row ids, so reading it never waits for a device); the
head (:class:`~pksampler.train.modeling.sharded_head.ShardedMarginHead`) owns one beside its rows.
"""

from __future__ import annotations

import torch

__all__ = ["LazyDecay"]


class LazyDecay:
    """The log-product of ``(1 − lr_t·λ)`` over steps and, per row, the step whose decay it already has."""

    def __init__(self, rows: int) -> None:
        self.steps = 0
        self._log = torch.zeros(1024, dtype=torch.float64)  # [t]: log-product of (1 - lr_i * wd), i = 1..t
        self.moved_at = torch.zeros(rows, dtype=torch.int64)

    @property
    def log(self) -> torch.Tensor:
        """``[t]``: the log of the decay factor from step 0 to step t (t = 0 … :attr:`steps`)."""
        return self._log[: self.steps + 1]

    def record(self, decay: float) -> None:
        """One step whose every row is scaled by ``1 − decay`` (``decay`` = lr·λ; 0: no decay)."""
        if self.steps + 1 >= self._log.numel():
            self._log = torch.cat([self._log, torch.zeros_like(self._log)])
        factor = torch.log1p(torch.tensor(-decay, dtype=torch.float64))
        self._log[self.steps + 1] = self._log[self.steps] + factor
        self.steps += 1

    def take(self, host_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The factor each of ``host_rows`` (host row ids; every row: None) missed; they are up to date after."""
        moved = self.moved_at if host_rows is None else self.moved_at[host_rows]
        factor = torch.exp(self._log[self.steps] - self._log[moved])
        if host_rows is None:
            self.moved_at.fill_(self.steps)
        else:
            self.moved_at[host_rows] = self.steps
        return factor

    def load(self, log: torch.Tensor) -> None:
        """A saved :attr:`log`, every row settled at its end (a checkpoint settles every row first)."""
        log = log.to(torch.float64)
        self.steps = log.numel() - 1
        self._log = torch.cat([log, torch.zeros(max(1024, log.numel()), dtype=torch.float64)])
        self.moved_at.fill_(self.steps)

    def resize(self, rows: int) -> None:
        """A new range of ``rows`` rows (a new world), all of them settled (loaded rows are)."""
        self.moved_at = torch.full((rows,), self.steps, dtype=torch.int64)

"""W ranks as threads of one process: their collectives meet at a barrier (no launcher, real concurrency).

:class:`ThreadRank` is a :class:`pksampler.comm.Collectives` for the
collectives that pure-Python parts use (all-gather, sum, int64 rows);
:func:`on_ranks` runs one function on every rank and returns the results in
rank order, re-raising the first rank's exception.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch


class Group:
    """What every thread-rank put in, once all of them did (a barrier on both sides)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots: list = [None] * size

    def exchange(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


class ThreadRank:
    """One thread-rank's collectives."""

    def __init__(self, group: Group, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def allgather(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        return torch.cat(self.group.exchange(self.rank, tensor.clone()))

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.group.exchange(self.rank, tensor.clone())).sum(dim=0)

    def allgather_numpy(self, row: np.ndarray) -> np.ndarray:
        return np.stack(self.group.exchange(self.rank, np.asarray(row).copy()))


def on_ranks(world: int, call: Callable[[ThreadRank], Any]) -> list[Any]:
    """``call(collectives)`` on ``world`` thread-ranks at once; the results (or raised exceptions) in rank order."""
    group = Group(world)

    def one(rank: int) -> Any:
        try:
            return call(ThreadRank(group, rank))
        except Exception as error:  # noqa: BLE001 - handed back to the test, which asserts on it
            return error

    with ThreadPoolExecutor(world) as pool:
        return [future.result() for future in [pool.submit(one, rank) for rank in range(world)]]

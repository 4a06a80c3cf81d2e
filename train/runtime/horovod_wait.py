"""Sleep, not spin, while this rank waits for a Horovod collective.

Horovod 0.28's ``synchronize(handle)`` waits in C++ by calling
``std::this_thread::yield()`` in a loop until the background thread marks the
handle done. A rank blocked on a slower peer (an allgather of embeddings, the
gradient allreduce at the step) so keeps its core busy in the kernel. Where
every rank has a core of its own and nothing else needs it, that costs
nothing. Where ranks share cores (a CPU run, more ranks than cores, DataLoader
workers beside the ranks, another job on the host), the waiting ranks take the
CPU from the rank they wait for: the default config at ``horovodrun -np 16``
on 2 cores spent 97 of its 215 CPU-seconds in the kernel
(``benchmarks/horovod_wait.py``).

:func:`sleep_in_horovod_waits` makes every ``synchronize`` of Horovod's torch
API first poll the handle with growing sleeps (20 µs doubling to 1 ms), then
call Horovod's own ``synchronize``, which returns at once. Nothing else
changes: the same collectives in the same order, the same results, the same
errors (a peer's failure marks the handle done and ``synchronize`` raises
``HorovodInternalError`` as before). The wait ends at most one sleep (≤ 1 ms)
after the collective does.
"""

from __future__ import annotations

import functools
import importlib
import time
from typing import Any, Callable, Iterator

__all__ = ["FIRST_SLEEP_S", "LONGEST_SLEEP_S", "sleep_in_horovod_waits", "sleeps", "wait_until_done"]

#: the first sleep between two polls of a handle; each next one doubles, up to LONGEST_SLEEP_S
FIRST_SLEEP_S = 2e-5
LONGEST_SLEEP_S = 1e-3
#: the modules of Horovod's torch API that call ``synchronize`` by a name of their own (``from ... import``)
_CALLERS = ("horovod.torch.mpi_ops", "horovod.torch.functions", "horovod.torch.optimizer",
            "horovod.torch.sync_batch_norm", "horovod.torch")
#: marks a ``synchronize`` that already sleeps (installing twice wraps once)
_MARK = "_pksampler_sleeps"


def sleeps(first: float = FIRST_SLEEP_S, longest: float = LONGEST_SLEEP_S) -> Iterator[float]:
    """The sleeps between polls: ``first``, then doubling, then ``longest`` for ever."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, longest)


def wait_until_done(handle: int, poll: Callable[[int], bool], *,
                    sleep: Callable[[float], Any] | None = None) -> int:
    """Poll ``handle`` until it is done, sleeping :func:`sleeps` between polls (``time.sleep`` unless ``sleep``
    is given); the number of sleeps."""
    sleep = time.sleep if sleep is None else sleep
    slept = 0
    for delay in sleeps():
        if poll(handle):
            return slept
        sleep(delay)
        slept += 1
    raise AssertionError("unreachable: sleeps() never ends")


def _sleeping(synchronize: Callable[[int], Any], poll: Callable[[int], bool],
              handles: dict[int, Any]) -> Callable[[int], Any]:
    """``synchronize`` that first waits for its handle by :func:`wait_until_done`."""

    @functools.wraps(synchronize)
    def synchronize_after_sleeping(handle: int) -> Any:
        if handle in handles:  # Horovod's synchronize returns None for an unknown handle; poll would raise
            wait_until_done(handle, poll)
        return synchronize(handle)

    setattr(synchronize_after_sleeping, _MARK, True)
    return synchronize_after_sleeping


def sleep_in_horovod_waits() -> None:
    """Make every wait of Horovod's torch API sleep between polls (module docstring); installing twice is once."""
    mpi_ops = importlib.import_module("horovod.torch.mpi_ops")
    if getattr(mpi_ops.synchronize, _MARK, False):
        return
    original = mpi_ops.synchronize
    wrapped = _sleeping(original, mpi_ops.poll, mpi_ops._handle_map)
    for name in _CALLERS:
        module = importlib.import_module(name)
        if getattr(module, "synchronize", None) is original:
            module.synchronize = wrapped

"""Sleep, not spin, while this rank waits for a Horovod collective.

Horovod 0.28's ``synchronize(handle)`` waits in C++ by calling
``std::this_thread::yield()`` in a loop until the background thread marks the
handle done. A rank blocked on a slower peer (an allgather of embeddings, the
gradient allreduce at the step) so keeps its core busy in the kernel. Where
every rank has a core of its own and nothing else needs it, that costs
nothing. Where ranks share cores (a CPU run, more ranks than cores, DataLoader
workers beside the ranks, another job on the host), the waiting ranks take the
CPU from the rank they wait for: the default config at ``horovodrun -np 16``
on 2 cores spent 95.8 of its 206.2 CPU-seconds in the kernel
(``benchmarks/horovod_wait.py``).

:func:`set_horovod_wait` with ``"sleep"`` makes every ``synchronize`` of
Horovod's torch API first poll the handle with growing sleeps (20 µs
doubling to 1 ms), then call Horovod's own ``synchronize``, which returns at
once; ``"spin"`` goes back to Horovod's wait. Nothing else changes: the same
collectives in the same order, the same results, the same errors (a peer's
failure marks the handle done and ``synchronize`` raises
``HorovodInternalError`` as before). A wait ends one sleep (≤ 1 ms) after the
collective, plus the time the scheduler takes to wake the rank.
"""

from __future__ import annotations

import functools
import importlib
import time
from typing import Any, Callable, Iterator

from pksampler.train.config.schema import HOROVOD_WAITS

__all__ = ["FIRST_SLEEP_S", "LONGEST_SLEEP_S", "set_horovod_wait", "sleeps", "sleeps_in_waits", "wait_until_done"]

#: the first sleep between two polls of a handle; each next one doubles, up to LONGEST_SLEEP_S
FIRST_SLEEP_S = 2e-5
LONGEST_SLEEP_S = 1e-3
#: the modules of Horovod's torch API that call ``synchronize`` by a name of their own (``from ... import``)
_CALLERS = ("horovod.torch.mpi_ops", "horovod.torch.functions", "horovod.torch.optimizer",
            "horovod.torch.sync_batch_norm", "horovod.torch")
#: marks the installed ``synchronize`` (installing twice wraps once)
_MARK = "_pksampler_sleeps"
#: whether the installed ``synchronize`` sleeps (``set_horovod_wait``); one value per process, like Horovod's state
_sleeping_now = {"on": False}


def sleeps_in_waits(wait: str, device_type: str) -> bool:
    """Whether ``distributed.horovod_wait=wait`` sleeps on a rank computing on ``device_type``: ``auto`` sleeps on
    the CPU and spins on GPUs."""
    if wait not in HOROVOD_WAITS:
        raise ValueError(f"distributed.horovod_wait: must be one of {list(HOROVOD_WAITS)}, got {wait!r}")
    return wait == "sleep" or (wait == "auto" and device_type == "cpu")


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
              known: Callable[[int], bool]) -> Callable[[int], Any]:
    """``synchronize`` that first waits for its handle by :func:`wait_until_done` while sleeping is on.

    ``known(handle)``: whether Horovod holds the handle now (its table is replaced by every ``hvd.init``, so it
    is looked up at each call); Horovod's ``synchronize`` returns None for a handle it does not hold, where
    ``poll`` would raise.
    """

    @functools.wraps(synchronize)
    def synchronize_after_sleeping(handle: int) -> Any:
        if _sleeping_now["on"] and known(handle):
            wait_until_done(handle, poll)
        return synchronize(handle)

    setattr(synchronize_after_sleeping, _MARK, True)
    return synchronize_after_sleeping


def set_horovod_wait(wait: str) -> None:
    """``"sleep"``: every wait of Horovod's torch API sleeps between polls (module docstring); ``"spin"``:
    Horovod's own wait. The wrapper is installed once and stays, switched by this call."""
    if wait not in ("sleep", "spin"):
        raise ValueError(f"set_horovod_wait(wait=): must be 'sleep' or 'spin', got {wait!r}")
    _sleeping_now["on"] = wait == "sleep"
    mpi_ops = importlib.import_module("horovod.torch.mpi_ops")
    if wait == "spin" or getattr(mpi_ops.synchronize, _MARK, False):
        return
    original = mpi_ops.synchronize
    wrapped = _sleeping(original, mpi_ops.poll, lambda handle: handle in mpi_ops._handle_map)
    for name in _CALLERS:
        module = importlib.import_module(name)
        if getattr(module, "synchronize", None) is original:
            module.synchronize = wrapped

"""Two real Horovod ranks with the trainer's sleeping wait switched on (``set_horovod_wait("sleep")``).

1. It is installed in every module of Horovod's torch API that calls ``synchronize``, once however often it is set.
2. The smoke's collectives and optimizer step run through it (hvd_smoke.main, which calls ``hvd.init`` again: Horovod
   then replaces its handle table, as at an elastic reset) with the results of Horovod's own wait.
3. After that ``hvd.init``, rank 0 enters an allreduce and waits; rank 1 joins it only once rank 0's wait has slept
   (a file rank 0 writes at its first sleep), so rank 0 certainly waited, by sleeping between polls.
4. ``"spin"`` switches it off: the same late allreduce without a sleep.

Prints ``WAIT-OK rank r sleeps=n``.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

import horovod.torch as hvd
import hvd_smoke
import torch
from pksampler.train.runtime import horovod_wait

#: how long rank 1 waits for rank 0's first sleep (or, with "spin", for rank 0 to be in the allreduce)
DEADLINE_S = 120.0


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"rank 0 never got there: {path} missing after {DEADLINE_S} s")
        time.sleep(0.01)


def _late_allreduce(marker: Path, *, mark_at_first_sleep: bool) -> list[float]:
    """An allreduce that rank 1 joins once ``marker`` exists; the sleeps of this rank's wait."""
    sleeps: list[float] = []
    plain_sleep = time.sleep

    def counted(seconds: float) -> None:
        if not sleeps and hvd.rank() == 0 and mark_at_first_sleep:
            marker.touch()
        sleeps.append(seconds)
        plain_sleep(seconds)

    if hvd.rank() == 1:
        _wait_for(marker)
    elif not mark_at_first_sleep:
        marker.touch()  # rank 1 may join now; rank 0 is about to wait (or not, if it is slow: no sleep either way)
    time.sleep = counted
    try:
        total = hvd.allreduce(torch.tensor([1.0 + hvd.rank()]), op=hvd.Sum, name=f"wait.{marker.name}")
    finally:
        time.sleep = plain_sleep
    assert total.item() == 3.0, total
    return sleeps


def main(folder: Path) -> None:
    for _ in range(2):
        horovod_wait.set_horovod_wait("sleep")
    installed = {importlib.import_module(name).synchronize for name in horovod_wait._CALLERS}
    assert len(installed) == 1 and getattr(installed.pop(), horovod_wait._MARK, False), installed

    hvd_smoke.main()  # the smoke's checks again, through the sleeping wait; its hvd.init replaces the handle table
    sleeps = _late_allreduce(folder / "slept", mark_at_first_sleep=True)
    if hvd.rank() == 0:
        assert sleeps and max(sleeps) <= horovod_wait.LONGEST_SLEEP_S, sleeps

    horovod_wait.set_horovod_wait("spin")
    spun = _late_allreduce(folder / "spin", mark_at_first_sleep=False)
    assert spun == [], spun
    print(f"WAIT-OK rank {hvd.rank()} sleeps={len(sleeps)}", flush=True)

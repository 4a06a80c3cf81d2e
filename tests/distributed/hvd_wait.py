"""Two real Horovod ranks with the trainer's sleeping waits installed (``sleep_in_horovod_waits``).

Rank 0 enters an allreduce and waits; rank 1 joins it only once rank 0's wait has slept (a file rank 0 writes at
its first sleep), so rank 0 certainly waited, by sleeping between polls rather than in Horovod's loop. Then the
smoke's collectives and optimizer step run again through the sleeping wait, with the results of Horovod's own.
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

#: how long rank 1 waits for rank 0's first sleep
DEADLINE_S = 120.0


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"rank 0's wait never slept: {path} missing after {DEADLINE_S} s")
        time.sleep(0.01)


def main(folder: Path) -> None:
    horovod_wait.sleep_in_horovod_waits()
    horovod_wait.sleep_in_horovod_waits()  # twice is once
    installed = {importlib.import_module(name).synchronize for name in horovod_wait._CALLERS}
    assert len(installed) == 1 and getattr(installed.pop(), horovod_wait._MARK, False), installed

    started = folder / "rank0-wait-slept"
    sleeps: list[float] = []
    plain_sleep = time.sleep

    def counted(seconds: float) -> None:
        if not sleeps and hvd.rank() == 0:
            started.touch()
        sleeps.append(seconds)
        plain_sleep(seconds)

    if hvd.rank() == 1:
        _wait_for(started)
    time.sleep = counted
    try:
        total = hvd.allreduce(torch.tensor([1.0 + hvd.rank()]), op=hvd.Sum, name="wait.late")
    finally:
        time.sleep = plain_sleep
    assert total.item() == 3.0, total
    if hvd.rank() == 0:
        assert sleeps and max(sleeps) <= horovod_wait.LONGEST_SLEEP_S, sleeps
    hvd_smoke.main()  # the smoke's checks again, through the sleeping wait
    print(f"WAIT-OK rank {hvd.rank()} sleeps={len(sleeps)}", flush=True)

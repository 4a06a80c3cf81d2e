"""End a torch.distributed rank without the interpreter's teardown, once its work is written.

Under torchrun the trainer wraps the model in DistributedDataParallel, which
keeps a reference to the Gloo process group: ``destroy_process_group()``
then leaves the group's C++ threads running (``pt_gloo_runloop``,
``gloo_tcp_loop``; a plain group without DDP ends them). The interpreter's
teardown can destroy objects those threads still use, and a rank whose
training finished and wrote everything aborts: "terminate called without an
active exception", SIGABRT, which torchrun reports as a failed job (seen once
in the 27 torchrun launches of a test run; torch's own attempt at an at-exit
fix, pytorch/pytorch#179291, was withdrawn). So a rank that ran under
torchrun flushes its output, ends its DataLoader workers and leaves with
``os._exit``: its files are already written atomically and its process group
destroyed, so the teardown has nothing left to do but race those threads.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from typing import Callable, NoReturn

from pksampler import comm

__all__ = ["end_loader_workers", "end_rank"]


def end_loader_workers() -> None:
    """Kill this rank's DataLoader workers (its multiprocessing children) and reap them."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=10)


def end_rank(status: int, *, environ: dict[str, str] | None = None,
             exit: Callable[[int], NoReturn] = os._exit) -> None:
    """Leave with ``status`` at once under torchrun (module docstring); elsewhere return, for ``sys.exit``."""
    if comm.launcher(environ) != "torchrun":
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it; leave all the same
            pass
    end_loader_workers()  # the teardown would have ended them
    exit(status)

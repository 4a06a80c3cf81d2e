"""A rank under torchrun leaves by os._exit after flushing and ending its loader workers; elsewhere it returns.

The torchrun case runs in a process of its own: it ends that process and the children it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from pksampler.train.runtime.rank_exit import end_rank

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}

RANK = textwrap.dedent("""
    import atexit, multiprocessing, sys, time
    from pksampler.train.runtime.rank_exit import end_rank

    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
    worker.start()
    atexit.register(print, "the interpreter's teardown ran")
    sys.stderr.write(f"worker {worker.pid}\\n")
    sys.stdout.write("written, not flushed")
    end_rank(3, environ=ENVIRON)
    sys.exit(0)
""")


def test_under_torchrun_the_rank_flushes_ends_its_workers_and_leaves_with_its_status_without_teardown():
    result = subprocess.run([sys.executable, "-c", RANK.replace("ENVIRON", repr(TORCHRUN))], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert result.stdout == "written, not flushed"  # flushed; the atexit handler never ran
    worker = int(result.stderr.split("worker ")[1].split()[0])
    try:
        os.kill(worker, 0)
    except ProcessLookupError:
        return  # killed and reaped by the rank before it left
    os.kill(worker, signal.SIGKILL)
    raise AssertionError("the loader worker outlived its rank")


@pytest.mark.parametrize("environ", [{}, {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_HOSTNAME": "h"}],
                         ids=["one process", "horovodrun"])
def test_elsewhere_it_returns_for_the_interpreters_own_exit(environ):
    def exit_(status):
        raise AssertionError(f"exited with {status}")

    end_rank(0, environ=environ, exit=exit_)


"""A rank under torchrun leaves by os._exit after flushing and ending its loader workers; elsewhere it returns."""

from __future__ import annotations

import multiprocessing
import time

import pytest
from pksampler.train.runtime.rank_exit import end_rank

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}


class Exited(Exception):
    pass


def _exit(status):
    raise Exited(status)


def test_under_torchrun_the_workers_end_and_the_rank_leaves_with_its_status():
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
    worker.start()
    with pytest.raises(Exited) as exited:
        end_rank(2, environ=TORCHRUN, exit=_exit)
    assert exited.value.args == (2,)
    assert not worker.is_alive() and worker.exitcode is not None


@pytest.mark.parametrize("environ", [{}, {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_HOSTNAME": "h"}],
                         ids=["one process", "horovodrun"])
def test_elsewhere_it_returns_for_the_interpreters_own_exit(environ):
    end_rank(0, environ=environ, exit=_exit)  # Exited would fail the test

"""The sleeping wait for Horovod's handles: its schedule and its polls (the real ranks: tests/distributed/hvd_wait.py)."""

from __future__ import annotations

import itertools

import pytest
from pksampler.train.runtime import horovod_wait
from pksampler.train.runtime.horovod_wait import FIRST_SLEEP_S, LONGEST_SLEEP_S, sleeps, wait_until_done


def test_the_sleeps_double_from_the_first_to_the_longest_and_stay_there():
    schedule = list(itertools.islice(sleeps(), 12))
    assert schedule[0] == FIRST_SLEEP_S and max(schedule) == LONGEST_SLEEP_S
    assert all(b == min(2 * a, LONGEST_SLEEP_S) for a, b in zip(schedule, schedule[1:]))
    assert schedule[-1] == schedule[-2] == LONGEST_SLEEP_S


@pytest.mark.parametrize("done_after", [0, 1, 5, 40])
def test_a_wait_polls_until_done_and_sleeps_between_polls(done_after):
    polls, slept = [], []

    def poll(handle):
        polls.append(handle)
        return len(polls) > done_after

    assert wait_until_done(7, poll, sleep=slept.append) == done_after
    assert polls == [7] * (done_after + 1)
    assert slept == list(itertools.islice(sleeps(), done_after))


def test_a_sleeping_synchronize_returns_horovods_result_and_leaves_unknown_handles_to_it():
    handles = {3: "in flight"}
    done = set()
    calls = []

    def synchronize(handle):
        calls.append(handle)
        assert handle not in handles or handle in done, "synchronize reached before the handle was done"
        return f"result {handle}"

    def poll(handle):
        if handle not in handles:
            raise ValueError("Horovod's poll raises for a handle it does not know")
        done.add(handle)  # done at the first poll
        return True

    wrapped = horovod_wait._sleeping(synchronize, poll, handles)
    assert wrapped(3) == "result 3" and wrapped(99) == "result 99" and calls == [3, 99]
    assert getattr(wrapped, horovod_wait._MARK) and wrapped.__name__ == "synchronize"

"""The sleeping wait for Horovod's handles: its schedule, its polls, its switch (the real ranks: hvd_wait.py)."""

from __future__ import annotations

import itertools

import pytest
from pksampler.train.runtime import horovod_wait
from pksampler.train.runtime.horovod_wait import (FIRST_SLEEP_S, LONGEST_SLEEP_S, sleeps, sleeps_in_waits,
                                                   wait_until_done)


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


@pytest.mark.parametrize("wait, device, sleeping", [("auto", "cpu", True), ("auto", "cuda", False),
                                                    ("sleep", "cuda", True), ("sleep", "cpu", True),
                                                    ("spin", "cpu", False), ("spin", "cuda", False)])
def test_auto_sleeps_on_the_cpu_and_spins_on_gpus(wait, device, sleeping):
    assert sleeps_in_waits(wait, device) is sleeping


def test_an_unknown_wait_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"distributed.horovod_wait: must be one of \['auto', 'sleep', 'spin'\], "
                                         r"got 'nap'"):
        sleeps_in_waits("nap", "cpu")


@pytest.fixture
def switch():
    before = dict(horovod_wait._sleeping_now)
    yield horovod_wait._sleeping_now
    horovod_wait._sleeping_now.update(before)


def test_the_sleeping_synchronize_reads_horovods_current_table_and_follows_the_switch(switch):
    # Horovod replaces its handle table at every hvd.init (an elastic reset): the wrapper must see the new one
    tables = {"now": {3: "in flight"}}
    polled, calls = [], []

    def synchronize(handle):
        calls.append(handle)
        return f"result {handle}"

    def poll(handle):
        if handle not in tables["now"]:
            raise ValueError("Horovod's poll raises for a handle it does not hold")
        polled.append(handle)
        return True

    wrapped = horovod_wait._sleeping(synchronize, poll, lambda handle: handle in tables["now"])
    switch["on"] = True
    assert wrapped(3) == "result 3" and polled == [3]
    tables["now"] = {5: "in flight"}  # a new hvd.init: handle 3 is gone, 5 is new
    assert wrapped(3) == "result 3" and wrapped(5) == "result 5" and polled == [3, 5]
    switch["on"] = False  # "spin": straight to Horovod's synchronize
    assert wrapped(5) == "result 5" and polled == [3, 5] and calls == [3, 3, 5, 5]
    assert getattr(wrapped, horovod_wait._MARK) and wrapped.__name__ == "synchronize"

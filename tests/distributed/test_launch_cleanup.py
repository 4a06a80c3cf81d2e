"""Interrupting the suite ends its launched jobs: Ctrl-C, SIGTERM, a pytest timeout, even SIGKILL of pytest.

Each scenario runs a pytest of its own whose one test launches two sleeping
ranks (tests/distributed/sleeping_rank.py) through tests/launch.py, the way
every launched test does; once both ranks are up, that pytest is interrupted,
and every rank and launcher under it must be gone within a minute. The four
pytests run side by side, so the test costs one launch's start-up.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from launch import ROOT, end_launch, spawn, tag_of, tagged

pytestmark = pytest.mark.horovod
SLEEPER = ROOT / "tests" / "distributed" / "sleeping_rank.py"
INNER = """
import sys
sys.path.insert(0, {tests!r})
from launch import launch

def test_a_launch_that_is_interrupted():
    launch({launcher!r}, {sleeper!r}, {pids!r}, timeout=600)
"""
#: (launcher, how its pytest is interrupted): SIGINT is Ctrl-C, SIGALRM the signal pytest-timeout arms
SCENARIOS = [("torchrun", signal.SIGINT), ("horovodrun", signal.SIGTERM), ("torchrun", signal.SIGALRM),
             ("horovodrun", signal.SIGKILL)]


def _interruptible() -> None:
    """In the inner pytest's process, before it starts: Ctrl-C as at a terminal. A suite started in the background
    (``nohup make test &``, a CI runner's script) inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt; the scenario is a user's Ctrl-C, so the inner pytest starts with the default action."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_inner(folder: Path, launcher: str) -> tuple[subprocess.Popen, Path]:
    """A pytest running one launched test in ``folder``; returns it and the folder its ranks write pids to."""
    pids = folder / "pids"
    pids.mkdir(parents=True)
    test = folder / "test_inner.py"
    test.write_text(INNER.format(tests=str(ROOT / "tests"), launcher=launcher, sleeper=str(SLEEPER),
                                 pids=str(pids)))
    command = [sys.executable, "-m", "pytest", str(test), "-q", "-p", "no:cacheprovider", "--timeout=600",
               "--rootdir", str(folder)]
    log = open(folder / "pytest.log", "w", encoding="utf-8")
    try:
        return spawn(command, kind="pytest", cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                     preexec_fn=_interruptible), pids
    finally:
        log.close()


def wait_for(ready, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.2)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_interrupting_pytest_ends_every_launched_rank(tmp_path):
    inner = [(*start_inner(tmp_path / f"{i}-{launcher}-{how.name}", launcher), how)
             for i, (launcher, how) in enumerate(SCENARIOS)]
    try:
        for process, pids, _ in inner:
            wait_for(lambda: len(list(pids.glob("*.pid"))) == 2 or process.poll() is not None, timeout=240,
                     what="both ranks started")
            assert len(list(pids.glob("*.pid"))) == 2, (pids.parent / "pytest.log").read_text()[-3000:]
        ranks = {how.name: [int(p.read_text()) for p in pids.glob("*.pid")] for _, pids, how in inner}
        tags = [tag_of(process) for process, _, _ in inner]
        for process, _, how in inner:
            process.send_signal(how)
        for process, _, _ in inner:
            process.wait(timeout=60)

        def alive() -> dict[str, list[int]]:
            return {how: [pid for pid in pids if running(pid)] for how, pids in ranks.items() if any(map(running, pids))}

        def leftovers() -> list[str]:
            return [" ".join(p.cmdline()) for tag in tags for p in tagged(tag) if p.is_running()]

        deadline = time.monotonic() + 60
        while (alive() or leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(), f"ranks alive a minute after their pytest was interrupted: {alive()}"
        assert not leftovers(), f"launcher processes outlived their pytest: {leftovers()}"
    finally:
        for process, _, _ in inner:
            end_launch(process)

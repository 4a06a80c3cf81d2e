"""The headline command as a user runs it: ``horovodrun -np 16 python train/retrieval.py``, the default config.

A file of its own: the suite's longest launch (16 ranks on the machine's cores), so the test runner can start it
beside the other files' tests.
"""

from __future__ import annotations

import sys

import pytest
from launch import HOROVODRUN, environment, run_launcher
from trainer_runs import SCRIPT

pytestmark = pytest.mark.horovod


@pytest.mark.slow
def test_the_default_command_at_sixteen_ranks(tmp_path):
    # `horovodrun -np 16 python train/retrieval.py` with the default config; one epoch to bound the time.
    # The command line as README writes it (no -H, no --gloo: horovodrun finds its controller as it does for a
    # user), and Horovod's own coordination cycle.
    command = [str(HOROVODRUN), "-np", "16", sys.executable, str(SCRIPT),
               "--set", f"workspace={tmp_path / 'np16'}", "--set", "train.epochs=1"]
    result = run_launcher(command, kind="horovodrun", timeout=540, env=environment({"HOROVOD_CYCLE_TIME": None}))
    assert result.returncode == 0, result.stdout[-4000:]
    assert "world=16" in result.stdout and "batch/rank=4 global=64" in result.stdout
    workspace = tmp_path / "np16"
    assert (workspace / "curves.png").is_file() and (workspace / "galleries" / "epoch_001.png").is_file()

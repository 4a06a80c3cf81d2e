"""The headline command as a user runs it: ``horovodrun -np 16 python train/retrieval.py``, the default config.

A file of its own: the suite's longest launch (16 ranks on the machine's cores), so the test runner can start it
beside the other files' tests.
"""

from __future__ import annotations

import pytest
from launch import launch
from trainer_runs import SCRIPT

pytestmark = pytest.mark.horovod


@pytest.mark.slow
def test_the_default_command_at_sixteen_ranks(tmp_path):
    # `horovodrun -np 16 python train/retrieval.py` with the default config; one epoch to bound the time.
    result = launch("horovodrun", SCRIPT, "--set", f"workspace={tmp_path / 'np16'}", "--set", "train.epochs=1",
                    np=16, timeout=540, env={"HOROVOD_CYCLE_TIME": None})  # Horovod's own cycle, as users run it
    assert result.returncode == 0, result.stdout[-4000:]
    assert "world=16" in result.stdout and "batch/rank=4 global=64" in result.stdout
    workspace = tmp_path / "np16"
    assert (workspace / "curves.png").is_file() and (workspace / "galleries" / "epoch_001.png").is_file()

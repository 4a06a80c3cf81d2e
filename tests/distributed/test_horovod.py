"""Real multi-process runs: horovodrun -np 2 with Gloo on the CPU, every check in one launch (hvd_checks.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from launch import ROOT, horovodrun, shared_run

pytestmark = pytest.mark.horovod
HERE = ROOT / "tests" / "distributed"


@shared_run()
def checked(folder: Path) -> subprocess.CompletedProcess[str]:
    """hvd_smoke.py's, hvd_sampler.py's then hvd_wait.py's checks on two ranks, one launch."""
    return horovodrun(HERE / "hvd_checks.py", str(folder))


def test_horovod_smoke_allreduce_and_distributed_optimizer_step(checked):
    assert checked.returncode == 0, checked.stdout[-4000:]
    for rank in range(2):
        assert f"SMOKE-OK rank {rank}" in checked.stdout, checked.stdout[-4000:]


def test_sampler_on_real_ranks_detects_world_and_catches_mismatch(checked):
    assert checked.returncode == 0, checked.stdout[-4000:]
    for rank in range(2):
        assert f"SAMPLER-OK rank {rank}" in checked.stdout, checked.stdout[-4000:]
        assert f"MISMATCH-RAISED rank {rank}" in checked.stdout, checked.stdout[-4000:]


def test_sleeping_waits_give_horovods_results_and_sleep_while_a_peer_is_late(checked):
    assert checked.returncode == 0, checked.stdout[-4000:]
    for rank in range(2):
        assert f"WAIT-OK rank {rank} sleeps=" in checked.stdout, checked.stdout[-4000:]
    # each rank ran the smoke's checks twice: with Horovod's wait, then with the sleeping one
    assert checked.stdout.count("SMOKE-OK rank 0") == 2, checked.stdout[-4000:]

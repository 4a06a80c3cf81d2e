"""Real multi-process runs: horovodrun -np 2 with Gloo on the CPU, both checks in one launch (hvd_checks.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from launch import ROOT, horovodrun, shared_run

pytestmark = pytest.mark.horovod
HERE = ROOT / "tests" / "distributed"


@shared_run()
def checked(folder: Path) -> subprocess.CompletedProcess[str]:
    """hvd_smoke.py's then hvd_sampler.py's checks on two ranks, one launch."""
    return horovodrun(HERE / "hvd_checks.py")


def test_horovod_smoke_allreduce_and_distributed_optimizer_step(checked):
    assert checked.returncode == 0, checked.stdout[-4000:]
    for rank in range(2):
        assert f"SMOKE-OK rank {rank}" in checked.stdout, checked.stdout[-4000:]


def test_sampler_on_real_ranks_detects_world_and_catches_mismatch(checked):
    assert checked.returncode == 0, checked.stdout[-4000:]
    for rank in range(2):
        assert f"SAMPLER-OK rank {rank}" in checked.stdout, checked.stdout[-4000:]
        assert f"MISMATCH-RAISED rank {rank}" in checked.stdout, checked.stdout[-4000:]

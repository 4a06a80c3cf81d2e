"""Real multi-process runs: horovodrun -np 2 with Gloo on the CPU."""

from __future__ import annotations

import pytest
from launch import ROOT, horovodrun

pytestmark = pytest.mark.horovod
HERE = ROOT / "tests" / "distributed"


def test_horovod_smoke_allreduce_and_distributed_optimizer_step():
    result = horovodrun(HERE / "hvd_smoke.py")
    assert result.returncode == 0, result.stdout[-4000:]
    for rank in range(2):
        assert f"SMOKE-OK rank {rank}" in result.stdout, result.stdout[-4000:]


def test_sampler_on_real_ranks_detects_world_and_catches_mismatch():
    result = horovodrun(HERE / "hvd_sampler.py")
    assert result.returncode == 0, result.stdout[-4000:]
    for rank in range(2):
        assert f"SAMPLER-OK rank {rank}" in result.stdout, result.stdout[-4000:]
        assert f"MISMATCH-RAISED rank {rank}" in result.stdout, result.stdout[-4000:]

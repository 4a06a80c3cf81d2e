"""Which rank prints a config error in train/retrieval.py: rank 0 at once; another rank after waiting for rank 0,
when it is still running (it hit the error alone), so the error is never lost."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("retrieval_script_ranks", ROOT / "train" / "retrieval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rank", [0, 1])
def test_a_config_error_of_one_rank_alone_is_printed_once_by_that_rank(rank, monkeypatch, capsys):
    # A ConfigError raised on rank 1 only (its host short of memory) was never shown: rank 1 waited for rank 0 to
    # print it, rank 0 went on into a collective, and the run ended in "another rank stopped" alone.
    script = _script()
    monkeypatch.setattr(script, "_rank", lambda: rank)
    monkeypatch.setattr(script, "_PEER_WAIT_SECONDS", 0.0)
    status = script.main(["--set", "head.scale=2000"])
    assert status == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    prefix = "" if rank == 0 else f"[rank {rank}] "
    assert len(lines) == 1 and lines[0].startswith(f"{prefix}error: head.scale: must be in (0, 300]"), lines

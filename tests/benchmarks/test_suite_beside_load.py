"""benchmarks/suite_beside_load.sh: its arguments (the measurement itself is a whole `make test`, run by hand)."""

from __future__ import annotations

import subprocess

from launch import ROOT

SCRIPT = ROOT / "benchmarks" / "suite_beside_load.sh"


def test_an_unknown_argument_is_one_usage_line_and_status_two_before_any_load_starts():
    result = subprocess.run(["bash", str(SCRIPT), "--loud"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"usage: {SCRIPT} [--demo | --quiet]  (got: --loud)"]
    assert "[suite]" not in result.stdout  # no load started, no clone made

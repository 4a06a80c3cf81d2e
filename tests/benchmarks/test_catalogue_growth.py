"""The growth benchmark at a small size: the updated index holds exactly the live vectors and recalls what a rebuilt
one does (the figures in docs/catalogue-growth.md come from the same script at 10^6)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from catalogue_growth import main  # noqa: E402


def test_the_benchmark_updates_in_place_and_recalls_like_a_rebuild(tmp_path, capsys):
    result = main(["--count", "20000", "--queries", "200", "--work", str(tmp_path / "work")])
    assert '"update_share_of_rebuild"' in capsys.readouterr().out
    assert (result["how"], result["added"], result["removed"]) == ("updated", 200, 200)
    assert result["index_holds"] == result["live"] == 20000
    for updated, rebuilt in zip(result["recall"]["updated"], result["recall"]["rebuilt"]):
        assert updated["nprobe"] == rebuilt["nprobe"]
        assert abs(updated["ten_recall_at_10"] - rebuilt["ten_recall_at_10"]) <= 0.02, result["recall"]
    assert not (tmp_path / "work").exists()  # the script cleans up its catalogue and indexes

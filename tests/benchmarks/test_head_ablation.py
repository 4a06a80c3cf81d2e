"""head_ablation.py --merge: arms of separate runs in one table and one PNG, none lost to a shared name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from head_ablation import merge  # noqa: E402


def _run(path: Path, overrides: list[str], recall: float) -> Path:
    curve = {"step": [1, 2], "loss": [1.0, 0.5], "eval_step": [2], "recall_at_1": [recall],
             "mean_cosine_same": [0.7], "mean_cosine_other": [0.1], "effective_rank": [50.0]}
    row = {"recall_at_1": recall, "recall_at_5": recall, "map_at_r": recall / 2, "effective_rank": 50.0,
           "mean_cosine": 0.1, "mean_cosine_same": 0.7, "mean_cosine_other": 0.1}
    path.write_text(json.dumps({"rows": {"pair": row}, "timings": {}, "data": "typefaces", "head": "arcface",
                                "steps": 2, "overrides": overrides, "curves": {"pair": curve}}))
    return path


def test_two_pair_arms_with_and_without_overrides_both_reach_the_table_and_the_png(tmp_path, capsys):
    plain = _run(tmp_path / "a.json", [], 0.9)
    necked = _run(tmp_path / "b.json", ["model.neck=batch", "data.root=/x"], 0.91)
    again = _run(tmp_path / "c.json", [], 0.8)
    merge([plain, necked, again], tmp_path / "out")
    merged = json.loads((tmp_path / "out" / "head_ablation.json").read_text())
    assert {name: row["recall_at_1"] for name, row in merged["rows"].items()} == {
        "pair": 0.9, "pair, model.neck=batch": 0.91, "pair (2)": 0.8}
    assert "| pair, model.neck=batch | 0.910 |" in capsys.readouterr().out
    assert Image.open(tmp_path / "out" / "head_ablation.png").size[0] > 1000

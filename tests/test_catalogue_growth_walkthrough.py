"""docs/catalogue-growth.md's walk-through runs as written: week 1 (train, embed, index, query), then week 2 (products
added, a photo retaken, a view withdrawn; embed again, update the index, query), in one process."""

from __future__ import annotations

import json

import pytest
from launch import ROOT, page_walkthrough, run_walkthrough

PAGE = ROOT / "docs" / "catalogue-growth.md"
pytestmark = pytest.mark.slow


def _results(folder):
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def test_the_growth_walkthrough_runs_as_written(tmp_path):
    script = page_walkthrough(PAGE)
    assert script.count("embed_catalogue.py") == 2 and script.count("build_index.py") == 2
    result = run_walkthrough(script, tmp_path, timeout=540)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    shop = tmp_path / "workspace" / "shop"
    manifest = json.loads((shop / "catalogue" / "manifest.json").read_text())
    week2 = manifest["versions"][1]
    assert (week2["added"], week2["changed"], len(week2["removed"]), week2["count"]) == (32, 1, 2, 33)
    assert manifest["count"] == 384 - 2 + 33 and manifest["embedded"] == 384 + 33
    assert "version 2 of workspace/shop/catalogue: 32 new, 1 changed, 2 removed" in output, output[-3000:]
    meta = json.loads((shop / "index" / "index.json").read_text())
    assert [h["how"] for h in meta["history"]] == ["built", "updated"] and meta["count"] == 415
    assert "index: updated to version 2" in output
    # week 1 cannot find product 50 (not in the catalogue yet); week 2 finds its photo first, under a new id
    before, after = _results(shop / "week1"), _results(shop / "week2")
    assert all(r["class"] != "product_00050" for r in before[1]["results"])
    top = after[1]["results"][0]
    assert top["path"].endswith("product_00050/00003.png") and top["id"] >= 384, after[1]
    assert top["similarity"] == pytest.approx(1.0, abs=1e-5)
    removed = set(week2["removed"])
    assert not removed & {r["id"] for line in after for r in line["results"]}
    assert not any(r["path"].endswith("product_00020/00007.png") for line in after for r in line["results"])
    print(output[-3000:])

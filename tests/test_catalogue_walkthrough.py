"""docs/catalogue.md's walk-through runs as written: train, export, embed on two ranks, index, query.

The commands between the page's ``<!-- walk-through -->`` markers run one
after the other with ``bash -e`` in a fresh folder that sees the repository's
``train/`` and ``configs/`` (as a fresh clone would), ``python`` and
``horovodrun`` being this environment's.
"""

from __future__ import annotations

import json

import pytest
from launch import ROOT, page_walkthrough, run_walkthrough
from PIL import Image

PAGE = ROOT / "docs" / "catalogue.md"
pytestmark = pytest.mark.horovod


def test_the_walkthrough_runs_as_written(tmp_path):
    script = page_walkthrough(PAGE)
    assert all(step in script for step in ("retrieval.py", "export_model.py", "horovodrun", "embed_catalogue.py",
                                           "build_index.py", "query_catalogue.py"))
    result = run_walkthrough(script, tmp_path, timeout=420)
    output = result.stdout
    assert result.returncode == 0, output[-5000:]
    work = tmp_path / "workspace" / "catalogue-demo"
    assert {p.name for p in (work / "model").iterdir()} >= {"model.onnx", "model.pt2"}
    manifest = json.loads((work / "catalogue" / "manifest.json").read_text())
    assert manifest["count"] == 384 and manifest["bad"] == 0
    meta = json.loads((work / "index" / "index.json").read_text())
    assert meta["kind"] == "flat" and meta["certificate"]["recall_at_1"] == 1.0
    lines = [json.loads(line) for line in (work / "query" / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(len(line["results"]) == 5 for line in lines)
    # A trained model finds the scanned product among 48. Six scans are too few to judge "first" tightly: this
    # small model ranks the scanned product first for 74-88 % of all 96 scans across Pillow versions and seeds
    # (2 of 480 rendered images differ between Pillow 11 and 12), so "4 of 6 first" failed one run in five. The
    # gallery shows five results, and the product is among them for 94-100 % of scans: 4 of 6 holds with
    # probability 0.996 at 94 % and 0.001 for an untrained model (5 of 48 images); 2 of 6 first holds with
    # probability 0.99 at 74 % and 0.006 by chance (1 of 48).
    among_five = sum(any(r["class"] == line["query_class"] for r in line["results"]) for line in lines)
    first = sum(line["results"][0]["class"] == line["query_class"] for line in lines)
    assert among_five >= 4 and first >= 2, lines
    with Image.open(work / "query" / "gallery.png") as gallery:
        assert gallery.height > 6 * 96
    print(output[-3000:])

"""Catalogue embedding on real ranks: the same parts at W=2 as in one process, a restart skips finished parts,
bad images are named once, skipped and counted; then the index and a query over what the ranks wrote."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from catalogue_fixtures import make_checkpoint, render_folder
from launch import HOROVODRUN, HOROVODRUN_CONTROLLER, ROOT, horovodrun, rank_tracebacks, run_launcher
from PIL import Image

from pksampler.train.catalogue.embed import EmbedOptions, embed_catalogue
from pksampler.train.catalogue.index import build_index
from pksampler.train.catalogue.parts import read_manifest, read_part
from pksampler.train.catalogue.query import query_catalogue
from pksampler.train.errors import ConfigError
from pksampler.train.runtime.distributed import Backend

pytestmark = pytest.mark.horovod
SCRIPT = ROOT / "train" / "embed_catalogue.py"


def _parts(folder):
    manifest = read_manifest(folder)
    return manifest, [read_part(folder, e["part"], mmap=False) for e in manifest["parts"]]


def _same(a, b, parts=None):
    """The parts of ``a`` and ``b`` (a catalogue, or one version's folder with its ``parts``) are equal bit for bit."""
    if parts is None:
        (ma, pa), (mb, pb) = _parts(a), _parts(b)
        assert ma["parts"] == mb["parts"] and ma["bad_ids"] == mb["bad_ids"] and ma["model"] == mb["model"]
    else:
        pa, pb = ([read_part(f, e["part"], mmap=False) for e in parts] for f in (a, b))
    for (ea, ia), (eb, ib) in zip(pa, pb):
        assert np.array_equal(ia, ib) and np.array_equal(ea, eb)


def test_two_ranks_write_the_parts_of_one_process_and_a_restart_skips_finished_ones(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "best.pt")
    data = render_folder(tmp_path / "products", classes=9, per_class=5)
    bad = data / "product_00004" / "00002.png"
    bad.write_bytes(b"not a png")  # id 22: products are numbered class by class
    options = EmbedOptions(part_size=8, batch_size=3, workers=1, max_bad_fraction=0.1)

    one = embed_catalogue(checkpoint, str(data), tmp_path / "one", Backend(), options=options)
    assert (one["count"], one["bad"], one["bad_ids"], one["plan"]["parts"]) == (44, 1, [22], 6)

    result = horovodrun(SCRIPT, "--checkpoint", str(checkpoint), "--data", str(data), "--out", str(tmp_path / "two"),
                        "--part-size", "8", "--batch-size", "3", "--workers", "1", "--max-bad-fraction", "0.1",
                        timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("00002.png") == 1, result.stdout[-4000:]  # named once, by the rank that read it
    assert "rank 0 embeds 3 part(s), skips 0 finished" in result.stdout and "1 bad image(s) skipped" in result.stdout
    _same(tmp_path / "one", tmp_path / "two")
    records = [json.loads((tmp_path / "two" / "parts" / f"part-{p:05d}.json").read_text()) for p in range(6)]
    assert [r["rank"] for r in records] == [0, 1, 0, 1, 0, 1]
    assert [r["world_size"] for r in records] == [2] * 6

    # faiss reads the parts as they are: one float32 matrix per file, rows matching the ids files
    embeddings = np.load(tmp_path / "two" / "embeddings" / "part-00002.npy")
    assert embeddings.dtype == np.float32 and embeddings.shape == (7, 16)
    assert np.allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)

    # a killed job: part 3 lost its record (arrays written, not marked), part 5 never started
    (tmp_path / "two" / "parts" / "part-00003.json").unlink()
    for sub in ("embeddings", "ids"):
        (tmp_path / "two" / sub / "part-00005.npy").unlink()
    (tmp_path / "two" / "parts" / "part-00005.json").unlink()
    (tmp_path / "two" / "manifest.json").unlink()
    before = {p: os.stat(tmp_path / "two" / "embeddings" / f"part-{p:05d}.npy").st_mtime_ns for p in (0, 1, 2, 4)}
    again = embed_catalogue(checkpoint, str(data), tmp_path / "two", Backend(), options=options)  # now W = 1
    after = {p: os.stat(tmp_path / "two" / "embeddings" / f"part-{p:05d}.npy").st_mtime_ns for p in (0, 1, 2, 4)}
    assert before == after and again["count"] == 44
    assert json.loads((tmp_path / "two" / "parts" / "part-00003.json").read_text())["world_size"] == 1
    _same(tmp_path / "one", tmp_path / "two")

    # what the ranks wrote is a catalogue: indexed and searched
    meta = build_index(tmp_path / "two", tmp_path / "index")
    assert meta["kind"] == "flat" and meta["count"] == 44 and meta["model"]["digest"] == one["model"]["digest"]
    query = data / "product_00002" / "00001.png"
    lines = query_catalogue(tmp_path / "index", [query, bad], tmp_path / "results", checkpoint=checkpoint, k=3)
    assert lines[1] == {"query": str(bad), "error": lines[1]["error"]} and "00002.png" in lines[1]["error"]
    top = lines[0]["results"][0]
    assert top["id"] == 11 and top["path"] == str(query) and top["similarity"] == pytest.approx(1.0, abs=1e-5)
    assert lines[0]["query_class"] == "product_00002" == top["class"]
    written = [json.loads(line) for line in (tmp_path / "results" / "results.jsonl").read_text().splitlines()]
    assert written == lines
    with Image.open(tmp_path / "results" / "gallery.png") as gallery:
        assert gallery.width > 4 * 96 and gallery.height > 96

    # another model's parts are not mixed in
    other = make_checkpoint(tmp_path / "other.pt", seed=1)
    with pytest.raises(ConfigError, match=r"--checkpoint: .* holds parts embedded by another model .* a new model "
                                          r"means a new catalogue"):
        embed_catalogue(other, str(data), tmp_path / "two", Backend(), options=options)
    with pytest.raises(ConfigError, match=r"--checkpoint: .*other\.pt is not the model the catalogue was embedded"):
        query_catalogue(tmp_path / "index", [query], tmp_path / "results", checkpoint=other)

    # the catalogue grows: two ranks fingerprint the source and embed version 2 as one process does
    _grow(data)
    grown = embed_catalogue(checkpoint, str(data), tmp_path / "one", Backend(), options=options)
    result = horovodrun(SCRIPT, "--checkpoint", str(checkpoint), "--data", str(data), "--out", str(tmp_path / "two"),
                        "--part-size", "8", "--batch-size", "3", "--workers", "1", "--max-bad-fraction", "0.1",
                        timeout=240)
    assert result.returncode == 0 and "version 2 of" in result.stdout, result.stdout[-4000:]
    entry = grown["versions"][1]
    assert (entry["added"], entry["changed"], entry["removed"], entry["count"]) == (5, 1, [11, 22, 40], 6)
    two = read_manifest(tmp_path / "two")
    assert [{k: v for k, v in e.items() if k != "embedded_at"} for e in two["versions"]] == \
        [{k: v for k, v in e.items() if k != "embedded_at"} for e in grown["versions"]]
    assert (two["count"], two["bad_ids"]) == (grown["count"], grown["bad_ids"]) == (44 - 2 + 6, [])
    _same(tmp_path / "one" / "versions" / "0002", tmp_path / "two" / "versions" / "0002", parts=entry["parts"])


def _grow(data):
    """Week 2: product_00009 arrives (a copy of product_00000's views), product_00002's view 1 is retaken, the bad
    image and product_00008's last view are withdrawn."""
    import shutil

    shutil.copytree(data / "product_00000", data / "product_00009")
    shutil.copy(data / "product_00003" / "00000.png", data / "product_00002" / "00001.png")
    (data / "product_00004" / "00002.png").unlink()
    (data / "product_00008" / "00000.png").unlink()


def test_ranks_given_different_catalogues_stop_together_with_one_line(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "best.pt")
    render_folder(tmp_path / "d0", classes=2, per_class=3)
    render_folder(tmp_path / "d1", classes=3, per_class=3)
    command = (f"exec {sys.executable} {SCRIPT} --checkpoint {checkpoint} --data {tmp_path}/d$HOROVOD_RANK "
               f"--out {tmp_path / 'out'} --workers 0")
    result = run_launcher([str(HOROVODRUN), *HOROVODRUN_CONTROLLER, "-np", "2", "-H", "localhost:2",
                           "bash", "-c", command],
                          kind="horovodrun", env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)
    output = result.stdout
    assert result.returncode != 0
    assert output.count("error: --checkpoint/--data/--out/--part-size: rank(s) [1] were given another") == 1, output
    assert rank_tracebacks(output) == 0, output[-3000:]
    assert not (tmp_path / "out" / "parts").exists()  # nothing was embedded


def test_a_data_folder_missing_on_one_rank_is_one_line_from_that_rank_and_no_traceback(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "best.pt")
    render_folder(tmp_path / "d0", classes=2, per_class=3)  # d1 is missing: rank 1's host lacks the data
    command = (f"exec {sys.executable} {SCRIPT} --checkpoint {checkpoint} --data {tmp_path}/d$HOROVOD_RANK "
               f"--out {tmp_path / 'out'} --workers 0")
    result = run_launcher([str(HOROVODRUN), *HOROVODRUN_CONTROLLER, "-np", "2", "-H", "localhost:2",
                           "bash", "-c", command],
                          kind="horovodrun", env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)
    output = result.stdout
    assert result.returncode != 0
    assert output.count(f"error: rank 1: --data: '{tmp_path}/d1' is neither a folder") == 1, output[-3000:]
    assert rank_tracebacks(output) == 0 and "HorovodInternalError:" not in output, output[-3000:]
    assert not (tmp_path / "out" / "parts").exists()

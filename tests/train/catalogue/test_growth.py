"""A real catalogue grows by versions: embedding the source again embeds only new and changed images, records the
removed ones, the index follows in place and queries name what was embedded (one process, real PNG files)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from catalogue_fixtures import make_checkpoint, render_folder

from pksampler.datasets import SyntheticProducts
from pksampler.train.catalogue import cli
from pksampler.train.catalogue.embed import EmbedOptions, embed_catalogue
from pksampler.train.catalogue.index import IndexOptions
from pksampler.train.catalogue.parts import iter_parts, read_manifest
from pksampler.train.catalogue.query import query_catalogue
from pksampler.train.catalogue.update import grow_index
from pksampler.train.catalogue.versions import ItemNames
from pksampler.train.errors import ConfigError
from pksampler.train.runtime.distributed import Backend

OPTIONS = EmbedOptions(part_size=8, batch_size=4, workers=0)


def _by_name(catalogue):
    """name -> vector of every live item of the catalogue."""
    manifest = read_manifest(catalogue)
    names = ItemNames(catalogue, manifest)
    return {names(int(i))[0]: e for _, vectors, ids in iter_parts(catalogue, manifest, mmap=False)
            for e, i in zip(vectors, ids)}


def _week2(data, tmp_path):
    """Two new products (four views each), one retaken photo, one withdrawn view."""
    SyntheticProducts(7, 4, image_size=40, root=tmp_path / "more")
    for name in ("product_00005", "product_00006"):
        shutil.copytree(tmp_path / "more" / name, data / name)
    shutil.copy(data / "product_00003" / "00000.png", data / "product_00001" / "00002.png")
    (data / "product_00002" / "00003.png").unlink()


def test_a_catalogue_grows_by_what_changed_and_its_index_follows(tmp_path, capsys):
    checkpoint = make_checkpoint(tmp_path / "best.pt")
    data = render_folder(tmp_path / "products", classes=5, per_class=4)
    catalogue, index = tmp_path / "catalogue", tmp_path / "index"
    first = embed_catalogue(checkpoint, str(data), catalogue, Backend(), options=OPTIONS)
    assert [v["version"] for v in first["versions"]] == [1] and first["next_id"] == 20 and first["count"] == 20
    grow_index(catalogue, index)
    week1 = (catalogue / "embeddings" / "part-00000.npy").read_bytes()
    changed_id = ItemNames(catalogue, first).__call__  # names as embedded in week 1
    assert changed_id(6) == ("product_00001/00002.png", "product_00001")

    _week2(data, tmp_path)
    capsys.readouterr()
    second = embed_catalogue(checkpoint, str(data), catalogue, Backend(), options=OPTIONS)
    out = capsys.readouterr().out
    assert "version 2 of" in out and "2 new" not in out and "8 new, 1 changed, 2 removed" in out, out
    entry = second["versions"][1]
    assert (entry["added"], entry["changed"], entry["removed"], entry["count"]) == (8, 1, [6, 11], 9)
    assert second["plan"] == first["plan"] and second["count"] == 20 - 2 + 9 and second["next_id"] == 29
    assert (catalogue / "embeddings" / "part-00000.npy").read_bytes() == week1  # week 1's parts are not touched
    assert sorted(p.name for p in (catalogue / "versions" / "0002" / "embeddings").iterdir()) == \
        ["part-00000.npy", "part-00001.npy"]
    # the grown catalogue holds what embedding the changed folder afresh would, name for name
    fresh = embed_catalogue(checkpoint, str(data), tmp_path / "fresh", Backend(), options=OPTIONS)
    grown, afresh = _by_name(catalogue), _by_name(tmp_path / "fresh")
    assert fresh["count"] == len(grown) == 27 and grown.keys() == afresh.keys()
    assert max(float(np.abs(grown[n] - afresh[n]).max()) for n in grown) < 1e-5

    meta = grow_index(catalogue, index, options=IndexOptions(compact_fraction=1.0))  # a delta, even this large
    assert meta["history"][-1]["how"] == "updated" and meta["count"] == 27 and not meta["last_drift"]["applies"]
    scans = [data / "product_00006" / "00001.png", data / "product_00001" / "00002.png"]
    lines = query_catalogue(index, scans, tmp_path / "query", checkpoint=checkpoint, k=27)
    found = [[r["id"] for r in line["results"]] for line in lines]
    assert all(6 not in row and 11 not in row and len(row) == 27 for row in found)  # removed ids never come back
    assert lines[0]["results"][0]["path"].endswith("product_00006/00001.png")  # a new product finds itself
    assert lines[1]["results"][0]["path"].endswith("product_00001/00002.png") and lines[1]["results"][0]["id"] >= 20

    # nothing changed: nothing embedded, the index is up to date
    capsys.readouterr()
    assert embed_catalogue(checkpoint, str(data), catalogue, Backend(), options=OPTIONS) == second
    assert "nothing to embed" in capsys.readouterr().out
    assert cli.build_index_main([str(catalogue), "--out", str(index)]) == 0
    assert "already holds version 2" in capsys.readouterr().out

    # week 3 only withdraws a view: a version with nothing to embed, its id leaves the index
    (data / "product_00000" / "00001.png").unlink()
    third = embed_catalogue(checkpoint, str(data), catalogue, Backend(), options=OPTIONS)
    assert third["versions"][2] | {"embedded_at": None} == {
        "version": 3, "added": 0, "changed": 0, "removed": [1], "model_digest": first["model"]["digest"],
        "items": None, "count": 0, "bad": 0, "embedded_at": None}
    assert (third["count"], third["next_id"]) == (26, 29)
    meta = grow_index(catalogue, index, options=IndexOptions(compact_fraction=1.0))
    assert meta["count"] == 26 and meta["history"][-1]["removed"] == 1
    lines = query_catalogue(index, scans, tmp_path / "query3", checkpoint=checkpoint, k=26)
    assert all(1 not in {r["id"] for r in line["results"]} and len(line["results"]) == 26 for line in lines)


def test_growth_refuses_another_model_and_a_catalogue_without_item_tables(tmp_path, capsys):
    checkpoint, other = make_checkpoint(tmp_path / "a.pt"), make_checkpoint(tmp_path / "b.pt", seed=1)
    data = render_folder(tmp_path / "products", classes=2, per_class=3)
    catalogue = tmp_path / "catalogue"
    embed_catalogue(checkpoint, str(data), catalogue, Backend(), options=OPTIONS)
    capsys.readouterr()
    assert cli.embed_main(["--checkpoint", str(other), "--data", str(data), "--out", str(catalogue),
                           "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "a new model means a new catalogue and a new index" in err, err
    manifest = json.loads((catalogue / "manifest.json").read_text())
    for field in ("versions", "embedded", "next_id"):  # as written before catalogues recorded their items
        manifest.pop(field)
    (catalogue / "manifest.json").write_text(json.dumps(manifest))
    (data / "product_00000" / "00000.png").unlink()
    with pytest.raises(ConfigError, match=r"^--out: .* was embedded before catalogues recorded their items .* embed "
                                          r"the source into a new --out"):
        embed_catalogue(checkpoint, str(data), catalogue, Backend(), options=OPTIONS)

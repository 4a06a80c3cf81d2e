"""Every data source the trainer reads embeds into the same catalogue: folder, list file, packed shards, s3://."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from catalogue_fixtures import make_checkpoint
from launch import ROOT
from synthetic_pack import synthetic_pack, uploaded

from pksampler.train.catalogue.embed import EmbedOptions, embed_catalogue
from pksampler.train.catalogue.parts import read_manifest, read_part
from pksampler.train.runtime.distributed import Backend


def _catalogue(folder):
    manifest = read_manifest(folder)
    parts = [read_part(folder, e["part"], mmap=False) for e in manifest["parts"]]
    return manifest, np.concatenate([e for e, _ in parts]), np.concatenate([i for _, i in parts])


def test_folder_list_file_shards_and_an_object_store_give_one_catalogue(tmp_path, seaweed):
    checkpoint = make_checkpoint(tmp_path / "best.pt")
    shards = synthetic_pack(tmp_path / "folder", tmp_path / "shards", num_classes=5, images_per_class=4,
                            image_size=32, shard_size="16KB")
    lines = [f"{p.relative_to(tmp_path / 'folder')},{p.parent.name}" for p in sorted((tmp_path / "folder").rglob("*.png"))]
    (tmp_path / "folder" / "list.csv").write_text("path,label\n" + "\n".join(lines) + "\n")
    remote = uploaded(shards, seaweed, "s3://pksampler-test/catalogue/shards")
    options = EmbedOptions(part_size=6, batch_size=4, workers=0)
    sources = {"folder": str(tmp_path / "folder"), "list": str(tmp_path / "folder" / "list.csv"),
               "shards": str(shards), "s3": remote}
    results = {}
    for name, where in sources.items():
        embed_catalogue(checkpoint, where, tmp_path / f"catalogue-{name}", Backend(), options=options)
        results[name] = _catalogue(tmp_path / f"catalogue-{name}")
    manifest, embeddings, ids = results["folder"]
    assert manifest["count"] == 20 and np.array_equal(ids, np.arange(20))
    for name, (other, other_embeddings, other_ids) in results.items():
        assert other["source"]["kind"] == {"folder": "folder", "list": "list"}.get(name, "shards")
        assert np.array_equal(other_ids, ids) and np.array_equal(other_embeddings, embeddings), name


def test_bad_input_is_one_line_naming_the_argument(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "best.pt")
    run = subprocess.run([sys.executable, str(ROOT / "train" / "embed_catalogue.py"), "--checkpoint", str(checkpoint),
                          "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: --data: '{tmp_path / 'nowhere'}' is neither a folder, a list file nor an s3:// location "
        "(it does not exist)"]


def test_embedding_another_source_into_a_finished_folder_is_refused(tmp_path, monkeypatch, capsys):
    from catalogue_fixtures import render_folder

    from pksampler.train.errors import ConfigError

    checkpoint = make_checkpoint(tmp_path / "best.pt")
    first = render_folder(tmp_path / "a", classes=3, per_class=5)
    second = render_folder(tmp_path / "b", classes=5, per_class=3)  # as many images, other products
    options = EmbedOptions(part_size=10, batch_size=5, workers=0)
    manifest = embed_catalogue(checkpoint, str(first), tmp_path / "cat", Backend(), options=options)
    before = (tmp_path / "cat" / "embeddings" / "part-00000.npy").read_bytes()
    with pytest.raises(ConfigError, match=r"^--out/--data: .*cat holds parts embedded from another data source"):
        embed_catalogue(checkpoint, str(second), tmp_path / "cat", Backend(), options=options)
    assert (tmp_path / "cat" / "embeddings" / "part-00000.npy").read_bytes() == before
    assert read_manifest(tmp_path / "cat")["source"] == manifest["source"]  # still names the source of its vectors
    # the same source again, spelt relative to another working folder: the catalogue already holds it
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert embed_catalogue(checkpoint, "a", tmp_path / "cat", Backend(), options=options)["source"] == \
        manifest["source"]
    assert "nothing to embed" in capsys.readouterr().out
    assert (tmp_path / "cat" / "embeddings" / "part-00000.npy").read_bytes() == before

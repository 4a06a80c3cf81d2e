"""pack: one writer per folder, a reproducible skipped.tsv, member names webdataset can read."""

from __future__ import annotations

import fcntl
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pksampler.datasets import ShardedDataset
from pksampler.datasets.pack import pack


def png_bytes(value: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_second_pack_into_the_same_folder_is_refused_while_the_first_runs(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "0.png").write_bytes(png_bytes(1))
    (tmp_path / "out" / ".pack").mkdir(parents=True)
    with open(tmp_path / "out" / ".pack" / "lock", "a+") as held:  # what a running pack holds
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 12345\n")
        held.flush()
        with pytest.raises(ValueError, match=rf"pack: {tmp_path / 'out'} is being written by another pack \(pid 12345\)"):
            pack(tmp_path / "src", tmp_path / "out")
        assert not (tmp_path / "out" / "manifest.json").exists()
    assert pack(tmp_path / "src", tmp_path / "out")["num_samples"] == 1  # released: the next pack runs


def test_skipped_tsv_is_identical_between_packs_and_escapes_tabs_and_newlines(tmp_path):
    folder = tmp_path / "src" / "a"
    folder.mkdir(parents=True)
    (folder / "good.png").write_bytes(png_bytes(5))
    (folder / "bad\tname.png").write_bytes(b"garbage")
    (folder / "two\nlines.png").write_bytes(b"not an image at all")
    pack(tmp_path / "src", tmp_path / "one")
    pack(tmp_path / "src", tmp_path / "two")
    first = (tmp_path / "one" / "skipped.tsv").read_text()
    assert first == (tmp_path / "two" / "skipped.tsv").read_text()
    rows = [line.split("\t") for line in first.splitlines()]
    assert len(rows) == 2 and all(len(row) == 2 for row in rows)
    assert sorted(row[0] for row in rows) == sorted([f"{folder}/bad\\tname.png", f"{folder}/two\\nlines.png"])
    assert " at 0x" not in first


def test_odd_extensions_are_stored_under_the_image_format_and_read_by_webdataset(tmp_path):
    import webdataset

    (tmp_path / "a.cls").write_bytes(png_bytes(10))
    (tmp_path / ("b." + "x" * 120)).write_bytes(png_bytes(20))
    (tmp_path / "c.png").write_bytes(png_bytes(30))
    (tmp_path / "list.csv").write_text(f"a.cls,0\nb.{'x' * 120},0\nc.png,1\n")
    manifest = pack(tmp_path / "list.csv", tmp_path / "out")
    assert manifest["num_samples"] == 3 and manifest["skipped"] == 0
    samples = list(webdataset.WebDataset(str(tmp_path / "out" / "shard-000000.tar"), shardshuffle=False))
    assert [sorted(k for k in s if not k.startswith("__")) for s in samples] == [["cls", "png"]] * 3
    assert [int(s["cls"]) for s in samples] == [0, 0, 1]
    assert ShardedDataset(tmp_path / "out").load(1).getpixel((0, 0)) == (20, 20, 20)


@pytest.mark.parametrize("field, value, message", [
    ("shard", 2**31, r"names shard 2147483648 at sample 3; .*manifest\.json lists (\d+) shards, ids \[0, \1\)"),
    ("offset", 2**40, r"puts sample 3 at bytes \[1099511627776, \d+\) of shard \d, which has \d+ bytes"),
])
def test_shard_ids_and_payloads_outside_the_manifest_are_refused_at_open(tmp_path, field, value, message):
    # An index whose fingerprint matches (a packer's bug, or damage the fingerprint's ends do not cover) with one
    # shard id of 2**31 made locality: shard allocate 16 GiB per rank, and was a raw ValueError without it.
    import json

    from pksampler.datasets.sharded import ShardDamagedError, write_index

    for label in range(4):
        (tmp_path / "src" / f"c{label}").mkdir(parents=True)
        for view in range(3):
            (tmp_path / "src" / f"c{label}" / f"{view}.png").write_bytes(png_bytes(16 * label + view))
    pack(tmp_path / "src", tmp_path / "out", shard_size="8KB")
    dataset = ShardedDataset(tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    index = np.array(dataset.index)
    index[3][field] = value
    extra = {key: value for key, value in manifest.items() if key in ("class_contiguous",)}
    write_index(tmp_path / "out", index, np.array(dataset.labels), classes=manifest["classes"],
                shards=manifest["shards"], extra=extra)
    with pytest.raises(ShardDamagedError, match=message):
        ShardedDataset(tmp_path / "out")

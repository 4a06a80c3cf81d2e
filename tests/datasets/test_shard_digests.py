"""Shard sets that rot: per-shard digests at first open and in full, a full labels pass, pack re-checks."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pksampler.datasets import ShardedDataset
from pksampler.datasets.pack import pack
from pksampler.datasets.sharded import INDEX_DTYPE, write_index


def same_size_source(root: Path, classes: int = 2, per_class: int = 3) -> None:
    """Identical PNG bytes everywhere, so shards of one class each have equal sizes."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), 90, np.uint8)).save(buffer, format="PNG")
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            (root / f"c{c}" / f"{i}.png").write_bytes(buffer.getvalue())


def noise_source(root: Path, count: int = 320) -> None:
    rng = np.random.default_rng(1)
    for index in range(count):
        path = root / f"c{index * 2 // count}" / f"{index:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)).save(path)


def flip_middle_byte(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        value = handle.read(1)
        handle.seek(size // 2)
        handle.write(bytes([value[0] ^ 0xFF]))


def test_two_swapped_shards_of_equal_size_are_refused_at_first_open(tmp_path):
    same_size_source(tmp_path / "src")
    root = tmp_path / "shards"
    manifest = pack(tmp_path / "src", root, shard_size="8KB")
    assert len(manifest["shards"]) == 2 and manifest["shards"][0]["bytes"] == manifest["shards"][1]["bytes"]
    os.rename(root / "shard-000000.tar", root / "swap")
    os.rename(root / "shard-000001.tar", root / "shard-000000.tar")
    os.rename(root / "swap", root / "shard-000001.tar")
    dataset = ShardedDataset(root)
    with pytest.raises(ValueError, match=rf"shard {root / 'shard-000000.tar'} does not match its fingerprint in "
                                         r".*manifest.json: its content is damaged or it was swapped"):
        dataset[0]


def test_a_damaged_small_shard_is_refused_at_first_open(tmp_path):
    same_size_source(tmp_path / "src")
    root = tmp_path / "shards"
    pack(tmp_path / "src", root, shard_size="8KB")
    flip_middle_byte(root / "shard-000001.tar")
    dataset = ShardedDataset(root)
    assert dataset[0][1] == 0  # shard 0 is intact
    with pytest.raises(ValueError, match=r"shard-000001.tar does not match its fingerprint"):
        dataset[3]


def test_damage_in_the_middle_of_a_large_shard_is_found_by_the_full_verification(tmp_path):
    noise_source(tmp_path / "src")
    root = tmp_path / "shards"
    pack(tmp_path / "src", root, shard_size="64MB")
    assert (root / "shard-000000.tar").stat().st_size > 3 * 2**20
    flip_middle_byte(root / "shard-000000.tar")
    ShardedDataset(root)  # the cheap checks pass: fingerprints cover the first and last MiB
    with pytest.raises(ValueError, match=r"shard .*shard-000000.tar does not match the SHA-256 in .*manifest.json"):
        ShardedDataset(root, verify_index=True)


def test_pack_rewrites_a_shard_damaged_in_place_on_a_rerun(tmp_path):
    noise_source(tmp_path / "src", count=40)
    root = tmp_path / "shards"
    pack(tmp_path / "src", root, shard_size="256KB")
    original = (root / "shard-000000.tar").read_bytes()
    flip_middle_byte(root / "shard-000000.tar")
    pack(tmp_path / "src", root, shard_size="256KB")
    assert (root / "shard-000000.tar").read_bytes() == original
    ShardedDataset(root, verify_index=True)


def large_labels(tmp_path: Path, n: int = 600_000, classes: int = 1000) -> Path:
    """An index of n samples (labels.npy of several MiB: damage in its middle passes the fingerprint)."""
    index = np.zeros(n, dtype=INDEX_DTYPE)
    labels = np.repeat(np.arange(classes, dtype=np.int64), n // classes)
    write_index(tmp_path, index, labels, classes=[str(c) for c in range(classes)],
                shards=[{"name": "shard-000000.tar", "bytes": 1 << 20, "samples": n}], extra={"class_contiguous": True})
    return tmp_path / "labels.npy"


def poke_label(path: Path, sample: int, value: int) -> None:
    labels = np.load(path, mmap_mode="r+")
    labels[sample] = value
    labels.flush()
    del labels


@pytest.mark.parametrize("value, message", [
    (-7, r"holds class code -7 at sample 300000, outside \[0, 1000\)"),
    (999, r"holds class code 999 at sample 300000, outside|is not in class order near sample 0"),
    (1001, r"holds class code 1001 at sample 300000, outside \[0, 1000\)"),
])
def test_phantom_class_codes_in_the_middle_of_labels_are_refused_at_open(tmp_path, value, message):
    path = large_labels(tmp_path)
    poke_label(path, 300_000, value)
    with pytest.raises(ValueError, match=rf"ShardedDataset: {path} .*"):
        ShardedDataset(tmp_path)
    with pytest.raises(ValueError, match=message):
        ShardedDataset(tmp_path)


def test_labels_moved_within_range_are_refused_by_the_class_counts(tmp_path):
    path = large_labels(tmp_path)
    poke_label(path, 300_599, 501)  # the last sample of class 500 becomes class 501: order kept, counts not
    with pytest.raises(ValueError, match=r"gives class 500 599 samples, .*manifest.json says 600"):
        ShardedDataset(tmp_path)


def test_the_trainer_finds_rot_in_the_middle_of_the_index_in_the_background(tmp_path):
    from pksampler.train.engine.datacheck import IndexDigestHook
    from pksampler.train.runtime.distributed import Backend
    from pksampler.train.errors import ConfigError

    large_labels(tmp_path)
    index = np.load(tmp_path / "index.npy", mmap_mode="r+")
    index[300_000]["offset"] = 12345  # a sample that would read another's bytes
    index.flush()
    del index
    dataset = ShardedDataset(tmp_path)  # the fingerprints (first and last MiB) pass
    hook = IndexDigestHook(dataset, Backend())
    hook.before_train()
    with pytest.raises(ConfigError, match=rf"data.root: the shard set's index does not match its manifest: "
                                          rf"ShardedDataset: {tmp_path / 'index.npy'} and .* do not match the SHA-256"):
        hook.after_epoch()


@pytest.mark.parametrize("labels", [np.array([2**63, 1], dtype=np.uint64), np.array([-1, 0]), np.array([0.0, 1.0])])
def test_write_index_refuses_labels_that_are_not_class_codes(tmp_path, labels):
    with pytest.raises(ValueError, match=r"write_index\(labels=\) must be integer class codes in \[0, 2\)"):
        write_index(tmp_path, np.zeros(2, dtype=INDEX_DTYPE), labels, classes=["a", "b"], shards=[])
    assert not (tmp_path / "manifest.json").exists()


def test_a_manifest_that_lists_one_shard_file_twice_is_refused_at_open(tmp_path):
    same_size_source(tmp_path / "src")
    root = tmp_path / "shards"
    manifest = pack(tmp_path / "src", root, shard_size="8KB")
    assert len(manifest["shards"]) == 2
    # shard 1's entry replaced by shard 0's (name, size, digests): every check of the file itself passes
    manifest["shards"] = [manifest["shards"][0], dict(manifest["shards"][0])]
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"manifest.json lists shard file\(s\) \['shard-000000.tar'\] more than once"):
        ShardedDataset(root)

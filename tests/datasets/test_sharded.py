"""Packed shards: packer output (WebDataset layout, index, manifest), ShardedDataset reads, resume, corrupt
images, path rules, and the memory of a 10^7-entry index."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from pksampler import DistributedBalancedBatchSampler
from pksampler.datasets import ImageFolderDataset, ImageLoadError, LabelledSubset, ShardedDataset, SyntheticProducts
from pksampler.datasets import pack as pack_module
from pksampler.datasets.pack import pack, parse_size, plan_shards
from pksampler.datasets.sharded import INDEX_DTYPE, write_index

DEMO_ARGS = {"num_classes": 160, "images_per_class": 16, "image_size": 48}  # configs/demo.yaml's data.args


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo") / "folder"
    synthetic = SyntheticProducts(**DEMO_ARGS)
    for index in range(len(synthetic)):  # the layout SyntheticProducts(root=) writes, without its per-file fsync
        cls, view = divmod(index, DEMO_ARGS["images_per_class"])
        path = root / synthetic.classes[cls] / f"{view:05d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        synthetic.render(index).save(path, format="PNG")
    return root


@pytest.fixture(scope="module")
def demo_shards(demo_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo_shards") / "shards"
    pack(demo_folder, out, shard_size="256KB")
    return out


def test_packed_synthetic_default_reads_back_identical(demo_folder, demo_shards):
    folder, shards = ImageFolderDataset(demo_folder), ShardedDataset(demo_shards)
    assert len(shards) == len(folder) == 160 * 16
    assert shards.classes == folder.classes
    assert shards.labels.dtype == np.int64 and np.array_equal(shards.labels, folder.labels)
    manifest = json.loads((demo_shards / "manifest.json").read_text())
    assert len(manifest["shards"]) > 5 and manifest["class_counts"] == [16] * 160 and manifest["skipped"] == 0
    for index in range(len(folder)):
        assert shards.read_bytes(index) == Path(folder.paths[index]).read_bytes()  # bytes stored as they are
    for index in range(0, len(folder), 37):
        assert np.array_equal(np.asarray(shards[index][0]), np.asarray(folder[index][0]))


def test_class_contiguous_and_classes_whole_in_shards(demo_shards):
    dataset = ShardedDataset(demo_shards)
    assert np.all(np.diff(dataset.labels) >= 0)
    shard_of = np.asarray(dataset.index["shard"])
    assert np.all(np.diff(shard_of.astype(np.int64)) >= 0)
    for label in range(0, 160, 7):
        assert np.unique(shard_of[dataset.labels == label]).size == 1  # a 16-image class fits one 256 KB shard


def test_sharded_dataloader_workers_and_sampler(demo_folder, demo_shards):
    from pksampler.datasets import train_preset

    shards = ShardedDataset(demo_shards, transform=train_preset(32))
    folder = ImageFolderDataset(demo_folder, transform=train_preset(32))
    shards.read_bytes(0)  # open a handle in the parent: workers must reopen their own after fork
    sampler = DistributedBalancedBatchSampler(shards.labels, 4, 4, num_replicas=2, rank=1)
    batches = {}
    for name, dataset in (("shards", shards), ("folder", folder)):
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
        batches[name] = [batch for batch, _ in zip(loader, range(3))]
    for (xs, ys), (xf, yf) in zip(batches["shards"], batches["folder"]):
        assert xs.shape == (16, 3, 32, 32) and torch.equal(ys, yf) and torch.equal(xs, xf)


def test_pickles_without_the_index_and_reads_after_unpickling(demo_shards):
    import pickle

    dataset = ShardedDataset(demo_shards, decode_size=32)
    dataset.read_bytes(3)
    blob = pickle.dumps(dataset)
    assert len(blob) < 64 * 1024  # the manifest and counters, not the index or labels arrays
    copy = pickle.loads(blob)
    assert isinstance(copy.labels, np.memmap) and np.array_equal(copy.labels, dataset.labels)
    assert copy.read_bytes(3) == dataset.read_bytes(3) and copy.decode_size == 32


def test_shards_readable_by_webdataset_and_tarfile(demo_folder, demo_shards):
    wds = pytest.importorskip("webdataset")
    folder = ImageFolderDataset(demo_folder)
    dataset = ShardedDataset(demo_shards)
    first = str(demo_shards / "shard-000000.tar")
    samples = list(wds.WebDataset(first, shardshuffle=False))
    count = int((dataset.index["shard"] == 0).sum())
    assert len(samples) == count > 0
    for i, sample in enumerate(samples):
        assert sample["__key__"] == f"{i:010d}"
        assert set(sample) >= {"png", "cls"}
        assert int(sample["cls"].decode()) == dataset.labels[i]
        assert sample["png"] == Path(folder.paths[i]).read_bytes()
    with tarfile.open(first) as tar:
        images = [m for m in tar.getmembers() if m.name.endswith(".png")]
        assert [m.offset_data for m in images] == dataset.index["offset"][:count].tolist()


def test_list_file_source_and_max_side(tmp_path):
    src = tmp_path / "imgs"
    SyntheticProducts(3, 3, image_size=64, root=src)
    listing = tmp_path / "list.csv"
    rows = [f"{p.relative_to(src).as_posix()},{p.parent.name}" for p in sorted(src.rglob("*.png"))]
    listing.write_text("path,label\n" + "\n".join(reversed(rows)) + "\n")  # unordered: the packer groups classes
    out = tmp_path / "out"
    assert pack_module.main([str(listing), str(out), "--root", str(src), "--max-side", "40"]) == 0
    dataset = ShardedDataset(out)
    assert dataset.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(dataset[i][0].size == (40, 40) for i in range(len(dataset)))


def test_corrupt_image_left_out_and_reported(tmp_path, capfd):
    src = tmp_path / "src"
    SyntheticProducts(3, 4, image_size=16, root=src)
    bad = src / "product_00001" / "00002.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    Image.new("L", (300, 300)).save(src / "product_00002" / "99999.png")  # a "bomb" under the limit below
    pack(src, tmp_path / "out", max_pixels=50_000)
    err = capfd.readouterr().err
    assert f"left out {bad}" in err and "99999.png" in err and "exceeds the limit max_pixels=50000" in err
    dataset = ShardedDataset(tmp_path / "out")
    assert len(dataset) == 12 - 1 and dataset.labels.tolist() == [0] * 4 + [1] * 3 + [2] * 4
    skipped = (tmp_path / "out" / "skipped.tsv").read_text().splitlines()
    assert len(skipped) == 2 and skipped[0].startswith(str(bad))
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["skipped"] == 2


def test_interrupted_pack_resumes_keeping_finished_shards(tmp_path, monkeypatch):
    src = tmp_path / "src"
    SyntheticProducts(6, 3, image_size=24, root=src)
    reference = tmp_path / "reference"
    pack(src, reference, shard_size="12KB")
    num_shards = len(json.loads((reference / "manifest.json").read_text())["shards"])
    assert num_shards >= 4

    out = tmp_path / "out"
    real = pack_module._write_shard

    def crash_on_third(task):
        if task[1] == 2:
            (out / ".shard-000002.tar.crashed.tmp").write_bytes(b"half a shard")  # what a kill leaves
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(pack_module, "_write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        pack(src, out, shard_size="12KB")
    assert not (out / "manifest.json").exists()
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        ShardedDataset(out)
    kept = {name: (out / name).stat().st_ino for name in ("shard-000000.tar", "shard-000001.tar")}
    (out / "shard-000001.tar").unlink()  # a shard whose sidecar exists but whose tar is gone is redone too

    written = []
    monkeypatch.setattr(pack_module, "_write_shard", lambda task: written.append(task[1]) or real(task))
    pack(src, out, shard_size="12KB")
    assert written == list(range(1, num_shards))
    assert (out / "shard-000000.tar").stat().st_ino == kept["shard-000000.tar"]  # finished shard kept
    assert not list(out.glob(".*.tmp"))
    for name in [f"shard-{s:06d}.tar" for s in range(num_shards)] + ["index.npy", "labels.npy"]:
        assert (out / name).read_bytes() == (reference / name).read_bytes()  # deterministic
    with pytest.raises(ValueError, match="holds a pack of another source or other options"):
        pack(src, out, shard_size="24KB")


def test_manifest_path_rules(demo_shards, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(demo_shards, root)
    manifest = json.loads((root / "manifest.json").read_text())
    for evil in ("../outside.tar", "/etc/passwd.tar", "sub/shard.tar", "..tar"):
        changed = dict(manifest, shards=[dict(manifest["shards"][0], name=evil)] + manifest["shards"][1:])
        (root / "manifest.json").write_text(json.dumps(changed))
        with pytest.raises(ValueError, match=r"shard names must be plain file names"):
            ShardedDataset(root)
    (root / "manifest.json").write_text(json.dumps(manifest))
    outside = tmp_path / "elsewhere.tar"
    shutil.move(root / "shard-000000.tar", outside)
    os.symlink(outside, root / "shard-000000.tar")  # a link escaping the shard folder
    dataset = ShardedDataset(root)
    with pytest.raises(ValueError, match=r"outside the shard folder"):
        dataset.load(0)


def test_missing_and_mismatched_index_name_the_path(demo_shards, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(demo_shards, root)
    labels = np.load(root / "labels.npy")
    np.save(root / "labels.npy", labels[::-1].copy())  # same shape and dtype, other content
    with pytest.raises(ValueError, match=r"labels.npy do not match the fingerprint in .*manifest.json"):
        ShardedDataset(root)
    np.save(root / "labels.npy", labels[:-1])
    with pytest.raises(ValueError, match=r"labels.npy holds int64 \(2559,\); the manifest .* needs int64 \(2560,\)"):
        ShardedDataset(root)
    (root / "index.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"index file missing: .*index.npy"):
        ShardedDataset(root)
    shutil.copy(demo_shards / "index.npy", root / "index.npy")
    shutil.copy(demo_shards / "labels.npy", root / "labels.npy")
    ShardedDataset(root, verify_index=True)
    with open(root / "shard-000001.tar", "ab") as handle:
        handle.write(b"\0" * 512)
    dataset = ShardedDataset(root)
    first_of_shard_1 = int(np.flatnonzero(dataset.index["shard"] == 1)[0])
    with pytest.raises(ValueError, match=r"shard-000001.tar has \d+ bytes, the manifest .* says"):
        dataset.load(first_of_shard_1)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        ShardedDataset(tmp_path / "absent")


def test_corrupt_bytes_in_a_shard_are_replaced_and_counted(tmp_path):
    # Noise PNGs (~12 KB each) fill one shard of several MiB: damage in its middle passes the shard's
    # fingerprint (first and last MiB) and is found when the image is decoded.
    rng = np.random.default_rng(0)
    for index in range(320):
        path = tmp_path / "src" / f"c{index // 160}" / f"{index:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)).save(path)
    root = tmp_path / "shards"
    pack(tmp_path / "src", root, shard_size="64MB")
    dataset = ShardedDataset(root, on_bad="raise")
    middle = (dataset.shard_bytes[0] // 2)
    sample = int(np.searchsorted(dataset.index["offset"], middle))
    record = dataset.index[sample]
    assert 2**20 < int(record["offset"]) < dataset.shard_bytes[0] - 2**20
    with open(root / "shard-000000.tar", "r+b") as handle:  # same size: the manifest still matches
        handle.seek(int(record["offset"]))
        handle.write(b"\0" * int(record["size"]))
    with pytest.raises(ImageLoadError, match=rf"shard-000000.tar@\d+\+\d+ \(sample {sample}\)"):
        dataset[sample]
    replacing = ShardedDataset(root)
    subset = LabelledSubset(replacing, np.arange(sample - 2, sample + 3))
    image, label = subset[2]
    assert label == int(replacing.labels[sample]) and image.size == (64, 64)
    assert subset.bad_image_counts() == (1, 1)


def test_plan_and_size_parsing():
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    # each sample costs 1024 (payload) + 1536 (headers) tar bytes; 4 fit a 10240-byte shard
    assert plan_shards(labels, np.full(10, 1000), 10240).tolist() == [0, 3, 5, 9, 10]
    assert plan_shards(labels, np.full(10, 1000), 10**9).tolist() == [0, 10]
    assert plan_shards(labels, np.full(10, 10**6), 4096).tolist() == list(range(11))  # oversized: one per shard
    assert parse_size("512MB") == 512 * 10**6 and parse_size("1GiB") == 2**30 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match=r"--shard-size: expected a size such as 512MB"):
        parse_size("lots")


def test_cli_prints_progress_lines_without_a_terminal(tmp_path):
    src = tmp_path / "src"
    SyntheticProducts(2, 2, image_size=16, root=src)
    run = subprocess.run([sys.executable, "-m", "pksampler.datasets.pack", str(src), str(tmp_path / "out"),
                          "--workers", "2", "--shard-size", "4KB"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "pack: 4/4 images" in run.stderr and "images/s" in run.stderr
    assert "packed 4 images of 2 classes" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "pksampler.datasets.pack", str(tmp_path / "nope"), str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "neither a folder of class folders nor a list file" in bad.stderr


def _rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_ten_million_entry_index_is_memory_mapped(tmp_path):
    n, classes = 10**7, 10**5
    index = np.zeros(n, dtype=INDEX_DTYPE)
    index["size"] = 1
    labels = np.repeat(np.arange(classes, dtype=np.int64), n // classes)
    write_index(tmp_path, index, labels, classes=[str(c) for c in range(classes)],
                shards=[{"name": "shard-000000.tar", "bytes": 1, "samples": n}], extra={"class_contiguous": True})
    del index, labels
    gc.collect()
    before = _rss_bytes()
    dataset = ShardedDataset(tmp_path)
    assert len(dataset) == n and dataset.labels[-1] == classes - 1 and dataset.num_classes == classes
    members = dataset._class_members(12345)  # same-class lookup by binary search, no scan
    assert members.tolist() == list(range(12345 * 100, 12346 * 100))
    grown = _rss_bytes() - before
    assert grown < 200 * 2**20, f"opening a 10^7-entry index grew RSS by {grown / 2**20:.0f} MiB"
    assert isinstance(dataset.labels, np.memmap) and isinstance(dataset.index, np.memmap)

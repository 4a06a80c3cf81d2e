"""FIFOs and devices are refused by path, without blocking: class folders, list files, shard slots, pack."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pksampler.datasets import ImageFolderDataset, ImageLoadError, ListFileDataset, ShardedDataset, load_rgb
from pksampler.datasets.pack import pack


def write_png(path: Path, value: int = 100) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(path)


@pytest.fixture
def fifos():
    """Make FIFOs; afterwards open each for writing once, which releases a reader still blocked on it."""
    made: list[Path] = []

    def make(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        made.append(path)
        return path

    yield make
    for path in made:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def finishes(function, seconds: float = 60.0):
    """``function()``'s result; fails (instead of hanging the suite) when it blocks."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_a_fifo_in_a_class_folder_is_left_out_by_path(tmp_path, fifos):
    write_png(tmp_path / "a" / "1.png")
    write_png(tmp_path / "b" / "1.png")
    fifo = fifos(tmp_path / "a" / "2.jpg")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = finishes(lambda: ImageFolderDataset(tmp_path, skip_bad=True))
    assert str(fifo) not in dataset.paths and len(dataset) == 2
    assert any(f"{fifo} (not a regular file" in str(w.message) for w in caught)


def test_a_listed_fifo_or_device_is_a_bad_image_named_by_path(tmp_path, fifos):
    write_png(tmp_path / "1.png")
    fifo = fifos(tmp_path / "2.png")
    with pytest.raises(ImageLoadError, match=rf"cannot decode image {fifo}: {fifo} is a FIFO, not a regular file"):
        finishes(lambda: load_rgb(fifo))
    with pytest.raises(ImageLoadError, match=r"/dev/null is a device, not a regular file"):
        load_rgb("/dev/null")
    (tmp_path / "list.csv").write_text("1.png,a\n2.png,a\n1.png,b\n")
    with pytest.warns(UserWarning, match=r"skipped 1 unreadable image file"):
        dataset = finishes(lambda: ListFileDataset(tmp_path / "list.csv", skip_bad=True))
    assert len(dataset) == 2
    fifo_list = fifos(tmp_path / "fifo.csv")
    with pytest.raises(ValueError, match=rf"list_file=\) is not a regular file .*: {fifo_list}"):
        finishes(lambda: ListFileDataset(fifo_list))


def packed(tmp_path: Path) -> Path:
    for c in range(2):
        for i in range(2):
            write_png(tmp_path / "src" / f"c{c}" / f"{i}.png", 50 * c + i)
    pack(tmp_path / "src", tmp_path / "shards")
    return tmp_path / "shards"


def test_a_fifo_in_a_shard_slot_or_as_the_manifest_is_refused_by_path(tmp_path, fifos):
    root = packed(tmp_path)
    dataset = ShardedDataset(root)
    (root / "shard-000000.tar").unlink()
    fifo = fifos(root / "shard-000000.tar")
    with pytest.raises(ValueError, match=rf"ShardedDataset: shard {fifo} is a FIFO, not a regular file"):
        finishes(lambda: dataset.load(0))
    (root / "manifest.json").unlink()
    manifest = fifos(root / "manifest.json")
    with pytest.raises(ValueError, match=rf"{manifest} is not a regular file"):
        finishes(lambda: ShardedDataset(root))


def test_pack_leaves_out_links_to_devices_and_fifos(tmp_path, fifos):
    for c in range(2):
        write_png(tmp_path / "src" / f"c{c}" / "0.png", 60 * c)
    (tmp_path / "src" / "c0" / "zero.png").symlink_to("/dev/zero")
    fifos(tmp_path / "src" / "c1" / "pipe.png")
    with pytest.warns(UserWarning, match=r"zero.png \(not a regular file"):
        manifest = finishes(lambda: pack(tmp_path / "src", tmp_path / "out"))
    assert manifest["num_samples"] == 2

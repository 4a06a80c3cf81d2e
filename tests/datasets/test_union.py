"""UnionDataset: one label space over named datasets, classes namespaced, samples and shards routed to their part."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from pksampler.datasets import ImageFolderDataset, ImageLoadError, LabelledSubset, ShardedDataset, UnionDataset
from pksampler.datasets.pack import pack


def grey_folder(root: Path, classes: int, per_class: int, base: int) -> Path:
    """``root/c<k>/<i>.png``: flat PNGs of grey ``base + 10 * k + i``, so a decoded pixel names its sample."""
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(np.full((8, 8, 3), base + 10 * c + i, np.uint8)).save(root / f"c{c}" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("union")
    photos = grey_folder(root / "photos", classes=3, per_class=2, base=0)
    products = grey_folder(root / "products", classes=2, per_class=3, base=100)
    pack(grey_folder(root / "src", classes=2, per_class=4, base=200), root / "packed", shard_size="4KB")
    return {"photos": photos, "products": products, "packed": root / "packed", "src": root / "src"}


def test_equal_class_names_stay_apart_and_labels_follow_each_part(parts):
    photos, products = ImageFolderDataset(parts["photos"]), ImageFolderDataset(parts["products"])
    assert photos.classes[:2] == products.classes  # both have c0 and c1
    union = UnionDataset([("photos", photos), ("products", products)])
    assert union.classes == ["photos/c0", "photos/c1", "photos/c2", "products/c0", "products/c1"]
    assert union.num_classes == 5 and len(union) == 12
    assert union.labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4]
    assert union.sources() == [("photos", 6, 3), ("products", 6, 2)]
    assert photos.sources() == []
    for index in range(len(union)):  # every sample decodes from its own part: the grey level names it
        part, inner = union.locate(index)
        grey = int(np.asarray(union.load(index))[0, 0, 0])
        assert grey == int(np.asarray([photos, products][part].load(inner))[0, 0, 0])
        assert (grey >= 100) == (part == 1)
    assert union.describe(7).startswith("products: ") and union.describe(7).endswith(".png")


def test_shard_ids_only_when_every_part_is_packed_and_numbered_apart(parts):
    packed = ShardedDataset(parts["packed"])
    twice = UnionDataset([("a", packed), ("b", ShardedDataset(parts["packed"]))])
    ids = twice.shard_ids
    shards = int(packed.shard_ids.max()) + 1
    assert shards > 1
    assert ids.tolist() == packed.shard_ids.tolist() + (packed.shard_ids + shards).tolist()
    assert twice.unsharded() == [] and twice.verifiable
    mixed = UnionDataset([("photos", ImageFolderDataset(parts["photos"])), ("packed", packed)])
    assert mixed.shard_ids is None and mixed.unsharded() == ["photos"]
    mixed.prefetch([0, 7, 8])  # routed to the parts, offsets removed: the shard part reads its samples 1 and 2
    assert int(np.asarray(mixed.load(8))[0, 0, 0]) == 202


def test_bad_parts_are_named(parts):
    photos = ImageFolderDataset(parts["photos"])
    with pytest.raises(ValueError, match=r"part 1 is named 'photos'"):
        UnionDataset([("photos", photos), ("photos", photos)])
    with pytest.raises(ValueError, match="at least one"):
        UnionDataset([])
    empty = ImageFolderDataset(parts["photos"])
    empty.paths, empty.labels = [], empty.labels[:0]
    with pytest.raises(ValueError, match="dataset 'none' has no images"):
        UnionDataset([("photos", photos), ("none", empty)])


def test_object_stores_of_the_parts_report_as_one(parts):
    """The per-epoch request report reads one store: the parts' counts summed; workers spawn for any remote part."""
    local, first, second = (ImageFolderDataset(parts[name]) for name in ("photos", "products", "src"))
    assert UnionDataset([("a", local), ("b", first)]).store is None
    first.store = SimpleNamespace(counts=lambda: (3, 300))
    second.store = SimpleNamespace(counts=lambda: (4, 400))
    one = UnionDataset([("a", local), ("b", first)])
    assert one.store is first.store and one.worker_start_method == "spawn"
    assert UnionDataset([("a", first), ("b", local), ("c", second)]).store.counts() == (7, 700)


def test_two_parts_that_hold_one_image_file_are_refused(parts, tmp_path):
    """Through a link or a list file, one image in two parts would be a sample of two classes."""
    (tmp_path / "again").symlink_to(parts["photos"])
    with pytest.raises(ValueError, match=r"datasets 'photos' and 'again' share 6 image file\(s\), e.g. .*photos/c0/0.png"):
        UnionDataset([("photos", ImageFolderDataset(parts["photos"])), ("again", ImageFolderDataset(tmp_path / "again"))])
    packed = ShardedDataset(parts["packed"])
    assert packed.files() is None  # nothing to compare: the union of two packed copies is the packer's business
    assert len(UnionDataset([("a", packed), ("b", ShardedDataset(parts["packed"]))])) == 16


def test_each_part_keeps_its_bad_image_policy_whatever_part_comes_first(parts, tmp_path, capsys):
    """A folder opened with on_bad="raise" behind a packed set (on_bad="replace") still raises for its bad image;
    the packed set's samples are still replaced; a caller's "raise" (the held-out evaluator's) holds for both."""
    strict = grey_folder(tmp_path / "strict", classes=1, per_class=2, base=50)
    (strict / "c0" / "1.png").write_bytes(b"not a png")
    union = UnionDataset([("packed", ShardedDataset(parts["packed"])),
                          ("strict", ImageFolderDataset(strict, on_bad="raise"))])
    assert union.on_bad == "replace"
    bad = len(union) - 1  # strict/c0/1.png, the last sample
    with pytest.raises(ImageLoadError, match="1.png"):
        union[bad]
    assert union[bad - 1][1] == union.labels[bad - 1]  # the good one loads
    raising = LabelledSubset(union, np.arange(len(union)), on_bad="raise")
    with pytest.raises(ImageLoadError):
        raising[bad]
    forgiving = UnionDataset([("packed", ShardedDataset(parts["packed"])), ("loose", ImageFolderDataset(strict))])
    assert forgiving[bad][1] == forgiving.labels[bad]  # replaced by the other member of its class
    assert "bad image" in capsys.readouterr().err

"""build_data over DATASETS: each entry opened in its detected (or given) layout, one label space, one split."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pksampler.datasets import UnionDataset
from pksampler.datasets.pack import pack
from pksampler.train.builders import build_data, detect_layout, split_gaps
from pksampler.train.config.load import ConfigError, load_config
from pksampler.train.run_setup import train
from pksampler.train.runtime.distributed import Backend
from tiny_runs import TINY


def grey_folder(root: Path, classes: int, per_class: int) -> Path:
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(np.full((8, 8, 3), 10 * c + i, np.uint8)).save(root / f"c{c}" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def datasets_path(tmp_path_factory) -> Path:
    """DATASETS_PATH with a folder (photos), another (products), a packed set and a list file over both folders."""
    root = tmp_path_factory.mktemp("mounted")
    grey_folder(root / "photos", classes=6, per_class=3)
    grey_folder(root / "products", classes=4, per_class=3)
    pack(grey_folder(root.parent / f"{root.name}-src", classes=5, per_class=3), root / "packed", shard_size="4KB")
    # the documented way to merge classes across datasets: one list file naming both folders' images
    rows = [f"photos/c0/{i}.png,same" for i in range(3)] + [f"products/c0/{i}.png,same" for i in range(3)]
    (root / "merged.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    return root


def union_config(datasets_path: Path, names: str, *extra: str):
    return load_config(None, [*TINY, "data.name=folder", "data.args={}", *extra],
                       environ={"DATASETS_PATH": str(datasets_path), "DATASETS": names})


def test_layouts_are_detected_per_entry(datasets_path):
    assert detect_layout(str(datasets_path / "photos")) == "folder"
    assert detect_layout(str(datasets_path / "packed")) == "shards"
    assert detect_layout(str(datasets_path / "merged.csv")) == "list"
    assert detect_layout("s3://bucket/sets/packed") == "shards"


def test_the_union_is_one_label_space_with_one_class_disjoint_split(datasets_path):
    # data.args are the folder layout's (data.name): a shard set would refuse skip_bad, so it must not get them
    config = union_config(datasets_path, "photos,products,packed", "data.args={skip_bad: true}")
    data = build_data(config)
    union = data.dataset
    assert isinstance(union, UnionDataset)
    assert union.sources() == [("photos", 18, 6), ("products", 12, 4), ("packed", 15, 5)]
    assert union.classes[:2] == ["photos/c0", "photos/c1"] and "products/c0" in union.classes
    assert len(union) == 45 and union.num_classes == 15
    train, test = set(data.train.labels.tolist()), set(data.test.labels.tolist())
    assert not train & test and train | test == set(range(15))
    assert len(test) == round(15 * config.data.test_fraction)
    assert len(data.train) + len(data.test) == 45
    merged = build_data(union_config(datasets_path, "packed,merged.csv")).dataset
    assert merged.sources() == [("packed", 15, 5), ("merged.csv", 6, 1)]
    assert merged.classes[-1] == "merged.csv/same"  # six images of two folders, one class: merged on purpose


def test_an_image_in_two_datasets_is_refused(datasets_path):
    """merged.csv names photos/c0's images: listed beside photos, each would be a sample of two classes."""
    with pytest.raises(ConfigError, match=r"data.datasets: UnionDataset\(parts=\): datasets 'photos' and 'merged.csv' "
                                          r"share 3 image file\(s\), e.g. .*photos/c0/0.png; an image in two datasets "
                                          r"would be two classes") as caught:
        build_data(union_config(datasets_path, "photos,packed,merged.csv"))
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"datasets 'shop' and 'shop/photos' share 18 image file\(s\)"):
        build_data(union_config(_shop(datasets_path), "shop,shop/photos"))


def test_data_args_reach_only_the_named_layout_and_a_given_layout_wins(datasets_path):
    with pytest.raises(ConfigError, match=r"data.args \(data.datasets: 'products' \(folder\)\): .*'num_classes'"):
        build_data(load_config(None, [*TINY, "data.name=folder"],  # TINY's synthetic arguments reach the folders
                               environ={"DATASETS_PATH": str(datasets_path), "DATASETS": "packed,products"}))
    with pytest.raises(ConfigError, match=r"data.datasets: 'packed' \(folder\): .*packed") as caught:
        build_data(union_config(datasets_path, "photos,packed:folder"))
    assert "\n" not in str(caught.value)


def test_a_missing_dataset_names_itself_and_what_is_there(datasets_path):
    with pytest.raises(ConfigError, match=r"data.datasets: 'glyphs' is not a dataset: .*glyphs does not exist "
                                          r"\(datasets under data.root=.*: merged.csv, packed, photos, products\)"):
        build_data(union_config(datasets_path, "photos,glyphs"))


def test_a_shard_local_plan_cannot_take_unpacked_datasets(datasets_path):
    with pytest.raises(ConfigError, match=r"locality='shard' needs every dataset packed in shards, but "
                                          r"data.datasets \['photos'\] are not"):
        build_data(union_config(datasets_path, "photos,packed", "sampler.args={locality: shard}"))


def test_a_dataset_listed_again_through_a_link_is_refused(datasets_path, tmp_path):
    """`alias -> photos` passes the rule on names but is photos twice: its classes would count twice."""
    mount = tmp_path / "mount"
    mount.mkdir()
    (mount / "photos").symlink_to(datasets_path / "photos")
    (mount / "alias").symlink_to(datasets_path / "photos")
    (mount / "products").symlink_to(datasets_path / "products")
    with pytest.raises(ConfigError, match=r"data.datasets: 'alias' is the dataset 'photos' again \(both are .*photos\)"
                                          r"; list every dataset once") as caught:
        build_data(union_config(mount, "photos,products,alias"))
    assert "\n" not in str(caught.value)
    assert build_data(union_config(mount, "photos,products")).dataset.num_classes == 10  # links themselves are fine


def test_an_object_store_entry_is_read_only_as_shards():
    with pytest.raises(ConfigError, match=r"data.datasets: 'photos:list' is in the object store s3://bucket/sets/photos"
                                          r", which holds only packed shards: write 'photos' or 'photos:shards'"):
        build_data(load_config(None, [*TINY, "data.name=folder", "data.args={}", "workspace=/tmp/unused"],
                               environ={"DATASETS_PATH": "s3://bucket/sets", "DATASETS": "photos:list,products"}))


def test_a_dataset_the_split_leaves_out_of_training_or_evaluation_is_named(datasets_path):
    """The split is drawn over the union's classes: merged.csv's one class is held out under some seeds (then none
    of its images is trained on) and trained under others (then nothing evaluates it); both are said, by name."""
    seen = set()
    for seed in range(12):
        config = union_config(datasets_path, "packed,merged.csv", f"data.split_seed={seed}")
        data = build_data(config)
        held_out = data.dataset.class_offsets[1] in set(data.test.labels.tolist())  # merged.csv's only class
        gaps = split_gaps(data, config.data)
        merged = [gap for gap in gaps if gap.startswith("data.datasets 'merged.csv'")]
        assert len(merged) == 1 and "\n" not in merged[0]
        if held_out:
            assert "took all 1 of its classes, so none of its images is trained on" in merged[0]
            assert f"data.split_seed={seed}" in merged[0]
        else:
            assert "took none of its 1 classes, so no evaluation covers it" in merged[0]
        packed_split = {np.unique(s.labels[s.labels < 5]).size for s in (data.train, data.test)}
        assert any(gap.startswith("data.datasets 'packed'") for gap in gaps) == (0 in packed_split)
        seen.add(held_out)
    assert seen == {True, False}
    assert split_gaps(build_data(load_config(None, TINY)), load_config(None, TINY).data) == []  # one dataset: nothing


def test_the_start_up_lines_warn_of_a_dataset_that_is_never_trained_on(datasets_path, tmp_path, capsys):
    seed = next(s for s in range(50) if any("'merged.csv'" in gap and "none of its images" in gap
                                            for gap in split_gaps(*_split(datasets_path, s))))
    config = union_config(datasets_path, "packed,merged.csv", f"data.split_seed={seed}", f"workspace={tmp_path}",
                          "train.max_steps=1", "train.epochs=1", "train.eval_every=1", "sampler.classes_per_step=2")
    train(config, Backend())
    out = capsys.readouterr().out
    assert "[pksampler] datasets: packed 15 images 5 classes, merged.csv 6 images 1 classes;" in out
    assert out.count("[pksampler] warning: data.datasets 'merged.csv': the held-out split") == 1


def _split(datasets_path: Path, seed: int):
    config = union_config(datasets_path, "packed,merged.csv", f"data.split_seed={seed}")
    return build_data(config), config.data


def _shop(datasets_path: Path) -> Path:
    """A mount where one dataset (shop) is a folder of folders and another (shop/photos) lies inside it."""
    mount = datasets_path.parent / f"{datasets_path.name}-shop"
    if not mount.exists():
        shutil.copytree(datasets_path / "photos", mount / "shop" / "photos")
    return mount


def test_a_heldout_images_that_holds_out_nothing_is_said():
    """data.heldout_images on classes of one image each held out nothing and the image-level metrics were just
    absent; a class keeps its last image, so the warning names the cause."""
    single = load_config(None, [*TINY, "data.args={num_classes: 24, images_per_class: 1, image_size: 32}",
                                "data.heldout_images=2"])
    gaps = split_gaps(build_data(single), single.data)
    assert len(gaps) == 1 and gaps[0].startswith("data.heldout_images=2: every training class has a single image")
    several = load_config(None, [*TINY, "data.heldout_images=2"])
    assert split_gaps(build_data(several), several.data) == []


def test_a_sampler_refusal_caused_by_heldout_images_names_it(tmp_path):
    """Six images a class, five held out, K = 3 under small_classes: drop: the sampler's 'not enough classes' did
    not say that data.heldout_images took the images it counted."""
    from pksampler.train.run_setup import assemble
    from pksampler.train.runtime.distributed import Backend

    config = load_config(None, [*TINY, "data.heldout_images=5", "sampler.args={small_classes: drop}",
                                f"workspace={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^sampler: not enough classes.*\(data\.heldout_images=5 keeps \d+ images "
                                          r"of the training classes out of training") as caught:
        assemble(config, Backend())
    assert "\n" not in str(caught.value)
    plain = load_config(None, [*TINY, "sampler.samples_per_class=7", "sampler.args={small_classes: drop}",
                               "optim.base_batch=28", f"workspace={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^sampler: not enough classes") as caught:
        assemble(plain, Backend())
    assert "heldout_images" not in str(caught.value)


def test_a_folder_class_that_gains_photos_is_not_queried_with_images_trained_on(tmp_path):
    """Week 2 adds a photo sorting first to every week-1 class: no week-2 image-level query is a week-1 training
    image (keyed by position, most classes' held-out images moved onto trained ones)."""
    from tiny_runs import grown_folders

    week1, week2 = grown_folders(tmp_path)
    for folder in week2.iterdir():
        first = sorted(folder.iterdir())[0]
        (folder / f"-new{first.suffix}").write_bytes(first.read_bytes())  # sorts before 00000.png

    def parts(root):
        config = load_config(None, [*TINY, "data.name=folder", "data.args={}", f"data.root={root}",
                                    "data.split_by=name", "data.heldout_images=2"])
        data = build_data(config)
        name = lambda i: str(Path(data.dataset.paths[i]).relative_to(root))  # noqa: E731
        return {name(i) for i in data.train.indices}, {name(i) for i in data.heldout}

    trained1, _ = parts(week1)
    _, held2 = parts(week2)
    assert held2 and not held2 & trained1

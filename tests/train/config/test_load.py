"""Run configuration: typed, validated, unknown keys rejected, environment and --set overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from pksampler.train.config.load import ConfigError, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", ["demo.yaml", "products.yaml", "triplet.yaml"])
def test_shipped_configs_load(name):
    config = load_config(ROOT / "configs" / name, environ={})
    assert isinstance(config, RunConfig)
    assert config.sampler.classes_per_step > 0 and config.sampler.samples_per_class > 0


def test_unknown_keys_are_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epochz: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key train\.'epochz'"):
        load_config(path, environ={})
    with pytest.raises(ConfigError, match=r"unknown config key 'learning_rate'"):
        load_config(None, ["learning_rate=0.1"], environ={})


def test_types_and_choices_are_checked():
    with pytest.raises(ConfigError, match=r"train.epochs: expected an integer, got 'three'"):
        load_config(None, ["train.epochs=three"], environ={})
    with pytest.raises(ConfigError, match=r"model.norm: must be one of \['auto', 'group', .*got 'layer'"):
        load_config(None, ["model.norm=layer"], environ={})
    with pytest.raises(ConfigError, match=r"data.test_fraction: must be in \(0, 1\), got 1.0"):
        load_config(None, ["data.test_fraction=1.0"], environ={})
    with pytest.raises(ConfigError, match=r"sampler.classes_per_step: expected an integer, got 'two'"):
        load_config(None, ["sampler.classes_per_step=two"], environ={})


def test_choice_lists_come_from_the_registries():
    from pksampler.train.builders import DATA_SOURCES
    from pksampler.train.losses.pair import loss_names

    with pytest.raises(ConfigError) as caught:
        load_config(None, ["data.name=nowhere"], environ={})
    assert str(list(DATA_SOURCES)) in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["loss.name=nothing"], environ={})
    assert str(list(loss_names())) in str(caught.value) and "pml.<Name>" in str(caught.value)
    assert load_config(None, ["loss.name=pml.TripletMarginLoss"], environ={}).loss.name == "pml.TripletMarginLoss"


@pytest.mark.parametrize("override, message", [
    ("optim.lr=.inf", r"optim.lr: must be a finite number > 0, got inf"),
    ("optim.momentum=1", r"optim.momentum: must be in \[0, 1\), got 1"),
    ("head.momentum=1.0", r"head.momentum: must be in \[0, 1\), got 1.0"),
    ("optim.lr=.nan", r"optim.lr: must be a finite number > 0, got nan"),
    ("optim.lr=0", r"optim.lr: must be a finite number > 0, got 0"),
    ("optim.lr=-0.1", r"optim.lr: must be a finite number > 0, got -0.1"),
    ("train.max_steps=-1", r"train.max_steps: must be an integer >= 0, got -1"),
    ("train.gallery_queries=0", r"train.gallery_queries: must be an integer >= 1, got 0"),
    ("optim.base_batch=0", r"optim.base_batch: must be an integer >= 1, got 0"),
    ("seed=9223372036854775808", r"seed: must be an integer in \[0, 2\*\*63\), got 9223372036854775808"),
    ("seed=-1", r"seed: must be an integer in \[0, 2\*\*63\)"),
    ("optim.weight_decay=.nan", r"optim.weight_decay: must be a finite number >= 0"),
    ("train.checkpoint_every=-5", r"train.checkpoint_every: must be an integer >= 0"),
    ("train.device=tpu", r"train.device: must be one of \['auto', 'cpu', 'cuda'\], got 'tpu'"),
    ("train.precision=fp8", r"train.precision: must be one of"),
    ("sampler.args={classes_per_batch: 4}", r"sampler.args.classes_per_batch: set by the trainer; the batch is "
                                            r"configured globally"),
    ("loss.memory={size: 0}", r"loss.memory.size: must be an integer >= 1, got 0"),
    ("data.augment={flip: 2}", r"data.augment: BatchAugment\(flip=\) must be in \[0, 1\], got 2"),
    ("data.augment={crop: 0.5}", r"data.augment.crop: unknown key \(known: \['scale', 'ratio', 'flip'"),
    ("data.augment={scale: 0.5}", r"data.augment.scale: expected two numbers \[low, high\], got 0.5"),
])
def test_bad_values_are_refused_at_load_with_the_key_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override], environ={})


@pytest.mark.parametrize("environ, message", [
    ({"LR": "inf"}, r"optim.lr: must be a finite number > 0, got inf"),
    ({"LR": "nan"}, r"optim.lr: must be a finite number > 0, got nan"),
    ({"EPOCHS": "ten"}, r"EPOCHS='ten' must be an integer"),
    ({"BATCH_SIZE": "30"}, r"BATCH_SIZE=30 must be a multiple of sampler.samples_per_class=4"),
])
def test_bad_environment_values_are_named(environ, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, environ=environ)


def test_bad_set_syntax_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"--set train.epochs: '\[1' is not a valid YAML value"):
        load_config(None, ["train.epochs=[1"], environ={})
    with pytest.raises(ConfigError, match=r"--set expects key=value"):
        load_config(None, ["train.epochs"], environ={})


def test_a_flow_mapping_without_the_space_after_its_colons_is_named():
    """``{num_classes:160}`` is YAML for one key 'num_classes:160' with no value: say so, not 'missing arguments'."""
    with pytest.raises(ConfigError, match=r"--set loss.args: .* reads 'embedding_size:64' as one key with no value; "
                                          r"YAML needs a space after the colon, as in \{embedding_size: 64\}"):
        load_config(None, ["loss.args={num_classes: 160, embedding_size:64}"], environ={})
    spaced = load_config(None, ["loss.name=pml.ArcFaceLoss", "loss.args={num_classes: 160, embedding_size: 64}"],
                         environ={})
    assert spaced.loss.args == {"num_classes": 160, "embedding_size": 64}
    assert load_config(None, ["data.root=s3://bucket/prefix"], environ={}).data.root == "s3://bucket/prefix"
    quoted = load_config(None, ['data.args={"s3://bucket/x": null}'], environ={})  # a quoted key, null on purpose
    assert quoted.data.args == {"s3://bucket/x": None}


def test_environment_overrides_file_and_set_overrides_environment(tmp_path):
    environ = {"EPOCHS": "5", "LR": "0.01", "WORKSPACE": str(tmp_path / "ws"), "DATASETS_PATH": "/data",
               "DATASETS": "sop", "WORKER_PER_NODE": "3"}
    config = load_config(ROOT / "configs" / "demo.yaml", environ=environ)
    assert config.train.epochs == 5 and config.optim.lr == 0.01
    assert config.workspace == str(tmp_path / "ws") and config.data.root == "/data/sop"
    assert config.data.workers == 3
    config = load_config(ROOT / "configs" / "demo.yaml", ["train.epochs=7"], environ=environ)
    assert config.train.epochs == 7


def test_epochs_asked_for_replace_the_files_steps(tmp_path):
    """A file gives the run's length in steps; EPOCHS or --set train.epochs=N asks for epochs instead."""
    path = tmp_path / "steps.yaml"
    path.write_text("train: {epochs: 12, steps: 900}\n")
    assert load_config(path, environ={}).train.steps == 900
    assert load_config(path, environ={"EPOCHS": "3"}).train.steps is None
    by_set = load_config(path, ["train.epochs=4"], environ={}).train
    assert (by_set.epochs, by_set.steps) == (4, None)
    both = load_config(path, ["train.epochs=4", "train.steps=50"], environ={}).train
    assert (both.epochs, both.steps) == (4, 50)
    assert load_config(path, ["train.steps=null"], environ={}).train.steps is None
    with pytest.raises(ConfigError, match=r"train.steps: must be an integer >= 1, got 0"):
        load_config(path, ["train.steps=0"], environ={})


@pytest.mark.parametrize("launcher", [
    {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "8"},
    {"RANK": "0", "WORLD_SIZE": "8"},
])
def test_batch_size_is_images_per_process_and_sets_the_global_step(launcher):
    # 8 processes x 48 images = 384 images per step = 96 classes of K=4.
    config = load_config(ROOT / "configs" / "demo.yaml", environ={"BATCH_SIZE": "48", **launcher})
    assert config.sampler.classes_per_step == 96 and config.sampler.samples_per_class == 4
    single = load_config(ROOT / "configs" / "demo.yaml", environ={"BATCH_SIZE": "48"})
    assert single.sampler.classes_per_step == 12


def test_triplet_batch_size_sets_triplets_per_step():
    config = load_config(ROOT / "configs" / "triplet.yaml", environ={"BATCH_SIZE": "30", "HOROVOD_RANK": "0",
                                                                     "HOROVOD_SIZE": "2"})
    assert config.sampler.triplets_per_step == 20


def test_a_workspace_inside_the_data_root_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"workspace: .*/data/run lies inside data.root .*/data; the data location "
                                          r"is read-only"):
        load_config(None, [f"data.root={tmp_path / 'data'}", f"workspace={tmp_path / 'data' / 'run'}"], environ={})


def test_data_augment_sets_the_training_augmentation():
    from pksampler.train.builders import build_data

    config = load_config(None, ["data.augment={flip: 0, scale: [0.8, 1.0], rotation: 10}"], environ={})
    augment = build_data(config).augment
    assert (augment.flip, augment.scale, augment.rotation, augment.jitter) == (0.0, (0.8, 1.0), 10.0, 0.3)


@pytest.mark.parametrize("value", ["1e300", "0.5", ".inf"])
def test_collective_timeout_has_sane_bounds_named_in_the_error(value):
    with pytest.raises(ConfigError, match=r"train\.collective_timeout: must be in \[1, 604800\]"):
        load_config(None, [f"train.collective_timeout={value}"], environ={})
    assert load_config(None, ["train.collective_timeout=604800"], environ={}).train.collective_timeout == 604800


def test_a_removed_key_in_a_config_file_says_what_replaced_it(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("head:\n  name: arcface\n  lr_scale: 25\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert "head.lr_scale" in message and "removed" in message
    assert all(key in message for key in ("head.lr", "head.momentum", "head.weight_decay"))


@pytest.mark.parametrize("decay", ["0.5", "20"])
def test_a_head_decay_that_would_zero_or_flip_its_rows_is_refused(decay):
    # the rows decay by (1 - rate · head.weight_decay) a step, rate = head.lr · images / optim.base_batch;
    # at 1 or above the lazy log-product is log(0) or log of a negative: every row became NaN
    with pytest.raises(ConfigError, match=r"head.weight_decay: .* must be below 1"):
        load_config(None, ["head.name=arcface", "head.lr=4", f"head.weight_decay={decay}"], environ={})
    load_config(None, ["head.name=arcface", "head.lr=4", "head.weight_decay=0.01"], environ={})

"""Run configuration: typed, validated, unknown keys rejected, environment and --set overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from pksampler.train.config import ConfigError, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["demo.yaml", "products.yaml", "triplet.yaml"])
def test_shipped_configs_load(name):
    config = load_config(ROOT / "configs" / name, environ={})
    assert isinstance(config, RunConfig) and config.batch_size > 0


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
    with pytest.raises(ConfigError, match=r"model.norm: must be one of .*got 'layer'"):
        load_config(None, ["model.norm=layer"], environ={})
    with pytest.raises(ConfigError, match=r"data.test_fraction: must be in \(0, 1\), got 1.0"):
        load_config(None, ["data.test_fraction=1.0"], environ={})


def test_environment_overrides_file_and_set_overrides_environment(tmp_path):
    environ = {"EPOCHS": "5", "LR": "0.01", "WORKSPACE": str(tmp_path / "ws"), "DATASETS_PATH": "/data",
               "DATASETS": "sop", "BATCH_SIZE": "48", "WORKER_PER_NODE": "3"}
    config = load_config(ROOT / "configs" / "demo.yaml", environ=environ)
    assert config.train.epochs == 5 and config.optim.lr == 0.01
    assert config.workspace == str(tmp_path / "ws") and config.data.root == "/data/sop"
    assert config.batch_size == 48 and config.sampler.args["classes_per_batch"] == 12
    assert config.data.workers == 3
    config = load_config(ROOT / "configs" / "demo.yaml", ["train.epochs=7"], environ=environ)
    assert config.train.epochs == 7


def test_bad_environment_values_are_named():
    with pytest.raises(ConfigError, match=r"EPOCHS='ten' must be a int"):
        load_config(None, environ={"EPOCHS": "ten"})
    with pytest.raises(ConfigError, match=r"BATCH_SIZE=30 must be a multiple of sampler.args.samples_per_class=4"):
        load_config(None, environ={"BATCH_SIZE": "30"})


def test_batch_size_is_derived():
    config = load_config(None, ["sampler.args={classes_per_batch: 6, samples_per_class: 5}"], environ={})
    assert config.batch_size == 30

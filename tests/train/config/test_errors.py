"""Config, data-source and checkpoint errors are one ConfigError naming the key, never a traceback."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pksampler.datasets.pack import pack
from pksampler.files import atomic_write_bytes
from pksampler.train.builders import build_data
from pksampler.train.engine.checkpoint import CheckpointError
from pksampler.train.config.load import ConfigError, load_config
from pksampler.train.runtime.distributed import Backend
from pksampler.train.run_setup import train

TINY = [
    "seed=3", "data.args={num_classes: 24, images_per_class: 6, image_size: 32}", "data.image_size=24",
    "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=3", "model.width=8",
    "model.depth=[1, 1]", "model.embedding_dim=16", "optim.base_batch=12", "train.tensorboard=false",
]


def tiny(tmp_path: Path, *extra: str, environ: dict | None = None):
    return load_config(None, [*TINY, f"workspace={tmp_path / 'run'}", *extra], environ=environ or {})


def test_an_exponent_float_is_a_number_in_set_and_in_yaml_files(tmp_path):
    assert load_config(None, ["optim.lr=1e-3"], environ={}).optim.lr == 0.001
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 2E-4\n  weight_decay: 5e-4\ntrain:\n  epochs: 3\n")
    config = load_config(path, environ={})
    assert (config.optim.lr, config.optim.weight_decay, config.train.epochs) == (2e-4, 5e-4, 3)
    assert load_config(None, ["workspace=1e3x"], environ={}).workspace == "1e3x"


@pytest.mark.parametrize("override, message", [
    ("optim.lr=" + "9" * 400, r"optim.lr: 9{10,}\d* is too large for a floating-point number"),
    ("train.threads=" + "9" * 30, r"train.threads: expected an integer that fits in 64 bits, got 9{30}"),
    ("train.threads=4611686018427387904", r"train.threads: must be an integer in \[1, 4096\], got 4611686018427387904"),
])
def test_integers_too_large_are_one_error_naming_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        tiny(tmp_path, override)


@pytest.mark.parametrize("loss, args, message", [
    ("batch_hard", "{margin: [1]}", r"loss.args: \{'margin': \[1\]\} do not suit loss 'batch_hard' \(TypeError"),
    ("multi_similarity", "{alpha: abc}", r"loss.args: \{'alpha': 'abc'\} do not suit loss 'multi_similarity'"),
])
def test_wrong_typed_loss_args_are_refused_at_set_up_naming_the_key(tmp_path, loss, args, message):
    with pytest.raises(ConfigError, match=message):
        train(tiny(tmp_path, f"loss.name={loss}", f"loss.args={args}"), Backend())
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()


# --- data sources ----------------------------------------------------------------------------------

def test_an_empty_image_folder_is_one_error_naming_data_root(tmp_path):
    (tmp_path / "empty").mkdir()
    config = tiny(tmp_path, "data.name=folder", f"data.root={tmp_path / 'empty'}", "data.args={}")
    with pytest.raises(ConfigError, match=r"data.root: ImageFolderDataset\(root=\) has no class sub-folders"):
        build_data(config)


def test_a_shard_manifest_that_does_not_match_its_index_is_one_error_naming_data_root(tmp_path):
    for c in range(2):
        for i in range(2):
            (tmp_path / "src" / f"c{c}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8, 3), 40 * c + i, np.uint8)).save(tmp_path / "src" / f"c{c}" / f"{i}.png")
    pack(tmp_path / "src", tmp_path / "shards")
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    manifest["num_samples"] = 5
    (tmp_path / "shards" / "manifest.json").write_text(json.dumps(manifest))
    config = tiny(tmp_path, "data.name=shards", f"data.root={tmp_path / 'shards'}", "data.args={}")
    with pytest.raises(ConfigError, match=r"data.root: ShardedDataset: .*index.npy holds .* the manifest"):
        build_data(config)


# --- checkpoints that unpickle safely but are malformed -----------------------------------------

def plant(path: Path, state) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())


def test_a_checkpoint_lacking_its_sections_is_one_error_naming_the_section(tmp_path):
    path = tmp_path / "run" / "checkpoints" / "last.pt"
    plant(path, {"format": 2, "config": tiny(tmp_path).to_dict()})
    with pytest.raises(CheckpointError, match=rf"checkpoint {path}: section 'model' must be a dict, it holds nothing"):
        train(tiny(tmp_path), Backend())
    plant(path, {"format": 2, "config": tiny(tmp_path).to_dict(), "model": {"w": [1.0]}, "optimizer": {},
                 "scheduler": {}, "loss": {}, "state": {}, "sampler": {}})
    with pytest.raises(CheckpointError, match=r"model entry 'w' is a list, not a tensor"):
        train(tiny(tmp_path), Backend())


def test_a_checkpoint_whose_contents_do_not_fit_the_run_is_one_error(tmp_path):
    train(tiny(tmp_path, "train.max_steps=1"), Backend())
    path = tmp_path / "run" / "checkpoints" / "last.pt"
    state = torch.load(path, weights_only=True)
    first = next(iter(state["model"]))
    state["model"][first] = torch.zeros(3)  # a tensor of another shape
    plant(path, state)
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} does not fit this run \(RuntimeError: .*{first}"):
        train(tiny(tmp_path, "train.max_steps=2"), Backend())

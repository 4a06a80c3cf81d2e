"""Round four of the adversarial cases: each failed before its fix (issue 27's list)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pksampler.world import World
from pksampler.train.config.agreement import check_ranks_agree, flatten
from pksampler.train.config.load import load_config
from pksampler.train.errors import ConfigError
from pksampler.train.runtime.distributed import Backend


class TwoRanks(Backend):
    """Rank 0 of two whose peer sent ``peer_config``: allgather_numpy returns both rows."""

    def __init__(self, peer_config: dict) -> None:
        super().__init__("cpu", "fp32")
        self.set_world(World(rank=0, size=2))
        self.peer_config = peer_config

    def allgather_numpy(self, row: np.ndarray) -> np.ndarray:
        peer = _row(self.peer_config)
        return np.stack([row, peer])


def _row(config: dict) -> np.ndarray:
    captured = {}

    class Capture(Backend):
        def allgather_numpy(self, row):
            captured["row"] = row
            return np.stack([row, row])

    capture = Capture("cpu", "fp32")
    capture.set_world(World(rank=0, size=2))
    check_ranks_agree(config, np.zeros(4, dtype=np.int64), capture)
    return captured["row"]


def test_ranks_that_differ_only_in_data_augment_are_told_the_key():
    mine = load_config(None, [], environ={}).to_dict()
    peer = load_config(None, ["data.augment={flip: 0}"], environ={}).to_dict()
    with pytest.raises(ConfigError, match=r"^ranks disagree on data\.augment:"):
        check_ranks_agree(mine, np.zeros(4, dtype=np.int64), TwoRanks(peer))
    assert flatten({"data": {"augment": {"flip": 0}, "args": {"a": {"b": 1}}}}) == {
        "data.augment": {"flip": 0}, "data.args": {"a": {"b": 1}}}


@pytest.mark.parametrize("value", ["1e300", "0.5", ".inf"])
def test_collective_timeout_has_sane_bounds_named_in_the_error(value):
    with pytest.raises(ConfigError, match=r"train\.collective_timeout: must be in \[1, 604800\]"):
        load_config(None, [f"train.collective_timeout={value}"], environ={})
    assert load_config(None, ["train.collective_timeout=604800"], environ={}).train.collective_timeout == 604800


def test_horovod_elastic_in_the_environment_does_not_make_a_torch_run_elastic(monkeypatch):
    from pksampler.train.engine.elastic import horovod_elastic as _horovod_elastic

    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    backend = Backend("cpu", "fp32")
    backend.name = "torch"
    assert not _horovod_elastic(backend)
    backend.name = "horovod"
    assert _horovod_elastic(backend)


def _tiny(workspace, *extra: str):
    return load_config(None, [
        "data.args={num_classes: 12, images_per_class: 4, image_size: 24}", "data.image_size=16", "data.workers=0",
        "sampler.classes_per_step=2", "sampler.samples_per_class=2", "model.width=8", "model.depth=[1]",
        "train.tensorboard=false", "train.checkpoint_every=100", "train.epochs=1", f"workspace={workspace}", *extra],
        environ={})


def _step_lines(workspace) -> list[int]:
    import json

    lines = (workspace / "metrics.jsonl").read_text().splitlines()
    return [record["global_step"] for record in map(json.loads, lines) if record.get("type") == "step"]


def test_a_restart_before_the_first_checkpoint_logs_each_step_once(tmp_path):
    from pksampler.train.engine.trainer import HookBase
    from pksampler.train.run_setup import train

    class Killed(HookBase):
        def after_step(self):
            if self.trainer.state.global_step == 3:
                raise KeyboardInterrupt("killed before the first checkpoint")

    with pytest.raises(KeyboardInterrupt):
        train(_tiny(tmp_path / "run"), Backend(), extra_hooks=[Killed()])
    assert _step_lines(tmp_path / "run") == [1, 2, 3]
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()
    train(_tiny(tmp_path / "run", "train.max_steps=4"), Backend())
    assert _step_lines(tmp_path / "run") == [1, 2, 3, 4]


def test_no_resume_in_a_used_workspace_leaves_nothing_of_the_old_run(tmp_path):
    from pksampler.train.run_setup import train

    train(_tiny(tmp_path / "run", "train.eval_every=1"), Backend())
    assert (tmp_path / "run" / "checkpoints" / "best.pt").is_file() and (tmp_path / "run" / "final_metrics.json").is_file()
    old_steps = len(_step_lines(tmp_path / "run"))
    train(_tiny(tmp_path / "run", "train.resume=false", "train.max_steps=2", "train.eval_every=100"), Backend())
    assert _step_lines(tmp_path / "run") == [1, 2] and old_steps > 2
    assert not (tmp_path / "run" / "checkpoints" / "best.pt").exists()
    assert not (tmp_path / "run" / "final_metrics.json").exists()


@pytest.mark.parametrize("key, value", [("epoch", "3"), ("global_step", 2.5), ("consumed", -1), ("epoch", True)])
def test_a_checkpoint_whose_state_counters_are_not_whole_numbers_is_refused_naming_the_key(tmp_path, key, value):

    from pksampler.train.engine.checkpoint import CheckpointError, check_training_checkpoint

    saved = {"model": {"weight": torch.zeros(2)}, "optimizer": {}, "scheduler": {}, "loss": {}, "sampler": {},
             "config": {}, "state": {"epoch": 1, "global_step": 4, "consumed": 0, key: value}}
    path = tmp_path / "last.pt"
    with pytest.raises(CheckpointError, match=rf"{path}: state\.{key} must be a whole number >= 0, it holds"):
        check_training_checkpoint(saved, path)
    saved["state"][key] = 1
    check_training_checkpoint(saved, path)  # the same file with a whole number loads


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update({7: torch.zeros(1)}), r"tensor names must be strings, found 7"),
    (lambda s: s.update({"conv1.weight": torch.empty(64, 3, 7, 7, device="meta")}),
     r"tensors must be dense and hold values, found conv1\.weight \(meta\)"),
    (lambda s: s.update({"conv1.weight": torch.zeros(64, 3, 7, 7).to_sparse()}),
     r"tensors must be dense and hold values, found conv1\.weight \(torch\.sparse_coo\)"),
])
def test_pretrained_files_with_odd_names_or_tensors_are_refused_in_one_line(tmp_path, change, message):
    from pksampler.train.modeling.pretrained import load_backbone_weights
    from pksampler.train.modeling.resnet import resnet

    backbone = resnet("resnet18")
    state = dict(backbone.state_dict())
    change(state)
    path = tmp_path / "weights.pth"
    torch.save(state, path)
    with pytest.raises(ConfigError, match=rf"model\.pretrained: {path}: {message}"):
        load_backbone_weights(backbone, path)


def test_a_vit_pos_embed_holding_only_the_class_token_is_named_as_mis_shaped(tmp_path):
    from pksampler.train.modeling.pretrained import load_backbone_weights
    from pksampler.train.modeling.vit import vit

    backbone = vit("vit_small_patch16", image_size=32)
    state = dict(backbone.state_dict())
    state["pos_embed"] = state["pos_embed"][:, :1].clone()
    path = tmp_path / "weights.pth"
    torch.save(state, path)
    with pytest.raises(ConfigError, match=r"1 of another shape: pos_embed \(file \(1, 1, 384\)"):
        load_backbone_weights(backbone, path)

"""A run with the sharded head keeps its rows beside ``last.pt`` (each rank's range, a manifest) and resumes from
them; a ``last.pt`` with the whole head inside (every checkpoint before) resumes the same."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_runs import TINY, read_trained

from pksampler.train.config.load import load_config
from pksampler.train.engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from pksampler.train.run_setup import train
from pksampler.train.runtime.distributed import Backend

HEADED = [*TINY, "head.name=arcface", "train.epochs=1"]


def _run(workspace, steps: int) -> dict:
    train(load_config(None, [*HEADED, f"train.max_steps={steps}", f"workspace={workspace}"], environ={}), Backend())
    return read_trained(workspace / "checkpoints" / "last.pt")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Four steps in one go: the state a resume must reach."""
    return _run(tmp_path_factory.mktemp("straight"), 4)


def _same(resumed: dict, straight: dict) -> None:
    assert resumed["state"]["global_step"] == straight["state"]["global_step"] == 4
    for key in ("rows", "momentum", "log_decay"):
        assert torch.equal(resumed["loss"]["head"][key], straight["loss"]["head"][key]), key
    assert all(torch.equal(resumed["model"][k], straight["model"][k]) for k in straight["model"])


def test_the_rows_lie_beside_last_pt_and_a_resume_reads_them(tmp_path, straight):
    workspace = tmp_path / "resumed"
    _run(workspace, 2)
    checkpoints = workspace / "checkpoints"
    loss = load_checkpoint(checkpoints / "last.pt")["loss"]
    assert "rows" not in loss["head"] and loss["ranges"]["manifest"] == "last.shared/loss/step-2/manifest.json"
    manifest = json.loads((checkpoints / "last.shared" / "loss" / "step-2" / "manifest.json").read_text())
    assert [(f["start"], f["stop"]) for f in manifest["files"]] == [(0, manifest["rows"])] and manifest["step"] == 2
    _same(_run(workspace, 4), straight)
    # the step-2 folder went once step 4's last.pt was on disk
    assert sorted(p.name for p in (checkpoints / "last.shared" / "loss").iterdir()) == ["step-4"]


def test_a_last_pt_with_the_whole_head_inside_resumes_the_same(tmp_path, straight):
    workspace = tmp_path / "old"
    _run(workspace, 2)
    path = workspace / "checkpoints" / "last.pt"
    save_checkpoint(path, read_trained(path))  # the layout every checkpoint before was written in
    shutil.rmtree(workspace / "checkpoints" / "last.shared")
    assert "rows" in load_checkpoint(path)["loss"]["head"]
    _same(_run(workspace, 4), straight)


def test_a_resume_whose_range_file_is_gone_names_it_in_one_line(tmp_path):
    workspace = tmp_path / "lost"
    _run(workspace, 2)
    (workspace / "checkpoints" / "last.shared" / "loss" / "step-2").joinpath(
        next(p.name for p in (workspace / "checkpoints" / "last.shared" / "loss" / "step-2").glob("rows-*"))).unlink()
    with pytest.raises(CheckpointError, match=r"last\.pt does not fit this run \(RangeFileError: checkpoint rows "
                                              r"file .*step-2/rows-0-\d+\.pt is missing") as caught:
        _run(workspace, 4)
    assert "\n" not in str(caught.value)

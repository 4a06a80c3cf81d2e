"""train.init_from under real ranks: horovodrun -np 2 continues a one-process checkpoint onto a grown folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from launch import ROOT, launch
from tiny_runs import TINY, grown_folders, read_trained
from trainer_runs import trace_launch

from pksampler.train.config.load import load_config

pytestmark = [pytest.mark.horovod, pytest.mark.launcher]
SCRIPT = ROOT / "train" / "retrieval.py"
GROWN = [*TINY, "head.name=arcface", "data.name=folder", "data.args={}", "data.split_by=name",
         "data.heldout_images=1", "train.checkpoint_every=0"]


def config_file(folder: Path, name: str, *items: str) -> Path:
    """The tiny run with ``items`` applied as a config file (the script's own default file is another run)."""
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(load_config(None, list(items), environ={}).to_dict()))
    return path


def step0(workspace: Path) -> dict:
    lines = (workspace / "metrics.jsonl").read_text().splitlines()
    return next(r for r in map(json.loads, lines) if r["type"] == "eval" and r["global_step"] == 0)


def test_two_ranks_continue_a_one_process_checkpoint_on_a_grown_folder(tmp_path):
    week1, week2 = grown_folders(tmp_path / "data")
    for source, name in (("product_00024", "new_a"), ("product_00025", "new_b")):
        # new names that sort first: the new rows lie on both ranks (each imprints its own through the BNNeck)
        shutil.copytree(week2 / source, week2 / name)
    # one plain process trains week 1, then continues it on week 2 (trace_runs.py: two runs, one process start)
    first = config_file(tmp_path, "first", *GROWN, f"data.root={week1}", "train.epochs=1")
    week1_model = tmp_path / "single" / "first" / "checkpoints" / "last.pt"
    grown = [*GROWN, f"data.root={week2}", f"train.init_from={week1_model}", "train.max_steps=1"]
    fresh = ["train.resume=false"]
    single = trace_launch(tmp_path, "single", {"first": (first, fresh),
                                               "one": (config_file(tmp_path, "one", *grown), fresh)}, launcher=None)
    assert single.returncode == 0, single.stdout[-4000:]
    two = config_file(tmp_path, "two", *grown, f"workspace={tmp_path / 'two'}")
    result = launch("horovodrun", SCRIPT, "--no-resume", "--config", str(two), np=2)
    assert result.returncode == 0, result.stdout[-4000:]
    for output in (single.stdout, result.stdout):
        lines = [line for line in output.splitlines() if "] init_from " in line]
        assert len(lines) == 1 and "classes kept 22, added 10 (" in lines[0] and "dropped 2" in lines[0]
    assert "world=2" in result.stdout
    two, one = step0(tmp_path / "two"), step0(tmp_path / "single" / "one")
    assert two["image_known_num_queries"] > 0 and two["image_new_num_queries"] > 0
    for key in ("recall_at_1", "image_recall_at_1", "image_known_recall_at_1", "image_new_recall_at_1"):
        assert two[key] == pytest.approx(one[key], abs=1e-9), key
    # the head after the continuation and one step: the same rows at W = 2 as in one process (the BNNeck imprinted
    # each rank's block under its own statistics before: the rows changed with W)
    rows = [read_trained(workspace / "checkpoints" / "last.pt")["loss"]["head"]["rows"]
            for workspace in (tmp_path / "single" / "one", tmp_path / "two")]
    assert rows[0].shape == (32, 1, 16)
    assert torch.allclose(rows[0], rows[1], atol=2e-5, rtol=0), float((rows[0] - rows[1]).abs().max())

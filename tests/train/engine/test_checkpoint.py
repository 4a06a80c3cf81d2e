"""The background checkpoint writer: host copies, one write at a time, errors that surface, the last write joined."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import pksampler.files as files
from pksampler.train.engine import checkpoint as checkpoint_module
from pksampler.train.engine.checkpoint import CheckpointWriter, host_copy, load_checkpoint
from pksampler.train.errors import ConfigError


def test_a_host_copy_shares_no_memory_with_the_live_state():
    live = {"w": torch.ones(3), "moments": [torch.zeros(2)], "history": [1, 2], "table": np.arange(3), "n": np.int64(4)}
    copy = host_copy(live)
    live["w"].add_(1)
    live["moments"][0].add_(1)
    live["history"].append(3)
    assert torch.equal(copy["w"], torch.ones(3)) and torch.equal(copy["moments"][0], torch.zeros(2))
    assert copy["history"] == [1, 2] and torch.equal(copy["table"], torch.arange(3)) and copy["n"] == 4


def test_saving_returns_before_the_write_and_one_write_is_in_flight(tmp_path, monkeypatch):
    gate, active, written, peak = threading.Event(), [0], [], [0]
    real = checkpoint_module.save_checkpoint

    def slow_save(path, state):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        gate.wait(timeout=30)
        real(path, state)
        written.append((path.name, int(state["step"])))
        active[0] -= 1

    monkeypatch.setattr(checkpoint_module, "save_checkpoint", slow_save)
    writer = CheckpointWriter()
    live = torch.zeros(1)
    writer.save(tmp_path / "last.pt", {"step": 1, "w": live})  # starts writing, held at the gate
    for step in (2, 3):  # queued; 3 supersedes 2 before its write starts
        live.fill_(step)
        writer.save(tmp_path / "last.pt", {"step": step, "w": live})
    writer.save(tmp_path / "best.pt", {"step": 3, "w": live})
    assert not (tmp_path / "last.pt").exists()  # the caller went on while the first write waits
    gate.set()
    writer.close()
    assert written == [("last.pt", 1), ("last.pt", 3), ("best.pt", 3)] and peak[0] == 1
    saved = load_checkpoint(tmp_path / "last.pt")
    assert saved["step"] == 3 and float(saved["w"]) == 3.0


def test_a_failed_write_surfaces_at_the_next_save_naming_the_file(tmp_path, monkeypatch):
    def full_disk(descriptor):
        raise OSError(28, "No space left on device")

    writer = CheckpointWriter()
    writer.save(tmp_path / "last.pt", {"step": 1})
    writer.wait()
    monkeypatch.setattr(files.os, "fsync", full_disk)
    writer.save(tmp_path / "last.pt", {"step": 2})
    with pytest.raises(ConfigError, match=r"^workspace: cannot write .*last.pt \(No space left on device\); the "
                                          r"previous checkpoint is intact"):
        writer.wait()
        writer.save(tmp_path / "last.pt", {"step": 3})
    writer.close()  # reported once
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 1 and not list(tmp_path.glob(".*.tmp"))


def test_close_joins_the_last_write_and_raises_its_error(tmp_path, monkeypatch):
    def full_disk(descriptor):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full_disk)
    writer = CheckpointWriter()
    writer.save(tmp_path / "best.pt", {"step": 1})
    with pytest.raises(ConfigError, match=r"cannot write .*best.pt \(No space left on device\)"):
        writer.close()


def test_close_during_another_error_keeps_that_error(tmp_path, monkeypatch):
    monkeypatch.setattr(files.os, "fsync", lambda descriptor: (_ for _ in ()).throw(OSError(28, "full")))
    writer = CheckpointWriter()
    writer.save(tmp_path / "last.pt", {"step": 1})
    with pytest.raises(KeyError, match="the loop's own error"):
        try:
            raise KeyError("the loop's own error")
        finally:
            writer.close()


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

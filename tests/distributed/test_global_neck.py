"""The same model at -np 1, 2 and 3: loss traces of configs/folder.yaml's keys and of the head's defaults.

One launch per world size trains every config compared (``trace_runs.py``):
one process, torchrun -np 2 and horovodrun -np 3 (G = 16 splits 6 + 5 + 5),
12 SGD steps each on the demo data of 32 px. The configs:

* ``folder``: configs/folder.yaml's model, loss and head keys (the BatchNorm
  neck inside the model, which the step applies to the gathered batch, and
  the light ArcFace head that reads it);
* ``folder_chunked``: the same with gradient-cached steps (``train.chunk_size``),
  the neck applied once to the whole gathered batch;
* ``folder_head``: the same with the light ArcFace head the file offers (``head.name=arcface``: its
  weight 0.1, reading the model's neck);
* ``head_fp64``: ``head.name=arcface`` with the recipe's defaults (its BNNeck
  on, ``head.weight`` 1), trained in float64 (``trace_runs.computing_in``) on
  crops of 16 px (float64 convolutions cost four times float32's here),
  where another world size's summation order changes a sum by 10⁻¹⁶, not the
  10⁻⁷ of float32 that this training amplifies (docs/sharded-head.md,
  "Switches, not a linear instability").
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_runs import folder_keys
from trainer_runs import trace_launch

pytestmark = pytest.mark.horovod
STEPS = 12
COMMON = ["optim.name=sgd", f"train.max_steps={STEPS}", "train.eval_every=100", "train.checkpoint_every=0",
          "train.tensorboard=false", "data.workers=0", "data.image_size=32",
          "data.args={num_classes: 160, images_per_class: 16, image_size: 32}"]


RUNS = {"folder": folder_keys(), "folder_chunked": [*folder_keys(), "train.chunk_size=16"],
        "folder_head": [*folder_keys(), "head.name=arcface"], "head_fp64": ["head.name=arcface", "data.image_size=16"]}
DTYPES = {"head_fp64": "float64"}  # the others train as the trainer does, in float32
WORLDS = {1: None, 2: "torchrun", 3: "horovodrun"}


def trace_world(root: Path, world: int, runs: dict[str, list[str]], dtypes: dict[str, str]) -> tuple[Path, str]:
    """Train ``runs`` (name: ``--set`` overrides of the default config; ``dtypes``: a run's dtype when not float32)
    at ``world`` ranks, each in ``root/<world>/<name>``; that folder and the launch's output."""
    result = trace_launch(root, str(world), {name: (None, sets) for name, sets in runs.items()},
                          launcher=WORLDS[world], np=world, timeout=600, dtypes=dtypes)
    assert result.returncode == 0, result.stdout[-4000:]
    return root / str(world), result.stdout


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("traces")
    runs = {name: [*COMMON, *sets] for name, sets in RUNS.items()}
    return {world: trace_world(root, world, runs, DTYPES) for world in WORLDS}


def _losses(workspace: Path) -> np.ndarray:
    lines = (workspace / "metrics.jsonl").read_text().splitlines()
    return np.array([record["loss"] for record in map(json.loads, lines) if record["type"] == "step"])


def _relative(trace: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return np.abs(trace - reference) / np.abs(reference)


@pytest.mark.parametrize("name", ["folder", "folder_chunked", "folder_head"])
def test_folder_keys_train_the_same_model_at_one_two_and_three_ranks(traces, name):
    reference = _losses(traces[1][0] / name)
    assert reference.size == STEPS and np.ptp(reference) > 1e-2  # the loss moves
    for world in (2, 3):
        assert f"world={world}" in traces[world][1] and "global=64" in traces[world][1]
        drift = _relative(_losses(traces[world][0] / name), reference)
        print(f"{name} -np {world}: largest relative drift {drift.max():.2e}")
        assert drift.max() < 5e-4, (name, world, drift)
    if name == "folder_chunked":  # the chunked step is the plain one: the neck saw the same gathered batch
        assert _relative(reference, _losses(traces[1][0] / "folder")).max() < 5e-4


def test_the_neck_statistics_are_the_global_batch_ones_and_the_config_is_invariant(traces):
    def neck(world: int) -> dict:
        state = torch.load(traces[world][0] / "folder" / "checkpoints" / "last.pt", map_location="cpu",
                           weights_only=True)["model"]
        return {k: v for k, v in state.items() if k.startswith("neck.")}

    one = neck(1)
    assert int(one["neck.num_batches_tracked"]) == STEPS and float(one["neck.running_mean"].abs().max()) > 1e-3
    for world in (2, 3):
        other = neck(world)
        # as close as the traces: the statistics of the same batches. Each tensor relative to its own scale, at
        # least 0.01: without the head the neck's bias stays near zero (3e-5 after 12 steps), where summation
        # order alone is a large relative part (2e-8); a per-rank neck would be off by 1e-2 and more
        drift = {k: float((other[k].float() - one[k].float()).abs().max()) / max(float(one[k].float().abs().max()), 1e-2)
                 for k in one}
        assert max(drift.values()) < 5e-4, (world, drift)
    for world, (_, output) in traces.items():
        assert "note: this config trains a different model" not in output, world


def test_the_head_with_its_defaults_trains_the_same_model_at_one_two_and_three_ranks(traces):
    # Every world size trains one process's model: over the 12 steps the float64 traces agree within 1e-12
    # (measured: 6e-16, the loss's own last rounding). A real difference between world sizes (a wrong gradient
    # scale of the neck, a parameter outside the averaged set, a rank's rows in another order) moves the loss by
    # 1e-3 by step 2, in float64 as in float32. In float32 the same runs drift by up to 6e-3 after step 8: the
    # rounding of another summation order (1e-7) flips the training's switches, and each flip moves the next
    # steps; one process does the same with its weights scaled by 1 + 1e-7 N(0, 1), and with 1 + 1e-10 N(0, 1)
    # nothing grows (benchmarks/float64_trace.py --dtype float32, benchmarks/bnneck_sensitivity.py).
    reference = _losses(traces[1][0] / "head_fp64")
    assert reference.size == STEPS and np.ptp(reference) > 1e-2
    saved = torch.load(traces[1][0] / "head_fp64" / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert {tensor.dtype for tensor in saved["model"].values() if tensor.is_floating_point()} == {torch.float64}
    for world in (2, 3):
        assert "head=arcface" in traces[world][1]
        drift = _relative(_losses(traces[world][0] / "head_fp64"), reference)
        print(f"head in float64 -np {world}: largest relative drift {drift.max():.2e}")
        assert drift.max() < 1e-12, (world, drift)

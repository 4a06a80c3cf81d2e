"""The same model at -np 1, 2 and 3: loss traces of configs/folder.yaml's keys, of the default config and of the
head's defaults.

One launch per world size trains every config compared (``trace_runs.py``):
one process, torchrun -np 2 and horovodrun -np 3 (G = 16 splits 6 + 5 + 5),
12 SGD steps each on the demo data of 32 px unless said otherwise. The configs:

* ``folder``: configs/folder.yaml's model, loss and head keys (the BatchNorm
  neck inside the model, which the step applies to the gathered batch, and
  the light ArcFace head that reads it);
* ``folder_chunked``: the same with gradient-cached steps (``train.chunk_size``),
  the neck applied once to the whole gathered batch;
* ``folder_head``: the same with the light ArcFace head the file offers (``head.name=arcface``: its
  weight 0.1, reading the model's neck);
* ``default_sgd``: the default config as shipped (its data, 40 px, TensorBoard), 6 steps with SGD (G = 16 gathered
  unequally at 3 ranks);
* ``head_tiny_bnneck_False`` / ``_True``: a tiny config with the sharded head (HEAD_TINY: 30 classes, 24 px, one
  epoch of 7 steps), without and with the head's BNNeck;
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
import yaml
from tiny_runs import folder_keys
from trainer_runs import checkpoint, max_difference, run_output, trace_launch

#: the three launches train seven configs each, in the fixture of the first test: its time counts against that test's
#: pytest-timeout (fixture set-up included), 600 s by default; under a loaded machine they take up to ~550 s
pytestmark = [pytest.mark.horovod, pytest.mark.timeout(1500)]
STEPS = 12
COMMON = ["optim.name=sgd", f"train.max_steps={STEPS}", "train.eval_every=100", "train.checkpoint_every=0",
          "train.tensorboard=false", "data.workers=0", "data.image_size=32",
          "data.args={num_classes: 160, images_per_class: 16, image_size: 32}"]


RUNS = {"folder": folder_keys(), "folder_chunked": [*folder_keys(), "train.chunk_size=16"],
        "folder_head": [*folder_keys(), "head.name=arcface"], "head_fp64": ["head.name=arcface", "data.image_size=16"]}
#: runs of the default config as it is (its data, evaluation and TensorBoard), not COMMON's
AS_SHIPPED = {"default_sgd": ["optim.name=sgd", "train.max_steps=6"]}
#: a tiny config with the sharded head (30 classes: 30, 15 and 10 rows per rank), one epoch of 7 steps; its run
#: ``head_tiny_bnneck_<bnneck>`` with and without the head's BNNeck
HEAD_TINY = {
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
DTYPES = {"head_fp64": "float64"}  # the others train as the trainer does, in float32
WORLDS = {1: None, 2: "torchrun", 3: "horovodrun"}


def trace_world(root: Path, world: int, runs: dict[str, tuple[Path | None, list[str]]],
                dtypes: dict[str, str]) -> tuple[Path, str]:
    """Train ``runs`` (name: a config file, None for the default config, and ``--set`` overrides; ``dtypes``: a
    run's dtype when not float32) at ``world`` ranks, each in ``root/<world>/<name>``; that folder and the launch's
    output."""
    result = trace_launch(root, str(world), runs, launcher=WORLDS[world], np=world, timeout=600, dtypes=dtypes)
    assert result.returncode == 0, result.stdout[-4000:]
    return root / str(world), result.stdout


def head_tiny_runs(folder: Path) -> dict[str, tuple[Path, list[str]]]:
    """HEAD_TINY with and without the head's BNNeck, each a config file in ``folder``."""
    runs = {}
    for bnneck in (False, True):
        config = folder / f"head_tiny_bnneck_{bnneck}.yaml"
        config.write_text(yaml.safe_dump({**HEAD_TINY, "head": {**HEAD_TINY["head"], "bnneck": bnneck}}))
        runs[f"head_tiny_bnneck_{bnneck}"] = (config, [])
    return runs


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("traces")
    runs = {**{name: (None, [*COMMON, *sets]) for name, sets in RUNS.items()},
            **{name: (None, sets) for name, sets in AS_SHIPPED.items()}, **head_tiny_runs(root)}
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
        output = run_output(traces[world][1], name)
        assert f"world={world}" in output and "global=64" in output
        drift = _relative(_losses(traces[world][0] / name), reference)
        print(f"{name} -np {world}: largest relative drift {drift.max():.2e}")
        assert drift.max() < 5e-4, (name, world, drift)
    if name == "folder_chunked":  # the chunked step is the plain one: the neck saw the same gathered batch
        assert _relative(reference, _losses(traces[1][0] / "folder")).max() < 5e-4


def test_the_neck_statistics_are_the_global_batch_ones_and_the_config_is_invariant(traces):
    def neck(world: int) -> dict:
        state = checkpoint(traces[world][0] / "folder")["model"]
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
    saved = checkpoint(traces[1][0] / "head_fp64")
    assert {tensor.dtype for tensor in saved["model"].values() if tensor.is_floating_point()} == {torch.float64}
    for world in (2, 3):
        assert "head=arcface" in run_output(traces[world][1], "head_fp64")
        drift = _relative(_losses(traces[world][0] / "head_fp64"), reference)
        print(f"head in float64 -np {world}: largest relative drift {drift.max():.2e}")
        assert drift.max() < 1e-12, (world, drift)


def test_the_default_config_trains_the_same_model_at_one_two_and_three_ranks(traces):
    # G = 16 does not split evenly over 3 ranks: 6, 5 and 5 classes of K = 4 images, gathered unequally.
    # SGD: with the default AdamW the ranks' ~1e-8 reduction-order noise becomes lr-sized steps on coordinates whose
    # gradient is float noise (1.5e-3 apart after 6 steps); with SGD the runs end 6e-8 apart.
    reference = _losses(traces[1][0] / "default_sgd")
    assert reference.size == 6 and len(set(reference.tolist())) == 6
    one = run_output(traces[1][1], "default_sgd")
    assert "world=1" in one and "global=64" in one
    model = checkpoint(traces[1][0] / "default_sgd")["model"]
    for world, per_rank in ((2, 32), (3, 24)):  # the largest rank's share: 8 classes of 4; 6 of 4
        assert f"world={world}" in (output := run_output(traces[world][1], "default_sgd"))
        assert f"batch/rank={per_rank} global=64" in output
        trace = _losses(traces[world][0] / "default_sgd")
        assert trace.size == 6 and np.abs(trace - reference).max() < 1e-5, (world, trace, reference)
        difference = max_difference(checkpoint(traces[world][0] / "default_sgd")["model"], model)
        assert difference < 1e-5, (world, difference)


@pytest.mark.parametrize("bnneck", [False, True])
def test_the_sharded_head_logs_the_same_loss_trace_at_one_two_and_three_ranks(traces, bnneck):
    """The tiny head config: its rows split 30, 15 and 10 per rank; the neck's scale is trained by the dense
    optimizer (Horovod averages it, torchrun's DDP does not see it), so both launchers check its gradient's scale."""
    name = f"head_tiny_bnneck_{bnneck}"
    assert "head=arcface classes=30 rows/rank=30" in run_output(traces[1][1], name)
    for world in (2, 3):
        output = run_output(traces[world][1], name)
        assert f"world={world}" in output and f"head=arcface classes=30 rows/rank={-(-30 // world)}" in output, output
        # best.pt gathers the head's rows from every rank: all ranks build it when rank 0 finds a new best
        assert (traces[world][0] / name / "checkpoints" / "best.pt").is_file()
    reference = _losses(traces[1][0] / name)
    assert reference.size == 7 and np.ptp(reference) > 1e-3
    # with the neck, the first 3 steps agree within 1e-5 (a wrong scale of the neck's gradient is off by 1e-3 at
    # step 2); later steps drift apart in float32, 3.7e-3 by step 6 (benchmarks/bnneck_sensitivity.py: how far a
    # rounding-sized change of the weights moves this config in one process)
    steps = 3 if bnneck else reference.size
    later = 1e-2 if bnneck else 1e-5
    for world in (2, 3):
        trace = _losses(traces[world][0] / name)
        assert np.allclose(trace[:steps], reference[:steps], rtol=1e-5, atol=0), (world, trace, reference)
        assert np.allclose(trace, reference, rtol=later, atol=0), (world, trace, reference)

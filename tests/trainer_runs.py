"""The small config the trainer's launched tests share (tests/distributed/test_trainer.py, test_trainer_errors.py):
24 synthetic classes, a two-stage net, two short epochs; the readers of what a run wrote; and several short
trainings in one launch (:func:`trace_launch`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from launch import ROOT, environment, launch, run_launcher

SCRIPT = ROOT / "train" / "retrieval.py"
HOOKED = ROOT / "tests" / "distributed" / "train_with_test_hooks.py"
TRACE_RUNS = ROOT / "tests" / "distributed" / "trace_runs.py"
#: what rank 0 of a trace launch prints before each run, with the run's name (passed in the launch's spec)
RUN_MARKER = "[trace run] "

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
    """TINY with ``changes`` (``block__key=value``), its workspace ``tmp_path / name``, as ``tmp_path / name.yaml``."""
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


def trace_launch(folder: Path, name: str, runs: dict[str, tuple[Path | None, list[str]]], *, launcher: str | None,
                 np: int = 2, timeout: float = 300.0,
                 dtypes: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Train ``runs`` (name: config file or None for the defaults, ``--set`` overrides) one after the other in one
    launch of tests/distributed/trace_runs.py, each in ``folder / name / <run>``; ``launcher`` None: one plain
    process; ``dtypes``: a run's dtype when not the trainer's float32 (trace_runs.py). Output merged. A launch
    costs seconds of start-up per rank: the runs a comparison reads share one."""
    spec = folder / f"{name}.json"
    spec.write_text(json.dumps({"root": str(folder / name), "marker": RUN_MARKER, "runs": {
        run: {"config": None if config is None else str(config), "set": list(sets), "dtype": (dtypes or {}).get(run)}
        for run, (config, sets) in runs.items()}}))
    if launcher is None:
        return run_launcher([sys.executable, str(TRACE_RUNS), str(spec)], kind="python", timeout=timeout,
                            env=environment())
    return launch(launcher, TRACE_RUNS, str(spec), np=np, timeout=timeout)


def run_output(output: str, run: str) -> str:
    """The lines of ``run`` in the output of a :func:`trace_launch` (from rank 0's marker before it to the next)."""
    parts = output.split(RUN_MARKER)
    found = [part for part in parts[1:] if part.split("\n", 1)[0].strip() == run]
    assert len(found) == 1, f"no single {RUN_MARKER}{run} in the launch's output:\n{output[-3000:]}"
    return found[0]

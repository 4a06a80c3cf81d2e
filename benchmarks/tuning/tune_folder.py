"""One tuning run of a config on an image folder, in this process, with its held-out metrics and CPU time.

Run: OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/tuning/tune_folder.py NAME --data DIR
     [--config configs/folder.yaml] [--set key=value ...]

Why: choosing ``configs/folder.yaml`` means training it many times on more
than one set (real photographs, typefaces). One process trains the same
model as W ranks with the same global batch (group norm; the trainer's
world-size equivalence), so a tuning run here stands for the ``horovodrun
-np 2`` run at half the processes. The machine is shared, so besides the
wall time the run's own CPU time is recorded: on a quiet 2-core machine,
``-np 2`` takes about that CPU time divided by the two cores (plus
Horovod's overhead, see README "Scaling").

Appends one line to ``workspace/tuning/results.jsonl``: name, data, overrides,
final held-out metrics (``last.pt``'s model, evaluated by the trainer after
the last epoch), wall and CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from pksampler.train import run_setup
from pksampler.train.config.load import load_config

ROOT = Path(__file__).resolve().parents[2]


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the loader's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="run name (folder under workspace/tuning)")
    parser.add_argument("--data", type=Path, required=True, help="image folder (one sub-folder per class)")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "folder.yaml")
    parser.add_argument("--results", type=Path, default=ROOT / "workspace" / "tuning" / "results.jsonl")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if not args.data.is_dir():
        raise SystemExit(f"--data {args.data}: no such folder")
    workspace = ROOT / "workspace" / "tuning" / args.name
    overrides = [f"data.root={args.data.resolve()}", f"workspace={workspace}", "train.resume=false",
                 "distributed.backend=none", "train.tensorboard=false", *args.overrides]
    config = load_config(args.config, overrides, environ={})
    torch.set_num_threads(config.train.threads)
    start, cpu = time.perf_counter(), _cpu_seconds()
    result = run_setup.main(config)
    record = {"name": args.name, "data": str(args.data), "overrides": args.overrides,
              "wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(_cpu_seconds() - cpu, 1),
              "steps": result.global_step,
              **{k: round(v, 4) for k, v in result.final_metrics.items() if isinstance(v, float)}}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a", encoding="utf-8") as stream:  # a log of runs: one line each, appended
        stream.write(json.dumps(record) + "\n")
    print(f"TUNE {args.name}: R@1 {record.get('recall_at_1', float('nan')):.4f} "
          f"MAP@R {record.get('map_at_r', float('nan')):.4f} wall {record['wall_s']:.0f} s cpu {record['cpu_s']:.0f} s")


if __name__ == "__main__":
    main()

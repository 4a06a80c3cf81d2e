"""Train on real photographs and compare with raw-pixel and untrained-network baselines.

Run: .venv/bin/python benchmarks/real_images.py [--config configs/folder.yaml] [--np 2] [--data DIR]
     [--workspace DIR] [--set key=value ...]

Steps:

1. Build the image folder with ``sets/make_real_images.py`` (photos bundled in
   scikit-image, 200 classes x 16 views at 64 px by default) unless ``--data``
   already holds a finished set with the same parameters.
2. Train ``--config`` on it with ``horovodrun -np N`` (``HOROVOD_CYCLE_TIME=10``,
   one OpenMP thread per rank, as ``make demo``), through
   ``train/retrieval.py --set data.root=<set>``, from scratch; the wall time
   of the whole launch is measured.
3. Evaluate the final model (``last.pt``, not the best-on-test ``best.pt``)
   and the baselines on the same held-out classes and images as the trainer,
   and print one table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "sets"))
from baselines import baseline_rows, format_rows  # noqa: E402
from make_real_images import make_real_images, set_is_complete  # noqa: E402

from pksampler.files import atomic_write_text  # noqa: E402
from pksampler.train.config.load import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def train_command(config: Path, np_: int, overrides: list[str]) -> list[str]:
    """The launch command: horovodrun for -np > 1 (or when Horovod is installed), else plain python."""
    script = [sys.executable, str(ROOT / "train" / "retrieval.py"), "--config", str(config), "--no-resume"]
    script += [item for text in overrides for item in ("--set", text)]
    horovodrun = Path(sys.executable).with_name("horovodrun")
    if np_ == 1 and not horovodrun.exists():
        return script
    return [str(horovodrun), "-np", str(np_), "-H", f"localhost:{np_}", *script]


def run_training(config: Path, np_: int, overrides: list[str]) -> float:
    """Launch training and return its wall time in seconds; raises if it fails."""
    env = dict(os.environ, HOROVOD_CYCLE_TIME=os.environ.get("HOROVOD_CYCLE_TIME", "10"),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for key in ("DATASETS_PATH", "DATASETS", "WORKSPACE"):  # the command line says where, not the environment
        env.pop(key, None)
    command = train_command(config, np_, overrides)
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, env=env, cwd=ROOT, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "folder.yaml")
    parser.add_argument("--np", dest="np_", type=int, default=2, help="ranks for horovodrun (default 2)")
    parser.add_argument("--data", type=Path, default=ROOT / "workspace" / "real_images" / "data")
    parser.add_argument("--workspace", type=Path, default=None,
                        help="run folder (default workspace/real_images/<config name>)")
    parser.add_argument("--classes", type=int, default=200)
    parser.add_argument("--views", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override passed to the trainer and the baselines (repeatable)")
    parser.add_argument("--skip-training", action="store_true", help="evaluate an existing run's last.pt")
    args = parser.parse_args()
    if args.np_ < 1:
        raise SystemExit(f"--np must be >= 1, got {args.np_}")

    if not set_is_complete(args.data, args.classes, args.views, args.size, args.data_seed):
        shutil.rmtree(args.data, ignore_errors=True)
        print(f"building the real-photo set in {args.data}", flush=True)
        make_real_images(args.data, classes=args.classes, views=args.views, size=args.size, seed=args.data_seed)
    workspace = args.workspace or ROOT / "workspace" / "real_images" / args.config.stem
    overrides = [f"data.root={args.data.resolve()}", f"workspace={workspace.resolve()}", *args.overrides]

    wall = None
    if not args.skip_training:
        wall = run_training(args.config, args.np_, overrides)
    config = load_config(args.config, overrides, environ={})
    torch.set_num_threads(2)
    name = f"trained ({args.config.name}, final)"
    rows, labels = baseline_rows(config, workspace / "checkpoints" / "last.pt", trained_name=name)
    gain = rows[name]["recall_at_1"] - rows["raw pixels (cosine)"]["recall_at_1"]
    print(f"\nheld-out classes: {np.unique(labels).size}, images: {labels.size}; "
          f"-np {args.np_}" + (f", training wall time {wall:.0f} s" if wall is not None else ""))
    print(format_rows(rows))
    print(f"R@1 over raw pixels: {gain:+.3f}\n")
    print(format_rows(rows, markdown=True))
    atomic_write_text(workspace / "real_images.json", json.dumps(
        {"rows": rows, "wall_s": wall, "np": args.np_, "overrides": args.overrides}, indent=2))


if __name__ == "__main__":
    main()

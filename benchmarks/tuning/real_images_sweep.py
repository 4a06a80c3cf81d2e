"""One tuning run on the real-photo set, in this process (one rank), with optional augmentation ranges.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tuning/real_images_sweep.py NAME [--config configs/folder.yaml]
     [--scale 0.6 1.0] [--jitter 0.3] [--rotation 0] [--set key=value ...]

Why: the trainer builds its device-side augmentation with ``BatchAugment(image_size, seed=)``
and the config has no augmentation keys, so trying other crop-scale,
colour-jitter and rotation ranges needs its arguments replaced; this script does
that for one run only and leaves the defaults alone. One rank trains the same
model as W ranks with the same global batch (group norm; a ``batch`` neck is
the exception), so tuning at one process stands for the ``-np 2`` run.
Prints and records (``workspace/real_images/sweep/NAME/sweep.json``) the final
held-out metrics and the wall time.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sets"))
from make_real_images import make_real_images, set_is_complete  # noqa: E402

from pksampler.datasets import BatchAugment  # noqa: E402
from pksampler.files import atomic_write_text  # noqa: E402
from pksampler.train import builders, run_setup  # noqa: E402  # noqa: E402
from pksampler.train.config.load import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="run name (folder under workspace/real_images/sweep)")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "folder.yaml")
    parser.add_argument("--data", type=Path, default=ROOT / "workspace" / "real_images" / "data")
    parser.add_argument("--scale", type=float, nargs=2, default=None, help="random resized crop area range")
    parser.add_argument("--jitter", type=float, default=None, help="colour jitter strength")
    parser.add_argument("--rotation", type=float, default=None, help="largest random rotation, degrees")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if not set_is_complete(args.data, 200, 16, 64, 0):
        make_real_images(args.data)
    workspace = ROOT / "workspace" / "real_images" / "sweep" / args.name
    overrides = [f"data.root={args.data.resolve()}", f"workspace={workspace}", "train.resume=false",
                 "distributed.backend=none", *args.overrides]
    preset_args = {k: v for k, v in (("scale", tuple(args.scale) if args.scale else None),
                                     ("jitter", args.jitter), ("rotation", args.rotation)) if v is not None}
    builders.BatchAugment = functools.partial(BatchAugment, **preset_args)
    start = time.perf_counter()
    result = run_setup.main(load_config(args.config, overrides, environ={}))
    wall = time.perf_counter() - start
    record = {"name": args.name, "overrides": args.overrides, "preset": preset_args, "wall_s": wall,
              **{k: v for k, v in result.final_metrics.items() if isinstance(v, float)}}
    atomic_write_text(workspace / "sweep.json", json.dumps(record, indent=2))
    print(f"SWEEP {args.name}: R@1 {record['recall_at_1']:.4f} MAP@R {record['map_at_r']:.4f} wall {wall:.0f} s")


if __name__ == "__main__":
    main()

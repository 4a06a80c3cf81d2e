"""The head's trace at -np 1, 2 and 3 in float64: does its drift across world sizes stay at rounding size?

Run: .venv/bin/python benchmarks/float64_trace.py [--set KEY=VALUE ...] [--dtype float64|float32]

Trains the ``head`` run of tests/distributed/test_global_neck.py
(``head.name=arcface`` with the recipe's defaults, 12 SGD steps on the demo
data, plus any ``--set``) in one process, under torchrun -np 2 and under
horovodrun -np 3, every tensor in ``--dtype``, and prints each world size's
largest relative difference from one process's loss trace. In float64 the
rounding of another summation order is about 10⁻¹⁶ instead of 10⁻⁷: a drift
that shrinks by that much is rounding amplified by the training; one that
stays near its float32 size is a real difference between world sizes (an
order of rows, a divisor, a parameter outside the averaged set).

The runs are tests/distributed/trace_runs.py's, which trains a run in
float64 when its spec says so (``computing_in``: the model and the headed
loss converted as they are built, the images on their way in, the step's
``.float()`` casts kept at float64). A measurement only: the package trains in
float32 (or lower).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "distributed"))


def world_trace(world: int, launcher: str | None, root: Path, sets: list[str], dtype: str) -> np.ndarray:
    """The step losses of the head run at ``world`` ranks."""
    from launch import launch
    from test_global_neck import COMMON, RUNNER, _losses

    spec = root / f"runs{world}.json"
    run = {"config": None, "set": [*COMMON, "head.name=arcface", *sets], "dtype": None if dtype == "float32" else dtype}
    spec.write_text(json.dumps({"root": str(root / str(world)), "runs": {"head": run}}))
    if launcher is None:
        result = subprocess.run([sys.executable, str(RUNNER), str(spec)], cwd=ROOT, capture_output=True, text=True,
                                timeout=900)
        output = result.stdout + result.stderr
    else:
        result = launch(launcher, RUNNER, str(spec), np=world, timeout=900)
        output = result.stdout
    if result.returncode != 0:
        raise SystemExit(f"-np {world} failed:\n{output[-4000:]}")
    return _losses(root / str(world) / "head")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        traces = {world: world_trace(world, launcher, Path(folder), args.sets, args.dtype)
                  for world, launcher in ((1, None), (2, "torchrun"), (3, "horovodrun"))}
    print(f"{args.dtype}, head.name=arcface {' '.join(args.sets)}: losses at -np 1: "
          + " ".join(f"{x:.6f}" for x in traces[1]))
    for world in (2, 3):
        drift = np.abs(traces[world] - traces[1]) / np.abs(traces[1])
        print(f"-np {world}: largest relative drift {drift.max():.2e} (first 6 steps {drift[:6].max():.2e}); "
              "by step: " + " ".join(f"{x:.1e}" for x in drift))


if __name__ == "__main__":
    main()

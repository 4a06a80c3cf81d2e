"""The head's trace at -np 1, 2 and 3 in float64: does its drift across world sizes stay at rounding size?

Run: .venv/bin/python benchmarks/float64_trace.py [--set KEY=VALUE ...] [--dtype float64|float32]

Trains the ``head_fp64`` run of tests/distributed/test_global_neck.py on
the 32 px crops the figures in the docs were measured on (the test trains
16 px crops: ``--set data.image_size=16`` for its run): ``head.name=arcface``
with the recipe's defaults, 12 SGD steps on the demo data, plus any ``--set``, in one process, under torchrun -np 2 and under
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
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "distributed"))


def world_trace(world: int, root: Path, sets: list[str], dtype: str) -> np.ndarray:
    """The step losses of the head run at ``world`` ranks."""
    from test_global_neck import COMMON, _losses, trace_world

    dtypes = {} if dtype == "float32" else {"head": dtype}
    return _losses(trace_world(root, world, {"head": (None, [*COMMON, "head.name=arcface", *sets])}, dtypes)[0] / "head")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        traces = {world: world_trace(world, Path(folder), args.sets, args.dtype) for world in (1, 2, 3)}
    print(f"{args.dtype}, head.name=arcface {' '.join(args.sets)}: losses at -np 1: "
          + " ".join(f"{x:.6f}" for x in traces[1]))
    for world in (2, 3):
        drift = np.abs(traces[world] - traces[1]) / np.abs(traces[1])
        print(f"-np {world}: largest relative drift {drift.max():.2e} (first 6 steps {drift[:6].max():.2e}); "
              "by step: " + " ".join(f"{x:.1e}" for x in drift))


if __name__ == "__main__":
    main()

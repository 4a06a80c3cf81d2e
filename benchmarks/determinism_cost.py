"""The cost of ``train.deterministic`` (the demo, horovodrun -np 2).

Run: .venv/bin/python benchmarks/determinism_cost.py [--steps 30] [--repeats 2]

Both runs train the default config (configs/demo.yaml) for the same steps,
with ``train.deterministic`` true and false. True turns Horovod's tensor
fusion off (one allreduce per gradient tensor instead of a few fused
buffers) and torch's kernels to deterministic ones. The seconds per step
come from the time stamps in each run's metrics.jsonl, past the first
quarter of the steps; the median of interleaved repeats.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from checkpoint_cost import seconds_per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting; the median is reported")
    args = parser.parse_args()
    runs: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # interleaved, so drifts in machine load hit both
            for deterministic in (True, False):
                runs[deterministic].append(seconds_per_step(
                    Path(tmp) / f"{deterministic}{repeat}", args.steps,
                    "--set", f"train.deterministic={str(deterministic).lower()}", "--set", "train.checkpoint_every=0"))
    on, off = statistics.median(runs[True]), statistics.median(runs[False])
    for name, value in (("true", on), ("false", off)):
        print(f"train.deterministic={name:5s}: {value * 1000:7.1f} ms/step  "
              f"(runs: {', '.join(f'{v * 1000:.1f}' for v in runs[name == 'true'])})")
    print(f"cost of train.deterministic: {(on - off) * 1000:+.1f} ms/step ({on / off - 1:+.1%})")


if __name__ == "__main__":
    main()

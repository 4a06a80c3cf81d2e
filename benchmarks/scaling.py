"""Training throughput at -np 2 against -np 1 (one thread per rank).

Run: .venv/bin/python benchmarks/scaling.py [--steps 40]

Both runs use the demo model and data with the same per-rank batch (8
classes x 4 images: the global ``sampler.classes_per_step`` is 8 x W), no
DataLoader workers and one torch thread per rank, so -np 2 processes twice
the images per step. Throughput is global images per second over the steps
after the first quarter, from the time stamps in each run's metrics.jsonl;
the median of interleaved repeats. Target: >= 1.8x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import images_per_second  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = Path(sys.executable).parent / "horovodrun"


def throughput(np_: int, steps: int, workdir: Path) -> float:
    workspace = workdir / f"np{np_}"
    command = [str(HOROVODRUN), "-np", str(np_), "-H", f"localhost:{np_}", sys.executable,
               str(ROOT / "train" / "retrieval.py"), "--no-resume",
               "--set", f"workspace={workspace}", "--set", f"train.max_steps={steps}",
               "--set", "train.epochs=100", "--set", "train.checkpoint_every=0",
               "--set", "train.threads=1", "--set", "data.workers=0",
               "--set", f"sampler.classes_per_step={8 * np_}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return images_per_second(workspace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3, help="runs per world size; the median is reported")
    args = parser.parse_args()
    ones, twos = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # interleaved, so drifts in machine load hit both
            ones.append(throughput(1, args.steps, Path(tmp) / str(repeat)))
            twos.append(throughput(2, args.steps, Path(tmp) / str(repeat)))
    one, two = statistics.median(ones), statistics.median(twos)
    print(f"-np 1: {one:8.1f} images/s  (runs: {', '.join(f'{v:.1f}' for v in ones)})")
    print(f"-np 2: {two:8.1f} images/s  (runs: {', '.join(f'{v:.1f}' for v in twos)})")
    print(f"speed-up: {two / one:.2f}x (target >= 1.8x)")


if __name__ == "__main__":
    main()

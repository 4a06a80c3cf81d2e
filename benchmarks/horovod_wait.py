"""The default command with Horovod's spinning wait against the trainer's sleeping one (``distributed.horovod_wait``).

Run: .venv/bin/python benchmarks/horovod_wait.py [--np 2 16] [--repeats 1]

Each world size trains the default config for one epoch, as
``horovodrun -np N python train/retrieval.py --set train.epochs=1`` (the
suite's headline test at 16 ranks), once with ``distributed.horovod_wait=spin``
(Horovod's ``synchronize``: a loop of ``sched_yield``) and once with
``sleep`` (polls with sleeps of 20 us to 1 ms; the CPU default), interleaved.
Reported per run: wall time, the CPU seconds of the launcher and every rank
(user and kernel), and the training's images per second after its first
quarter (metrics.jsonl). The ratios compare the two waits in the same run.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import images_per_second  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
WAITS = ("spin", "sleep")


def train(np_: int, wait: str, workspace: Path) -> dict[str, float]:
    """One run of the default command; its wall time, CPU seconds (user, kernel) and images/s."""
    command = [str(HOROVODRUN), "-np", str(np_), sys.executable, str(ROOT / "train" / "retrieval.py"),
               "--no-resume", "--set", f"workspace={workspace}", "--set", "train.epochs=1",
               "--set", f"distributed.horovod_wait={wait}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "180"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall": wall, "user": after.ru_utime - before.ru_utime, "sys": after.ru_stime - before.ru_stime,
            "images_per_s": images_per_second(workspace)}


def report(np_: int, runs: dict[str, list[dict[str, float]]]) -> None:
    median = {wait: {key: statistics.median(run[key] for run in runs[wait]) for key in runs[wait][0]}
              for wait in WAITS}
    for wait in WAITS:
        m = median[wait]
        print(f"-np {np_:2d} {wait:5s}: wall {m['wall']:6.1f} s  CPU {m['user'] + m['sys']:6.1f} s "
              f"(user {m['user']:6.1f}, kernel {m['sys']:6.1f})  {m['images_per_s']:6.1f} images/s")
    spin, sleep = median["spin"], median["sleep"]
    print(f"-np {np_:2d} sleep/spin: wall {sleep['wall'] / spin['wall']:.2f}x  "
          f"CPU {(sleep['user'] + sleep['sys']) / (spin['user'] + spin['sys']):.2f}x  "
          f"images/s {sleep['images_per_s'] / spin['images_per_s']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, nargs="+", default=[2, 16], help="world sizes (default: 2 16)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per wait and world size; medians reported")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for np_ in args.np:
            runs: dict[str, list[dict[str, float]]] = {wait: [] for wait in WAITS}
            for repeat in range(args.repeats):  # interleaved, so a drift in the machine's load hits both
                for wait in WAITS:
                    runs[wait].append(train(np_, wait, Path(tmp) / f"np{np_}-{wait}-{repeat}"))
            report(np_, runs)


if __name__ == "__main__":
    main()

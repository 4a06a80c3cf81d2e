"""The cost per step of a checkpoint every step, against checkpoints far apart (the demo, horovodrun -np 2).

Run: .venv/bin/python benchmarks/checkpoint_cost.py [--steps 30] [--repeats 2]

Both runs train the default config (configs/demo.yaml) for the same steps;
one with ``train.checkpoint_every=1``, one with ``train.checkpoint_every``
larger than the run. Rank 0 copies the state to host memory and writes it
in a background thread (:class:`pksampler.train.engine.checkpoint.CheckpointWriter`),
so the loop pays the copy, not the write. The seconds per step come from the
time stamps in each run's metrics.jsonl, past the first quarter of the steps;
the median of interleaved repeats. Then, in this process, the two halves of
one checkpoint of the final state: the host copy (what the loop pays) and
serialising + writing the file with fsync (what a synchronous save would add
to every step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import steady_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = Path(sys.executable).parent / "horovodrun"


def seconds_per_step(workspace: Path, steps: int, *settings: str) -> float:
    """Train the demo for ``steps`` steps on two ranks; seconds per step past the first quarter."""
    command = [str(HOROVODRUN), "-np", "2", "-H", "localhost:2", sys.executable, str(ROOT / "train" / "retrieval.py"),
               "--no-resume", "--set", f"workspace={workspace}", "--set", f"train.max_steps={steps}", *settings]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    warm, last = steady_steps(workspace)
    return (last["time"] - warm["time"]) / (last["global_step"] - warm["global_step"])


def split_cost(path: Path, repeats: int = 5) -> tuple[float, float, int]:
    """Seconds for the host copy and for serialise + atomic write of the checkpoint at ``path``; its size."""
    from pksampler.train.engine.checkpoint import host_copy, load_checkpoint, save_checkpoint

    state = load_checkpoint(path)
    copies, writes = [], []
    for repeat in range(repeats):
        started = time.perf_counter()
        snapshot = host_copy(state)
        copies.append(time.perf_counter() - started)
        started = time.perf_counter()
        save_checkpoint(path.with_name(f"bench{repeat}.pt"), snapshot)
        writes.append(time.perf_counter() - started)
    return statistics.median(copies), statistics.median(writes), path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting; the median is reported")
    args = parser.parse_args()
    every, apart = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # interleaved, so drifts in machine load hit both
            every.append(seconds_per_step(Path(tmp) / f"every{repeat}", args.steps, "--set", "train.checkpoint_every=1"))
            apart.append(seconds_per_step(Path(tmp) / f"apart{repeat}", args.steps,
                                          "--set", f"train.checkpoint_every={10 * args.steps}"))
        copy, write, size = split_cost(Path(tmp) / "every0" / "checkpoints" / "last.pt")
    one, far = statistics.median(every), statistics.median(apart)
    print(f"checkpoint_every=1:     {one * 1000:7.1f} ms/step  (runs: {', '.join(f'{v * 1000:.1f}' for v in every)})")
    print(f"checkpoint_every={10 * args.steps}: {far * 1000:7.1f} ms/step  (runs: {', '.join(f'{v * 1000:.1f}' for v in apart)})")
    print(f"cost of a checkpoint every step: {(one - far) * 1000:+.1f} ms/step ({one / far - 1:+.1%})")
    print(f"one checkpoint ({size / 2**20:.1f} MiB): host copy {copy * 1000:.1f} ms (in the loop), "
          f"serialise + write + fsync {write * 1000:.1f} ms (in the background)")


if __name__ == "__main__":
    main()

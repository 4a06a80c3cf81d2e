"""The sharded head's checkpoint: peak RSS per rank when the head is gathered to rank 0 in blocks, against the
all-gather to every rank that checkpoints (and Horovod elastic's commit) used before.

Run: .venv/bin/python benchmarks/head_checkpoint_memory.py [--np 2] [--classes 2000000]

Each mode is its own ``horovodrun -np N`` job (a rank's peak RSS is its own).
A rank builds its share of a C × 128 fp32 head and its momentum, takes one
ArcFace step, then builds the loss's checkpoint state as the trainer does
(``HeadedLoss.state_dict``) and rank 0 writes it with ``torch.save``:

* ``root``: ``state_dict()`` (the checkpoint): rows and momentum reach rank 0
  in blocks of 64 MiB per collective; the other ranks hold one block at a time;
* ``everywhere``: ``state_dict(everywhere=True)`` (every checkpoint and Horovod
  elastic commit before): one all-gather, the whole head on every rank.

Printed per mode: each rank's peak RSS and the RSS before the checkpoint.
C = 2·10⁶ × 128 × 4 bytes is a 0.95 GiB head (rows; as much again of momentum).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import rss_bytes as _rss, stepped_head  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch

    backend, loss_fn = stepped_head(args.classes)
    before = _rss()
    state = loss_fn.state_dict(everywhere=args.mode == "everywhere")
    if backend.rank == 0:
        with tempfile.TemporaryDirectory() as folder:
            torch.save(state, Path(folder) / "loss.pt")
    del state
    backend.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"rank": backend.rank, "before": before, "peak_rss": peak}), flush=True)


def run_mode(mode: str, args: argparse.Namespace) -> list[dict[str, int]] | None:
    horovodrun = Path(sys.executable).with_name("horovodrun")
    command = [str(horovodrun), "-np", str(args.np), "-H", f"localhost:{args.np}", sys.executable, __file__,
               "--worker", "--mode", mode, "--classes", str(args.classes)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": "10"}
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    ranks = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines()
                    if "RESULT " in line), key=lambda r: r["rank"])
    if done.returncode != 0 or len(ranks) != args.np:
        print(f"{mode:10s}: did not finish (exit {done.returncode}; out of memory?)\n{done.stdout[-2000:]}")
        return None
    cells = ", ".join(f"rank {r['rank']} {r['peak_rss'] / 2**30:.2f} GiB (before {r['before'] / 2**30:.2f})"
                      for r in ranks)
    print(f"{mode:10s}: peak RSS {cells}", flush=True)
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--classes", type=int, default=2_000_000)
    parser.add_argument("--mode", choices=("root", "everywhere"), default="root", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"C = {args.classes:,} × 128 fp32: a head of {args.classes * 128 * 4 / 2**30:.2f} GiB, W = {args.np}")
    everywhere, root = run_mode("everywhere", args), run_mode("root", args)
    if everywhere and root:
        worst = [max(r["peak_rss"] for r in ranks) for ranks in (everywhere, root)]
        print(f"worst rank: {worst[0] / 2**30:.2f} -> {worst[1] / 2**30:.2f} GiB; other ranks "
              f"{max(r['peak_rss'] for r in everywhere[1:]) / 2**30:.2f} -> "
              f"{max(r['peak_rss'] for r in root[1:]) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()

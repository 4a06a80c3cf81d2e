"""The sharded head's checkpoint: peak RSS per rank when every rank writes its own range of the rows (the
trainer's ``last.pt`` now), against the whole head gathered to rank 0 in blocks (``last.pt`` before).

Run: .venv/bin/python benchmarks/head_checkpoint_memory.py [--np 2] [--classes 2000000]

Each mode is its own ``horovodrun -np N`` job (a rank's peak RSS is its own).
A rank builds its share of a C × 128 fp32 head and its momentum, takes one
ArcFace step, then builds the loss's checkpoint state as the trainer does and
writes it into a shared folder:

* ``ranges``: ``range_state(copy=False)`` and :func:`~pksampler.train.modeling.range_checkpoint.write_ranges`
  (``Trainer.state_dict(write_rows=...)``): every rank writes its own range
  (on the CPU, the live rows: no copy), rank 0 the manifest and the dense state;
* ``root``: ``whole_state()``: rows and momentum reach rank 0 in blocks of
  64 MiB per collective and rank 0 writes the whole head in one file.

Printed per mode: each rank's peak RSS and the RSS before the checkpoint, and
rank 0's peak over the largest of the others' (goal: at most 1.10).
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

    from pksampler.train.modeling.range_checkpoint import write_ranges

    backend, loss_fn = stepped_head(args.classes)
    before = _rss()
    checkpoint = Path(args.folder) / "last.pt"
    if args.mode == "ranges":
        dense, own = loss_fn.range_state(copy=False)
        state = {**dense, "ranges": write_ranges(checkpoint, "loss", own, num_rows=loss_fn.num_rows, step=1,
                                                 collectives=backend)}
        del own
    else:
        state = loss_fn.whole_state()
    if backend.rank == 0:
        torch.save(state, checkpoint)
    del state
    backend.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"rank": backend.rank, "before": before, "peak_rss": peak}), flush=True)


def run_mode(mode: str, args: argparse.Namespace) -> list[dict[str, int]] | None:
    horovodrun = Path(sys.executable).with_name("horovodrun")
    command = [str(horovodrun), "-np", str(args.np), "-H", f"localhost:{args.np}", sys.executable, __file__,
               "--worker", "--mode", mode, "--classes", str(args.classes), "--folder", args.folder]
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
    parser.add_argument("--mode", choices=("ranges", "root"), default="ranges", help=argparse.SUPPRESS)
    parser.add_argument("--folder", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"C = {args.classes:,} × 128 fp32: a head of {args.classes * 128 * 4 / 2**30:.2f} GiB, W = {args.np}")
    for mode in ("root", "ranges"):
        with tempfile.TemporaryDirectory() as folder:
            args.folder = folder
            ranks = run_mode(mode, args)
        if ranks:
            others = max(r["peak_rss"] for r in ranks[1:])
            print(f"{mode:10s}: rank 0's peak / the others' largest = {ranks[0]['peak_rss'] / others:.2f}", flush=True)


if __name__ == "__main__":
    main()

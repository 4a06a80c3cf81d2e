"""Horovod elastic's in-memory commit of the sharded head: own range + one replica, against the whole head.

Run: .venv/bin/python benchmarks/elastic_head_commit.py [--classes 1000000]

Each mode is its own ``horovodrun -np 4 -H localhost:2,127.0.0.1:2`` job (two
hosts of two ranks on this machine; a rank's peak RSS is its own). A rank
builds its share of a C × 128 fp32 head and its momentum, takes one ArcFace
step, then commits three times as the trainer's elastic state does:

* ``whole``: the commit before: ``copy.deepcopy(loss.whole_state(everywhere=True))``,
  the whole head's rows and momentum on every rank;
* ``replica``: :class:`~pksampler.train.engine.elastic.SharedPartHandler`'s ``save``:
  this rank's range and the range of rank (r − 2) mod 4 (the other host),
  moved by all-to-all in blocks of 64 MiB.

Printed per mode: each rank's peak RSS and the RSS before the commits, and
the median seconds of a commit. Timings are ratios within one run; the
machine may be shared.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import rss_bytes as _rss, stepped_head  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    from pksampler.train.engine.elastic import SharedPartHandler, Shared

    backend, loss_fn = stepped_head(args.classes)
    handler = SharedPartHandler(Shared(loss_fn), collectives=backend)
    held: object = None
    before, seconds = _rss(), []
    for _ in range(3):
        backend.barrier()
        start = time.perf_counter()
        if args.mode == "whole":
            held = copy.deepcopy(loss_fn.whole_state(everywhere=True))
        else:
            handler.save()
        seconds.append(time.perf_counter() - start)
    backend.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kept = sum(c.hi - c.lo for c in handler.copies) if args.mode == "replica" else args.classes
    replica_of = [c.lo for c in handler.copies[1:]]  # the first class id of the replica's range
    del held
    print("RESULT " + json.dumps({"rank": backend.rank, "before": before, "peak_rss": peak,
                                  "seconds": statistics.median(seconds), "rows_kept": kept,
                                  "replica_of": replica_of}), flush=True)


def run_mode(mode: str, args: argparse.Namespace) -> list[dict[str, float]] | None:
    horovodrun = Path(sys.executable).with_name("horovodrun")
    command = [str(horovodrun), "-np", "4", "-H", "localhost:2,127.0.0.1:2", sys.executable, __file__,
               "--worker", "--mode", mode, "--classes", str(args.classes)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": "10"}
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    ranks = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines()
                    if "RESULT " in line), key=lambda r: r["rank"])
    if done.returncode != 0 or len(ranks) != 4:
        print(f"{mode:8s}: did not finish (exit {done.returncode}; out of memory?)\n{done.stdout[-2000:]}"
              f"{done.stderr[-2000:]}")
        return None
    cells = ", ".join(f"rank {r['rank']} {r['peak_rss'] / 2**30:.2f} GiB (before {r['before'] / 2**30:.2f}, "
                      f"{r['rows_kept']:,} rows kept, replica from class {r['replica_of'] or '-'})" for r in ranks)
    print(f"{mode:8s}: commit {statistics.median(r['seconds'] for r in ranks):.3f} s; peak RSS {cells}", flush=True)
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, default=1_000_000)
    parser.add_argument("--mode", choices=("whole", "replica"), default="replica", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"C = {args.classes:,} × 128 fp32: a head of {args.classes * 128 * 4 / 2**30:.2f} GiB (as much again of "
          "momentum), W = 4 on 2 hosts")
    whole, replica = run_mode("whole", args), run_mode("replica", args)
    if whole and replica:
        grow = [max(r["peak_rss"] - r["before"] for r in ranks) for ranks in (whole, replica)]
        time_ratio = statistics.median(r["seconds"] for r in replica) / statistics.median(r["seconds"] for r in whole)
        print(f"largest rise of a rank's RSS at the commits: {grow[0] / 2**30:.2f} -> {grow[1] / 2**30:.2f} GiB; "
              f"commit time replica/whole = {time_ratio:.2f}")


if __name__ == "__main__":
    main()

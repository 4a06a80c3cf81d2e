"""The row-sharded head at 10⁷ classes on CPU ranks: peak memory and time per step, sparse against dense updates.

Run: .venv/bin/python benchmarks/sharded_head.py [--np 2] [--classes 10000000] [--dense-classes 1000000 4000000]

Each case is its own ``horovodrun -np N`` job (each rank's peak RSS is the
case's own). A step: 256 L2-normalised 128-d embeddings (the global batch,
all-gathered from the ranks' 128), ArcFace (scale 30, margin 0.3, 8,192
expected negatives, the batch's classes as positives), forward + backward +
update. Two ways to update the rows:

* ``sparse``: pksampler's head (rows as a plain tensor, the sampled rows'
  gradient only, :class:`~pksampler.train.solver.sparse_rows.SparseRowSGD`);
* ``dense``: Partial FC v2's pattern, the shard as an ``nn.Parameter`` whose
  gradient is a dense tensor of the shard's size, with torch's SGD and its
  dense momentum buffer: three shard-sized tensors.

Printed: the worst rank's peak RSS and the median seconds per step (5 steps
after 2 warm-up steps). Goals at C = 10⁷, D = 128, fp32, 2 ranks: ≤ 6 GiB per
rank, ≤ 1 s per step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.nn import functional as F

    from pksampler.train.modeling.sharded_head import ShardedMarginHead
    from pksampler.train.runtime.distributed import HorovodBackend
    from pksampler.train.solver.sparse_rows import SparseRowSGD

    torch.set_num_threads(1)
    backend = HorovodBackend("cpu", "fp32")
    spec = dict(name="arcface", scale=30.0, margin=0.3, negatives=8192)
    head = ShardedMarginHead(args.classes, 128, backend, **spec, seed=0)
    if args.mode == "sparse":
        rows = SparseRowSGD(head, momentum=0.9, weight_decay=5e-4)
        update = rows.step
    else:  # Partial FC v2: a dense parameter, a dense gradient, a dense momentum buffer
        shard = torch.nn.Parameter(head.rows)
        optimizer = torch.optim.SGD([shard], lr=0.1, momentum=0.9, weight_decay=5e-4)

        def update(lr: float) -> None:
            chosen, sampled = head.pending
            shard.grad = torch.zeros_like(shard)  # the dense gradient Partial FC v2 keeps
            shard.grad.index_add_(0, chosen, sampled.grad)
            optimizer.step()
            head.step += 1

    local = 256 // backend.size
    generator = torch.Generator().manual_seed(backend.rank)
    times = []
    for step in range(args.steps + 2):
        mine = F.normalize(torch.randn(local, 128, generator=generator), dim=1).requires_grad_(True)
        labels = torch.randint(0, args.classes, (local,), generator=generator)
        started = time.perf_counter()
        everything = backend.allgather(mine)
        all_labels = backend.allgather(labels)
        loss = head(everything, all_labels)
        loss.backward()
        update(0.1)
        if step >= 2:
            times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"peak_rss": peak, "seconds": statistics.median(times),
                                  "rows_bytes": head.memory_bytes()}), flush=True)


def run_case(mode: str, classes: int, args: argparse.Namespace) -> dict[str, float] | None:
    horovodrun = Path(sys.executable).with_name("horovodrun")
    command = [str(horovodrun), "-np", str(args.np), "-H", f"localhost:{args.np}", sys.executable, __file__,
               "--worker", "--mode", mode, "--classes", str(classes), "--steps", str(args.steps)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": "10"}
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    ranks = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines() if "RESULT " in line]
    if done.returncode != 0 or len(ranks) != args.np:
        print(f"{mode:6s} C = {classes:>10,}: did not finish (exit {done.returncode}; out of memory?)", flush=True)
        return None
    result = {key: max(r[key] for r in ranks) for key in ("peak_rss", "seconds", "rows_bytes")}
    print(f"{mode:6s} C = {classes:>10,}: peak RSS per rank {result['peak_rss'] / 2**30:6.2f} GiB "
          f"(rows {result['rows_bytes'] / 2**30:.2f} GiB), {result['seconds']:.3f} s per step", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--classes", type=int, default=10_000_000)
    parser.add_argument("--dense-classes", type=int, nargs="*", default=[1_000_000, 4_000_000])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mode", choices=("sparse", "dense"), default="sparse", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    for classes in args.dense_classes:
        run_case("sparse", classes, args)
        run_case("dense", classes, args)
    result = run_case("sparse", args.classes, args)
    if result is not None:
        print(f"C = {args.classes:,}: {result['peak_rss'] / 2**30:.2f} GiB per rank (goal <= 6), "
              f"{result['seconds']:.3f} s per step (goal <= 1)")


if __name__ == "__main__":
    main()

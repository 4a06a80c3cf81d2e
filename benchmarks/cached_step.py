"""Gradient-cached steps: peak memory and time of a 4,096-image global step against plain steps.

Run: .venv/bin/python benchmarks/cached_step.py [--np 2] [--steps 3] [--image-size 48] [--chunk 128]

Three cases, each in its own ``horovodrun -np N`` job (so each rank's peak RSS
is the case's own), on the demo network (group norm) and multi-similarity
loss, with the global batch's embeddings all-gathered as in the trainer:

* ``plain 256``: the plain step on a 256-image global step (the reference memory);
* ``plain 4096``: the plain step on a 4,096-image global step (the reference time);
* ``cached 4096``: the same 4,096 images, ``train.chunk_size`` images per forward pass.

Reported per case: the worst rank's peak RSS and the median seconds per step
(after one warm-up step). Targets: cached 4096 peak RSS <= 1.25 x plain 256 + 0.5 GiB;
cached 4096 time <= 1.5 x plain 4096. Inputs are random tensors already at the
training size: the loader is not what is measured.
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
    """One rank: build the parts, run warm-up + timed steps, print this rank's numbers as JSON."""
    import torch

    from pksampler.train.engine.cached_step import CachedTrainer
    from pksampler.train.engine.trainer import StepParts, Trainer
    from pksampler.train.losses.pair import build_loss
    from pksampler.train.modeling.model import EmbeddingNet, norm_factory
    from pksampler.train.runtime.distributed import HorovodBackend

    torch.set_num_threads(1)
    backend = HorovodBackend("cpu", "fp32")
    torch.manual_seed(0)
    model = EmbeddingNet(32, (1, 1, 1, 1), 64, norm_factory("group"))
    loss_fn = build_loss("multi_similarity", {})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = backend.wrap(model, optimizer, fp16_allreduce=False, backward_passes_per_step=1)
    backend.broadcast_state(model, optimizer)
    local = args.global_batch // backend.size
    parts = StepParts(backend=backend, model=model, train_model=model, optimizer=optimizer,
                      scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), loss_fn=loss_fn,
                      sampler=None, train_set=None, epochs=1, global_batch=args.global_batch, gather=backend.size > 1)
    trainer = CachedTrainer(parts, [], chunk_size=args.chunk) if args.chunk else Trainer(parts, [])
    generator = torch.Generator().manual_seed(backend.rank)
    images = torch.randn(local, 3, args.image_size, args.image_size, generator=generator)
    labels = torch.arange(backend.rank * local, (backend.rank + 1) * local) // 4
    times = []
    for step in range(args.steps + 1):
        started = time.perf_counter()
        trainer.forward_backward(images, labels, reduce=True)
        trainer.optimizer_step()
        if step:
            times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"rank": backend.rank, "peak_rss": peak, "seconds": statistics.median(times)}),
          flush=True)


def run_case(name: str, global_batch: int, chunk: int | None, args: argparse.Namespace) -> dict[str, float]:
    horovodrun = Path(sys.executable).with_name("horovodrun")
    command = [str(horovodrun), "-np", str(args.np), "-H", f"localhost:{args.np}", sys.executable, __file__,
               "--worker", "--global-batch", str(global_batch), "--steps", str(args.steps),
               "--image-size", str(args.image_size)] + (["--chunk", str(chunk)] if chunk else [])
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": "10"}
    output = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, check=True).stdout
    ranks = [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if "RESULT " in line]
    result = {"peak_rss": max(r["peak_rss"] for r in ranks), "seconds": max(r["seconds"] for r in ranks)}
    print(f"{name:12s} global batch {global_batch:5d}  peak RSS per rank {result['peak_rss'] / 2**30:6.2f} GiB  "
          f"{result['seconds']:7.2f} s/step", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=48)
    parser.add_argument("--chunk", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=4096)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    chunk = args.chunk or 128
    small = run_case("plain", 256, None, args)
    cached = run_case("cached", args.global_batch, chunk, args)
    plain = run_case("plain", args.global_batch, None, args)
    memory_goal = 1.25 * small["peak_rss"] + 0.5 * 2**30
    print(f"cached {args.global_batch} peak RSS: {cached['peak_rss'] / 2**30:.2f} GiB against the goal "
          f"1.25 x {small['peak_rss'] / 2**30:.2f} + 0.5 = {memory_goal / 2**30:.2f} GiB "
          f"({'met' if cached['peak_rss'] <= memory_goal else 'missed'}); plain {args.global_batch}: "
          f"{plain['peak_rss'] / 2**30:.2f} GiB")
    ratio = cached["seconds"] / plain["seconds"]
    print(f"cached / plain time per {args.global_batch}-image step: {ratio:.2f}x "
          f"({'met' if ratio <= 1.5 else 'missed'}, goal <= 1.5x)")


if __name__ == "__main__":
    main()

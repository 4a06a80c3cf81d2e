"""One epoch's plan for one rank, against numpy's permutation(N) and torch's DistributedSampler.

Run: .venv/bin/python benchmarks/sampler_speed.py [--sizes 1e6:1e5 1e7:1e6]

Long-tail (Zipf-like) labels, W=16 ranks, P=32 classes x K=4 samples. Each
measurement runs in a fresh process so that peak-memory numbers do not leak
into each other. Reported as ratios against the references measured in the
same run:

* plan time / permutation(N) time        (target <= 0.5 at N=1e7)
* sampler peak memory, label grouping included (building the sampler from
  the labels, then one epoch's plan for this rank) / DistributedSampler's
  peak                                    (target <= 0.25)
* one-off label grouping time / np.unique(labels, return_inverse=True) on
  the same labels                          (target < 1)
* stream rate: indices per second when iterating this rank's sampler (target >= 5e6)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import measure  # noqa: E402

WORLD, P, K, RANK = 16, 32, 4, 0
TRIPLETS = 42  # about P*K/3 images per rank batch


def long_tail_labels(num_samples: int, num_classes: int, seed: int = 0) -> np.ndarray:
    """Zipf-like class sizes (exponent 0.8); every class non-empty."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_classes + 1) ** 0.8
    extra = rng.choice(num_classes, num_samples - num_classes, p=weights / weights.sum())
    return rng.permutation(np.concatenate([np.arange(num_classes), extra]))


def child(case: str, num_samples: int, num_classes: int) -> dict:
    """Measure one case in this (fresh) process."""
    if case == "permutation":
        rng = np.random.default_rng(0)
        seconds, peak = measure(lambda: rng.permutation(num_samples))
        return {"seconds": seconds, "peak_bytes": peak}
    if case == "distributed_sampler":
        import torch.utils.data as tud

        sampler = tud.distributed.DistributedSampler(range(num_samples), num_replicas=WORLD, rank=RANK, seed=0)
        seconds, peak = measure(lambda: list(iter(sampler)))
        return {"seconds": seconds, "peak_bytes": peak}
    from pksampler.samplers import DistributedBalancedSampler, epoch_layout, group_labels, rank_batches

    labels = long_tail_labels(num_samples, num_classes)
    if case == "balanced_plan":
        index = group_labels(labels)
        epochs = iter(range(100))

        def plan() -> np.ndarray:
            layout = epoch_layout(index, WORLD * P, K, seed=0, epoch=next(epochs))
            return rank_batches(layout, index, P, K, RANK)

        seconds, peak = measure(plan)
        # the time reference in the same process, interleaved, so a busy machine slows both alike
        rng = np.random.default_rng(0)
        plan_best = perm_best = float("inf")
        for _ in range(5):
            perm_best = min(perm_best, measure(lambda: rng.permutation(num_samples), repeats=1)[0])
            plan_best = min(plan_best, measure(plan, repeats=1)[0])
        return {"seconds": min(seconds, plan_best), "peak_bytes": peak, "indices": int(plan().size),
                "permutation_seconds": perm_best}
    if case == "balanced_stream":
        sampler = DistributedBalancedSampler(labels, P, K, num_replicas=WORLD, rank=RANK, seed=0)
        epochs = iter(range(100))

        def stream() -> int:
            sampler.set_epoch(next(epochs))
            count = 0
            for _ in sampler:
                count += 1
            return count

        seconds, _ = measure(stream)
        return {"seconds": seconds, "indices": len(sampler)}
    if case == "triplet_plan":
        from pksampler.samplers import DistributedTripletBatchSampler

        sampler = DistributedTripletBatchSampler(labels, TRIPLETS, num_replicas=WORLD, rank=RANK, seed=0)
        epochs = iter(range(100))

        def triplet_plan() -> np.ndarray:
            return sampler._rank_steps(next(epochs), 0, sampler.num_batches)

        seconds, peak = measure(triplet_plan)
        return {"seconds": seconds, "peak_bytes": peak, "indices": sampler.num_batches * sampler.batch_size}
    if case == "neighbour_refresh":
        from pksampler.train.losses.mining import class_neighbours

        rng = np.random.default_rng(0)
        classes = num_classes // 10  # 1e5 classes at the 1e6-class size
        embeddings = rng.normal(size=(2 * classes, 128)).astype(np.float32)
        codes = np.repeat(np.arange(classes), 2)
        seconds, peak = measure(lambda: class_neighbours(embeddings, codes, classes, 10), repeats=1)
        return {"seconds": seconds, "peak_bytes": peak, "classes": classes}
    if case == "balanced_init":
        seconds, peak = measure(lambda: group_labels(labels), repeats=3)
        return {"seconds": seconds, "peak_bytes": peak}
    if case == "np_unique":
        seconds, peak = measure(lambda: np.unique(labels, return_inverse=True), repeats=3)
        return {"seconds": seconds, "peak_bytes": peak}
    if case in ("sampler_total", "sampler_total_array"):

        def build_and_iterate() -> int:
            sampler = DistributedBalancedSampler(labels, P, K, num_replicas=WORLD, rank=RANK, seed=0)
            if case == "sampler_total_array":  # the whole epoch's rank plan as one array
                return sampler._rank_steps(0, 0, sampler.num_batches).size
            return sum(1 for _ in sampler)  # as a DataLoader uses it: streamed in blocks

        seconds, peak = measure(build_and_iterate, repeats=1)
        return {"seconds": seconds, "peak_bytes": peak}
    raise ValueError(case)


def run_case(case: str, num_samples: int, num_classes: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", case, str(num_samples), str(num_classes)],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["1e6:1e5", "1e7:1e6"], help="N:C pairs")
    parser.add_argument("--neighbours", action="store_true", help="time the neighbour-table refresh at every size")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        case, n, c = args.child
        print(json.dumps(child(case, int(n), int(c))))
        return
    mib = 2**20
    for pair in args.sizes:
        n, c = (int(float(x)) for x in pair.split(":"))
        cases = ("permutation", "distributed_sampler", "balanced_init", "np_unique", "balanced_plan",
                 "sampler_total", "sampler_total_array", "balanced_stream")
        results = {case: run_case(case, n, c) for case in cases}
        perm, dist, init, unique, plan, total, total_array, stream = (results[k] for k in cases)
        rate = stream["indices"] / stream["seconds"]
        print(f"N={n:.0e} C={c:.0e} W={WORLD} P={P} K={K} (rank {RANK}: {plan['indices']} indices)")
        print(f"  numpy permutation(N)        {perm['seconds']:8.3f} s  {perm['peak_bytes'] / mib:8.1f} MiB")
        print(f"  torch DistributedSampler    {dist['seconds']:8.3f} s  {dist['peak_bytes'] / mib:8.1f} MiB")
        print(f"  pksampler plan (this rank)  {plan['seconds']:8.3f} s  {plan['peak_bytes'] / mib:8.1f} MiB")
        print(f"  pksampler one-off grouping  {init['seconds']:8.3f} s  {init['peak_bytes'] / mib:8.1f} MiB")
        print(f"  np.unique(return_inverse)   {unique['seconds']:8.3f} s  {unique['peak_bytes'] / mib:8.1f} MiB")
        print(f"  sampler: grouping + epoch   {total['seconds']:8.3f} s  {total['peak_bytes'] / mib:8.1f} MiB  (iterated)")
        print(f"  sampler: grouping + array   {total_array['seconds']:8.3f} s  {total_array['peak_bytes'] / mib:8.1f} MiB"
              "  (whole rank plan at once)")
        print(f"  plan time / permutation     {plan['seconds'] / plan['permutation_seconds']:8.3f}   (target <= 0.5; "
              f"permutation {plan['permutation_seconds']:.3f} s in the same process, interleaved)")
        print(f"  plan memory / DistSampler   {plan['peak_bytes'] / max(dist['peak_bytes'], 1):8.3f}")
        print(f"  sampler memory (grouping included) / DistSampler "
              f"{total['peak_bytes'] / max(dist['peak_bytes'], 1):8.3f}   (target <= 0.25; whole-plan array: "
              f"{total_array['peak_bytes'] / max(dist['peak_bytes'], 1):.3f})")
        print(f"  grouping time / np.unique   {init['seconds'] / unique['seconds']:8.3f}   (target < 1)")
        print(f"  stream rate                 {rate / 1e6:8.2f} M indices/s (target >= 5)")
        triplet = run_case("triplet_plan", n, c)
        print(f"  triplet plan (this rank, T={TRIPLETS}) {triplet['seconds']:8.3f} s  {triplet['peak_bytes'] / mib:8.1f} MiB"
              f"  ({triplet['seconds'] / perm['seconds']:.3f} x permutation)")
        if c >= 10**6 or args.neighbours:
            refresh = run_case("neighbour_refresh", n, c)
            print(f"  hard-negative table refresh, {refresh['classes']:.0e} classes x 128-d: {refresh['seconds']:.2f} s")


if __name__ == "__main__":
    main()

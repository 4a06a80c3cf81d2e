"""Shard visits, GETs and plan time of the shard-local plan against the default plan, in the same run.

Run: .venv/bin/python benchmarks/shard_locality.py [--samples 10000000] [--world 256]

Simulation: N labels with long-tailed class sizes (Zipf-like, exponent 0.8,
C = N / 10), stored class by class and cut into shards the way the packer
cuts them (a class goes whole into one shard; shards hold about) 
``--shard-images`` images per shard (the packer's default 512 MB at
``--image-kb`` 100 KB per image gives 5,120). G = W * P classes per step,
K samples per class.

Measured, for both plans on the same labels and epoch:

* visits: a lane (one class slot of a rank) reads one shard until it moves to
  another; for the default plan every change of shard between consecutive
  steps of a lane is a new visit (one GET per K-chunk, nearly always), for
  the shard-local plan a visit is a (lane, shard) pair (one ranged GET of the
  lane's adjacent classes in the shard; a lane holds at most two open where a
  shuffle window crosses a shard boundary);
* distinct visits per rank per 1,000 steps (rank 0, steps 0..999), K-chunks
  per visit, GETs per rank and cluster-wide per epoch;
* plan time per 1,000 steps: the epoch layout (once per epoch, scaled to
  1,000 steps) plus one rank's 1,000 steps of indices;
* visits if a reader keeps at most one shuffle window of a lane: distinct
  (lane, shard, window) triples per epoch, cluster-wide;
* batch-mates (pksampler.samplers._mates, one epoch of ``--mates-samples``,
  G = 64, so that S is about 18,000 steps, near the 13,000 of 10^8 at
  G = 2048) and distinct positive pairs over 10 epochs (``--small``
  samples), as ratios shard-local / default (guards >= 0.9).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampler_speed import long_tail_labels  # noqa: E402

from pksampler.samplers import DistributedBalancedBatchSampler, group_labels  # noqa: E402
from pksampler.samplers._mates import mate_fraction, well_represented  # noqa: E402
from pksampler.samplers.pk_plan import epoch_layout, rank_batches, step_classes  # noqa: E402
from pksampler.samplers.shard_plan import DEFAULT_WINDOW, class_shards, shard_layout  # noqa: E402


def stored_labels(num_samples: int, num_classes: int, shard_images: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels sorted by class (the packer's order) and the shard of every sample, every class whole in one shard."""
    labels = np.sort(long_tail_labels(num_samples, num_classes))
    sizes = np.bincount(labels, minlength=num_classes)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    shard_of_class = starts // shard_images  # a class goes whole into the shard where it starts
    return labels, np.repeat(shard_of_class, sizes).astype(np.uint32)


def lane_visits(lane_shard: np.ndarray, local: bool) -> int:
    """Visits of ``(steps, lanes)`` shard ids: distinct (lane, shard) pairs, or shard changes along each lane."""
    if local:
        lanes = np.broadcast_to(np.arange(lane_shard.shape[1]), lane_shard.shape)
        return int(np.unique(lanes.astype(np.int64) * (int(lane_shard.max()) + 1) + lane_shard).size)
    return int(lane_shard.shape[1] + (np.diff(lane_shard, axis=0) != 0).sum())


def _by_window(lane_shard: np.ndarray, window: int) -> np.ndarray:
    """Shard ids made distinct per shuffle window (a reader that keeps no bytes past a window)."""
    windows = (np.arange(lane_shard.shape[0]) // window)[:, None]
    return lane_shard.astype(np.int64) * (lane_shard.shape[0] // window + 1) + windows


def locality(labels: np.ndarray, shards: np.ndarray, args: argparse.Namespace) -> dict:
    """Visits, GETs and plan time of both plans at the full scale."""
    index = group_labels(labels)
    per_class = class_shards(index, shards)
    per_step, results = args.world * args.per_rank, {}
    for name in ("default", "shard"):
        began = time.perf_counter()
        if name == "default":
            layout = epoch_layout(index, per_step, args.k, seed=0, epoch=1)
        else:
            layout = shard_layout(index, per_step, args.k, per_class, seed=0, epoch=1, window=args.window)
        layout_seconds = time.perf_counter() - began
        began = time.perf_counter()
        rank_batches(layout, index, args.per_rank, args.k, 0, stop_step=1000)
        rank_seconds = time.perf_counter() - began
        lane_shard = per_class[step_classes(layout)]  # (S, G): the shard each lane reads at each step
        steps = layout.num_steps
        rank0 = lane_shard[:1000, :args.per_rank]
        visits = lane_visits(lane_shard, name == "shard")
        results[name] = {
            "steps": steps,
            "visits_rank_1000": lane_visits(rank0, name == "shard"),
            "chunks_per_visit": lane_shard.size / visits,
            "gets_rank_epoch": visits / args.world,
            "gets_cluster_epoch": visits,
            "plan_s_per_1000": layout_seconds * 1000 / steps + rank_seconds,
            "shards_touched_rank": int(np.unique(lane_shard[:, :args.per_rank]).size),
            "gets_cluster_epoch_window": lane_visits(_by_window(lane_shard, args.window), name == "shard"),
        }
    return results


def _sampler(labels: np.ndarray, shards: np.ndarray, name: str, args: argparse.Namespace):
    extra = {"locality": "shard", "shard_ids": shards, "window": args.window} if name == "shard" else {}
    return DistributedBalancedBatchSampler(labels, samples_per_class=args.k, classes_per_step=64,
                                           num_replicas=1, rank=0, seed=0, **extra)


def mates_ratio(args: argparse.Namespace) -> float:
    """Batch-mate fraction shard-local / default, one epoch of ``--mates-samples`` (G = 64, S about 18,000)."""
    labels, shards = stored_labels(args.mates_samples, args.mates_samples // 10, args.shard_images)
    means = []
    for name in ("default", "shard"):
        steps = step_classes(_sampler(labels, shards, name, args).layout())
        means.append(mate_fraction(steps, well_represented(steps, limit=400)).mean())
    return float(means[1] / means[0])


def pairs_ratio(args: argparse.Namespace) -> float:
    """Distinct within-class pairs over 10 epochs, shard-local / default, on ``--small`` samples."""
    labels, shards = stored_labels(args.small, args.small // 10, args.shard_images)
    first, second = np.triu_indices(args.k, 1)
    counts = []
    for name in ("default", "shard"):
        sampler, seen = _sampler(labels, shards, name, args), []
        for epoch in range(10):
            sampler.set_epoch(epoch)
            chunks = np.array(list(sampler)).reshape(-1, args.k)
            low = np.minimum(chunks[:, first], chunks[:, second]).astype(np.int64)
            high = np.maximum(chunks[:, first], chunks[:, second])
            keep = low != high
            seen.append(low[keep] * labels.size + high[keep])
        counts.append(np.unique(np.concatenate(seen)).size)
    return counts[1] / counts[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--world", type=int, default=256)
    parser.add_argument("--per-rank", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--shard-images", type=int, default=5_120)
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--mates-samples", type=int, default=4_000_000)
    parser.add_argument("--small", type=int, default=400_000)
    args = parser.parse_args()
    labels, shards = stored_labels(args.samples, args.samples // 10, args.shard_images)
    print(f"N={args.samples:,} C={args.samples // 10:,} shards={int(shards.max()) + 1:,} W={args.world} "
          f"P={args.per_rank} K={args.k} window={args.window}")
    results = locality(labels, shards, args)
    for name, row in results.items():
        print(f"{name:8s} " + " ".join(f"{key}={value:,.3f}" if isinstance(value, float) else f"{key}={value:,}"
                                        for key, value in row.items()))
    default, local = results["default"], results["shard"]
    print(f"fewer distinct visits per rank per 1,000 steps: {default['visits_rank_1000'] / local['visits_rank_1000']:.1f}x"
          " (target >= 20x)")
    print(f"K-chunks per visit: {local['chunks_per_visit']:.1f} (target >= 32)")
    mates, pairs = mates_ratio(args), pairs_ratio(args)
    print(f"batch-mates shard/default: {mates:.3f}; distinct positive pairs over 10 epochs shard/default: {pairs:.3f}"
          " (targets >= 0.9)")


if __name__ == "__main__":
    main()

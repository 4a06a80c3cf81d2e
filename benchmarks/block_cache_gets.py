"""GETs per epoch from an object store: the shard-local plan with a node's block cache against the default plan.

Run: .venv/bin/python benchmarks/block_cache_gets.py [--samples 10000000] [--world 256] [--cache-gb 16 64]

Simulation at scale (no server: the plan's real sample indices, the
reader's real request rules). N labels with long-tailed class sizes, stored
class by class in shards of ``--shard-images`` images of ``--image-kb`` KB
(as benchmarks/shard_locality.py). W ranks, ``--ranks-per-node`` on a node,
P classes per rank, K images per class. One node's ranks (0..7) are walked
through a whole epoch; the node's GETs times W / ranks-per-node is the
cluster's. Readers:

* ``coalesced``: today's reader without a cache (``block_cache: null``):
  each rank's batch is read with one GET per run of samples of one shard
  less than 1 MiB apart (datasets/objectstore.py).
* ``block cache``: the node's ranks share one LRU cache of ``--block-mib``
  blocks (datasets/blockcache.py) with a byte limit of ``--cache-gb``; a
  GET per block miss (adjacent misses of one batch are merged into one GET by
  the real reader, so this is an upper bound).

Reported per plan and reader: GETs per node per epoch, GETs cluster-wide
per epoch, GETs per rank per 1,000 steps, and read amplification (bytes
fetched / bytes the batches need).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shard_locality import stored_labels  # noqa: E402

from pksampler.samplers import group_labels  # noqa: E402
from pksampler.samplers.pk_plan import epoch_layout, rank_batches  # noqa: E402
from pksampler.samplers.shard_plan import DEFAULT_WINDOW, class_shards, shard_layout  # noqa: E402

GAP = 1 << 20  # the reader's coalescing gap (datasets/objectstore.py)


def node_batches(labels: np.ndarray, shards: np.ndarray, plan: str, args: argparse.Namespace) -> np.ndarray:
    """Sample indices of the node's ranks for one epoch: shape (steps, ranks, P * K)."""
    index = group_labels(labels)
    per_step = args.world * args.per_rank
    if plan == "default":
        layout = epoch_layout(index, per_step, args.k, seed=0, epoch=1)
    else:
        layout = shard_layout(index, per_step, args.k, class_shards(index, shards), seed=0, epoch=1,
                              window=args.window)
    ranks = [rank_batches(layout, index, args.per_rank, args.k, r) for r in range(args.ranks_per_node)]
    return np.stack([r.reshape(r.shape[0], -1) for r in ranks], axis=1)


def coalesced_gets(offsets: np.ndarray, shard: np.ndarray, image_bytes: int) -> tuple[int, int]:
    """(GETs, bytes) of one rank's batch read with per-batch coalescing (runs of one shard within GAP)."""
    order = np.lexsort((offsets, shard))
    offsets, shard = offsets[order], shard[order]
    new_run = np.ones(offsets.size, dtype=bool)
    new_run[1:] = (shard[1:] != shard[:-1]) | (offsets[1:] > offsets[:-1] + image_bytes + GAP)
    starts = np.flatnonzero(new_run)
    ends = np.append(starts[1:], offsets.size) - 1
    return int(starts.size), int((offsets[ends] + image_bytes - offsets[starts]).sum())


def simulate(batches: np.ndarray, shards: np.ndarray, shard_start: np.ndarray, args: argparse.Namespace,
             cache_bytes: int | None) -> dict:
    """GETs and bytes of the node's ranks over the epoch, with the coalescing reader or a shared block cache."""
    image_bytes = args.image_kb * 1000
    block = args.block_mib << 20
    capacity = None if cache_bytes is None else max(2, cache_bytes // block)
    cache: OrderedDict[int, None] = OrderedDict()
    gets = fetched = 0
    blocks_per_shard = (args.shard_images * image_bytes) // block + 2
    for step in batches:
        for rank_batch in step:
            shard = shards[rank_batch].astype(np.int64)
            offsets = (rank_batch - shard_start[shard]) * image_bytes
            if capacity is None:
                g, b = coalesced_gets(offsets, shard, image_bytes)
                gets, fetched = gets + g, fetched + b
                continue
            first, last = offsets // block, (offsets + image_bytes - 1) // block
            keys = np.unique(np.concatenate([shard * blocks_per_shard + first, shard * blocks_per_shard + last]))
            for key in keys.tolist():
                if key in cache:
                    cache.move_to_end(key)
                    continue
                gets += 1
                fetched += block
                cache[key] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    needed = batches.size * image_bytes
    steps = batches.shape[0]
    nodes = args.world / args.ranks_per_node
    return {"gets_node_epoch": gets, "gets_cluster_epoch": gets * nodes,
            "gets_rank_1000_steps": gets / args.ranks_per_node * 1000 / steps, "amplification": fetched / needed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--world", type=int, default=256)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--per-rank", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--shard-images", type=int, default=5_120)
    parser.add_argument("--image-kb", type=int, default=100)
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--block-mib", type=int, default=16)
    parser.add_argument("--cache-gb", type=float, nargs="+", default=[16.0, 64.0])
    args = parser.parse_args()
    labels, shards = stored_labels(args.samples, args.samples // 10, args.shard_images)
    shard_start = np.searchsorted(shards, np.arange(int(shards.max()) + 1))
    print(f"N={args.samples:,} shards={int(shards.max()) + 1:,} W={args.world} ranks/node={args.ranks_per_node} "
          f"P={args.per_rank} K={args.k} window={args.window} image={args.image_kb} KB block={args.block_mib} MiB")
    print(f"{'plan':8s} {'reader':22s} {'GETs/node/epoch':>16s} {'GETs/cluster/epoch':>19s} "
          f"{'GETs/rank/1000 steps':>21s} {'read amplification':>19s}")
    for plan in ("default", "shard"):
        began = time.perf_counter()
        batches = node_batches(labels, shards, plan, args)
        if plan == "shard":  # every lane of the node keeps one window of K-chunks (at most the epoch's S steps)
            working_set = (args.ranks_per_node * args.per_rank * min(args.window, batches.shape[0]) * args.k
                           * args.image_kb * 1000)
            print(f"  S={batches.shape[0]:,} steps; the node's working set, lanes x min(window, S) x K x image: "
                  f"{working_set / 1e9:.1f} GB")
        for cache_gb in [None, *args.cache_gb]:
            row = simulate(batches, shards, shard_start, args, None if cache_gb is None else int(cache_gb * 1e9))
            reader = "coalesced" if cache_gb is None else f"block cache {cache_gb:g} GB"
            print(f"{plan:8s} {reader:22s} {row['gets_node_epoch']:16,d} {row['gets_cluster_epoch']:19,.0f} "
                  f"{row['gets_rank_1000_steps']:21,.1f} {row['amplification']:19.2f}", flush=True)
        print(f"  ({plan}: {time.perf_counter() - began:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()

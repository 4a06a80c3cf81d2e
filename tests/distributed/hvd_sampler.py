"""Two real Horovod ranks build DistributedBalancedSampler with detected rank/size.

Checks on every rank, with allgather: the ranks' batches are P x K, disjoint
per step, equal in number and together equal to the single-process plan; the
consistency check passes; a seed that differs on one rank makes the check
raise on every rank (no hang). The triplet sampler's batches pass the shared
triplet invariants and its neighbour table, mined on rank 0, reaches every
rank through pksampler.comm.
"""

from __future__ import annotations

import sys
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import torch

from pksampler.comm import broadcast_object
from pksampler.samplers import (
    DistributedBalancedBatchSampler,
    DistributedTripletBatchSampler,
    PlanOptions,
    SamplerMismatchError,
    balanced_plan,
    check_consistent,
    group_labels,
    world_info,
)
from pksampler.train.losses.mining import mine_class_neighbours

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared invariant checkers
from sampler_invariants import (  # noqa: E402
    check_disjoint_across_ranks,
    check_rank_batches,
    check_triplet_ranks,
    check_triplets,
    check_world_invariance,
)


def check_triplets_on_real_ranks(labels: np.ndarray, rank: int) -> None:
    """Triplet invariants across ranks, and a neighbour table mined on rank 0 reaching every rank.

    Only rank 0's embeddings count (the others pass noise), so equal tables
    on every rank prove the broadcast through pksampler.comm.
    """
    sampler = DistributedTripletBatchSampler(labels, 5, seed=3, negatives="hard", hard_classes=2)
    centres = np.random.default_rng(0).normal(size=(97, 8))
    noise = np.random.default_rng(100 + rank).normal(size=(labels.size, 8))
    embeddings = centres[labels] if rank == 0 else noise
    table = mine_class_neighbours(embeddings, labels, sampler.index, sampler.hard_classes) if rank == 0 else None
    table = sampler.set_class_neighbours(broadcast_object(table, 0, name="pksampler.class_neighbours"))
    tables = hvd.allgather(torch.from_numpy(table)[None]).numpy()
    assert (tables == tables[0]).all(), "ranks hold different neighbour tables"
    sampler.set_epoch(1)
    check_consistent(sampler)
    mine = torch.tensor(np.array(list(sampler)), dtype=torch.int64).reshape(-1, 5, 3)
    everyone = [rows.numpy() for rows in hvd.allgather(mine[None])]
    for plan in everyone:
        check_triplets(plan, labels)
    check_triplet_ranks(everyone)


def check_shard_local_on_real_ranks(size: int) -> None:
    """locality="shard" on real ranks: the gathered batches are the single-process global steps."""
    labels = np.repeat(np.arange(97), 31)  # stored class by class
    shards = labels // 6
    kwargs = {"samples_per_class": 3, "seed": 5, "locality": "shard", "shard_ids": shards, "window": 8}
    sampler = DistributedBalancedBatchSampler(labels, classes_per_step=2 * size + 1, **kwargs)
    sampler.set_epoch(1)
    check_consistent(sampler)
    mine = torch.tensor(np.array(list(sampler)), dtype=torch.int64)
    widths = hvd.allgather_object(mine.shape[1])
    padded = torch.nn.functional.pad(mine, (0, max(widths) - mine.shape[1]), value=-1)
    everyone = [rows.numpy()[:, :width] for rows, width in zip(hvd.allgather(padded[None]), widths)]
    single = DistributedBalancedBatchSampler(labels, classes_per_step=2 * size + 1, num_replicas=1, rank=0, **kwargs)
    single.set_epoch(1)
    np.testing.assert_array_equal(np.concatenate(everyone, axis=1), np.array(list(single)))
    check_disjoint_across_ranks(everyone, labels)


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert world_info() == (rank, size), (world_info(), rank, size)
    labels = (np.arange(3000) * 7919) % 97
    sampler = DistributedBalancedBatchSampler(labels, 4, 3, seed=11)  # rank/size detected
    assert (sampler.rank, sampler.num_replicas) == (rank, size)
    sampler.set_epoch(2)
    check_consistent(sampler)
    mine = torch.tensor(np.array(list(sampler)), dtype=torch.int64)
    everyone = [rows.numpy() for rows in hvd.allgather(mine[None])]  # W arrays (steps, P*K)
    single = balanced_plan(group_labels(labels), 4 * size, 3, 1, 0, PlanOptions(seed=11, epoch=2))
    for batches in everyone:
        check_rank_batches(batches, labels, 4, 3)
    check_disjoint_across_ranks(everyone, labels)
    check_world_invariance(everyone, single)
    check_triplets_on_real_ranks(labels, rank)
    check_shard_local_on_real_ranks(size)

    bad = DistributedBalancedBatchSampler(labels, 4, 3, seed=11 + rank)
    try:
        check_consistent(bad)
    except SamplerMismatchError as error:
        assert "seed differs" in str(error), error
        print(f"MISMATCH-RAISED rank {rank}: {error}", flush=True)
    else:
        print(f"MISMATCH-MISSED rank {rank}", flush=True)
        sys.exit(1)
    print(f"SAMPLER-OK rank {rank}", flush=True)


if __name__ == "__main__":
    main()

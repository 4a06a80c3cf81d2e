"""Two real Horovod ranks build DistributedBalancedSampler with detected rank/size.

Checks on every rank, with allgather: the ranks' batches are P x K, disjoint
per step, equal in number and together equal to the single-process plan; the
consistency check passes; a seed that differs on one rank makes the check
raise on every rank (no hang).
"""

from __future__ import annotations

import sys

import horovod.torch as hvd
import numpy as np
import torch

from pksampler.samplers import (
    DistributedBalancedBatchSampler,
    SamplerMismatchError,
    balanced_plan,
    check_consistent,
    group_labels,
    world_info,
)


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
    everyone = hvd.allgather(mine[None])  # (W, steps, P*K)
    merged = torch.cat(list(everyone), dim=1).numpy()
    single = balanced_plan(group_labels(labels), 4 * size, 3, 1, 0, seed=11, epoch=2)
    assert np.array_equal(np.sort(merged, axis=1), np.sort(single, axis=1)), "not world-size invariant"
    for row in labels[merged]:
        chunks = row.reshape(-1, 3)
        assert (chunks == chunks[:, :1]).all() and np.unique(chunks[:, 0]).size == chunks.shape[0]

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

"""What the framework scripts share: the data of the runs, the reference plan and the invariant checks.

The scripts (run by real launchers) only record each rank's batches as JSON;
the tests compare them here with the plan computed in one process, rank by
rank. 2,000 samples of 50 classes, G = 8 classes per global step, K = 4:
62 steps an epoch, P = 4 classes per rank batch at W = 2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

N, CLASSES, G, K, SEED, WORLD = 2000, 50, 8, 4, 7, 2
LABELS = np.arange(N) % CLASSES
STEPS = 62


class IndexDataset(Dataset):
    """Sample i is ``(i, label_i)``: the batch tells which indices the loader asked for."""

    labels = LABELS

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(index), torch.tensor(int(LABELS[index]))


def write_record(out: Path, name: str, record: dict[str, Any]) -> None:
    """One rank's record, written atomically (a reader never sees half a file)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(record))
    tmp.replace(out / f"{name}.json")


def reference_plan(epoch: int, *, rank: int, world: int = WORLD) -> list[list[int]]:
    """The batches rank ``rank`` of ``world`` must see in ``epoch`` (the sampler run in this process)."""
    from pksampler.samplers import DistributedBalancedBatchSampler

    sampler = DistributedBalancedBatchSampler(LABELS, samples_per_class=K, classes_per_step=G, num_replicas=world,
                                              rank=rank, seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def check_step(batches: list[list[int]]) -> None:
    """One global step, one batch per rank: each P x K, no class on two ranks."""
    seen: set[int] = set()
    for batch in batches:
        classes, counts = np.unique(LABELS[np.asarray(batch)], return_counts=True)
        assert len(batch) == (G // WORLD) * K and classes.size == G // WORLD and (counts == K).all(), batch
        assert not seen & set(classes.tolist()), f"a class on two ranks in one step: {batches}"
        seen |= set(classes.tolist())


def check_epoch(per_rank: list[list[list[int]]], epoch: int, *, start: int = 0) -> None:
    """Equal steps on every rank, each step P x K and class-disjoint, exactly the plan from ``start`` on."""
    assert [len(b) for b in per_rank] == [STEPS - start] * WORLD, [len(b) for b in per_rank]
    for step in zip(*per_rank):
        check_step(list(step))
    for rank, batches in enumerate(per_rank):
        assert batches == reference_plan(epoch, rank=rank)[start:], f"rank {rank} epoch {epoch} differs from the plan"

"""Label sources: integers beyond int64 stay exact classes; labels=None next to valid targets uses the targets."""

from __future__ import annotations

import numpy as np
import pytest

from pksampler.samplers import DistributedBalancedBatchSampler


@pytest.mark.parametrize("labels", [
    [2**63, 2**63, -1, -1],
    [2**64 + 5, 2**64 + 5, 3, 3],
    np.array([2**63, 2**63, 1, 1], dtype=np.uint64),
    np.array([2**64 - 1, 2**64 - 1, 0, 0], dtype=np.uint64),
])
def test_integer_labels_beyond_int64_are_two_exact_classes(labels):
    sampler = DistributedBalancedBatchSampler(labels, 2, 2, num_replicas=1, rank=0)
    (batch,) = list(sampler)
    assert sorted(batch) == [0, 1, 2, 3] and sampler.index.num_classes == 2


def test_uint64_labels_beyond_int64_in_a_dense_range_are_grouped_exactly():
    low = 2**63 + 5  # a narrow range: grouped through the lookup table, not np.unique
    labels = np.array([low + 2, low, low + 1, low, low + 2, low + 1], dtype=np.uint64)
    sampler = DistributedBalancedBatchSampler(labels, 3, 2, num_replicas=1, rank=0)
    (batch,) = list(sampler)
    assert sorted(batch) == list(range(6))
    assert sampler.index.classes.tolist() == [low, low + 1, low + 2]
    codes, known = sampler.index.codes_of(labels)
    assert codes.tolist() == [2, 0, 1, 0, 2, 1] and known.all()


class TorchvisionStyle:
    labels = None
    targets = [0, 0, 1, 1, 2, 2]

    def __len__(self) -> int:
        return 6


def test_a_dataset_with_labels_none_and_valid_targets_uses_the_targets():
    sampler = DistributedBalancedBatchSampler(TorchvisionStyle(), 3, 2, num_replicas=1, rank=0)
    assert sampler.index.num_classes == 3 and sorted(next(iter(sampler))) == [0, 1, 2, 3, 4, 5]

"""The training loader: uint8 from the workers, persistent workers that follow the epoch, keyed device augmentation."""

from __future__ import annotations

import numpy as np
import torch

from pksampler.datasets import BatchAugment, ImageLoadError, LabelledSubset, SyntheticProducts, ToUint8
from pksampler.samplers import DistributedBalancedBatchSampler
from pksampler.train.runtime.device import DeviceSetup
from pksampler.train.runtime.loader import TrainLoader

CPU = DeviceSetup(torch.device("cpu"), "fp32")
BAD = 7  # the sample whose image cannot be decoded


class _OneBadImage(SyntheticProducts):
    """Synthetic products where sample ``BAD`` fails to decode (replaced by another member of its class)."""

    def load(self, index: int):
        if index == BAD:
            raise ImageLoadError(f"cannot decode image sample {index}: test")
        return super().load(index)


def _subset(size: int = 16) -> LabelledSubset:
    dataset = _OneBadImage(6, 8, image_size=20, augment_seed=5)
    indices = np.arange(len(dataset))[::-1].copy()  # keys differ from subset positions
    return LabelledSubset(dataset, indices, transform=ToUint8(size))


def _sampler(subset: LabelledSubset, world: int = 1, rank: int = 0) -> DistributedBalancedBatchSampler:
    return DistributedBalancedBatchSampler(subset.labels, 4 // world, 2, num_replicas=world, rank=rank, seed=1)


def test_workers_ship_uint8_batches_with_labels_and_dataset_indices():
    subset = _subset()
    sampler = _sampler(subset)
    loader = TrainLoader(subset, sampler, BatchAugment(12, seed=5), workers=1, setup=CPU)
    try:
        raw = list(loader.loader)
        assert len(raw) == len(list(sampler)) > 1
        for (images, labels, keys), batch in zip(raw, sampler):
            assert images.dtype == torch.uint8 and tuple(images.shape) == (8, 3, 16, 16)
            assert torch.equal(keys, torch.as_tensor(subset.indices[batch]))
            assert torch.equal(labels, torch.as_tensor(subset.labels[batch]))
        inputs, labels = next(iter(loader.epoch(0)))
        assert inputs.dtype == torch.float32 and tuple(inputs.shape) == (8, 3, 12, 12)
    finally:
        loader.close()


def _epoch_batches(loader: TrainLoader, sampler, subset, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sampler.set_epoch(epoch)
    subset.set_epoch(epoch)
    return list(loader.epoch(epoch))


def test_workers_persist_across_epochs_and_follow_the_epoch():
    subset = _subset()
    sampler = _sampler(subset)
    augment = BatchAugment(12, seed=5)
    persistent = TrainLoader(subset, sampler, augment, workers=2, setup=CPU)
    reference_subset = _subset()
    reference_sampler = _sampler(reference_subset)
    in_process = TrainLoader(reference_subset, reference_sampler, augment, workers=0, setup=CPU)
    try:
        pids = None
        for epoch in range(3):
            got = _epoch_batches(persistent, sampler, subset, epoch)
            if pids is None:
                pids = persistent.worker_pids()
                assert len(pids) == 2
            assert persistent.worker_pids() == pids  # the same processes every epoch
            expected = _epoch_batches(in_process, reference_sampler, reference_subset, epoch)
            assert len(got) == len(expected)
            for (a, la), (b, lb) in zip(got, expected):
                assert torch.equal(la, lb) and torch.equal(a, b)
        assert subset.bad_image_counts()[0] >= 1  # the bad image was met and replaced in a worker
    finally:
        persistent.close()
        in_process.close()


def test_bad_image_replacement_in_a_persistent_worker_is_keyed_by_the_current_epoch():
    dataset = _OneBadImage(2, 24, image_size=20)
    subset = LabelledSubset(dataset, np.arange(len(dataset)), transform=ToUint8(20))
    replacements = []
    for epoch in range(3):
        subset.set_epoch(epoch)
        replacements.append(subset[BAD][0])
    assert not torch.equal(replacements[0], replacements[1])  # the replacement is drawn anew each epoch
    batches = [[BAD, 0]]
    loader = TrainLoader(subset, batches, lambda images, keys, epoch: images.float(), workers=1, setup=CPU)
    try:
        for epoch in range(3):
            subset.set_epoch(epoch)
            images, _ = next(iter(loader.epoch(epoch)))
            assert torch.equal(images[0], replacements[epoch].float()), epoch
    finally:
        loader.close()


def test_two_ranks_see_the_augmented_global_batch_of_one_process():
    subset = _subset()
    augment = BatchAugment(12, seed=5)
    single_sampler = _sampler(subset)
    single = TrainLoader(subset, single_sampler, augment, workers=0, setup=CPU)
    ranks = [(_sampler(subset, 2, r)) for r in range(2)]
    loaders = [TrainLoader(subset, s, augment, workers=0, setup=CPU) for s in ranks]
    for epoch in (0, 1):
        whole = _epoch_batches(single, single_sampler, subset, epoch)
        parts = [_epoch_batches(loader, s, subset, epoch) for loader, s in zip(loaders, ranks)]
        for step, (images, labels) in enumerate(whole):
            assert torch.equal(torch.cat([parts[0][step][0], parts[1][step][0]]), images)
            assert torch.equal(torch.cat([parts[0][step][1], parts[1][step][1]]), labels)

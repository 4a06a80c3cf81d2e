"""The training loader: built once, persistent workers that only decode, augmentation on the rank's device.

1. Workers run the dataset's transform (:class:`~pksampler.datasets.ToUint8`:
   draft-mode decode, one resize) and ship uint8 ``(N, 3, S, S)`` batches with
   each sample's label and dataset index.
2. The workers persist across epochs. The epoch reaches them with every index
   (:class:`EpochBatches` yields ``(epoch, index)`` pairs), since bad-image
   replacement inside a worker is keyed by (seed, epoch, index); a worker's copy
   of the dataset would otherwise keep the epoch it started with.
3. On the main process the batch moves to the device (pinned memory,
   ``non_blocking`` on CUDA) and :class:`~pksampler.datasets.BatchAugment` turns
   it into normalised float32, keyed by (seed, epoch, dataset index), so the
   batch is the same on any worker count, rank split or batch order.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from pksampler.datasets.base import LabelledDataset
from pksampler.train.runtime.device import DeviceSetup

__all__ = ["EpochBatches", "KeyedSamples", "TrainLoader", "collate_channels_last", "to_model_input"]


def worker_context(dataset: LabelledDataset, workers: int) -> str | None:
    """How ``workers`` DataLoader workers over ``dataset`` start: its :attr:`~LabelledDataset.worker_start_method`
    (``"spawn"`` over an object store, whose client cannot run in a fork), or the default (None) without workers."""
    return dataset.worker_start_method if workers > 0 else None


class KeyedSamples(Dataset):
    """``dataset[(epoch, i)]`` -> ``(image, label, key)``: the key is sample i's index in the parent dataset.

    For a :class:`~pksampler.datasets.LabelledSubset` the key is the parent's
    index (``indices[i]``), the same key the subset's own augmentation used, so
    a sample keeps its augmentation whichever subset reaches it. The epoch is
    written to the dataset (of this process) before loading, which keys its
    bad-image replacement; the shared bad-image counters are left alone.
    """

    def __init__(self, dataset: LabelledDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def key(self, index: int) -> int:
        """The augmentation key of sample ``index``."""
        return self.dataset.augmentation_key(int(index) % len(self.dataset))

    def __getitems__(self, items: list[tuple[int, int]]) -> list[tuple[Any, int, int]]:
        """A batch: the dataset reads its bytes ahead when it can (one request per run of a shard), then each item."""
        self.dataset.prefetch([index for _, index in items])
        return [self[item] for item in items]

    def __getitem__(self, item: tuple[int, int]) -> tuple[Any, int, int]:
        epoch, index = item
        if self.dataset.epoch != epoch:
            self.dataset.epoch = epoch
        image, label = self.dataset[index]
        return image, label, self.key(index)


class EpochBatches:
    """A batch sampler's batches with the epoch attached to every index: ``[(epoch, index), ...]``.

    ``epoch`` is set by the owner before each pass; the batches themselves come
    from ``batch_sampler`` (its own epoch and resume position apply).
    """

    def __init__(self, batch_sampler: Iterable[Iterable[int]]) -> None:
        self.batch_sampler = batch_sampler
        self.epoch = 0

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.epoch
        for batch in self.batch_sampler:
            yield [(epoch, int(index)) for index in batch]

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]


def collate_channels_last(samples: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
    """``default_collate`` of ``(image, label, key)`` with the images stacked pixel-major.

    ``ToUint8`` images are (3, S, S) views of (S, S, 3) pixel memory; stacking
    that memory is a plain copy into the worker's shared-memory batch, where
    stacking the views would transpose every image. The batch is
    ``(N, 3, S, S)`` in the channels-last layout (what the model uses on GPUs).
    """
    images, labels, keys = default_collate([(image.permute(1, 2, 0), label, key) for image, label, key in samples])
    return [images.permute(0, 3, 1, 2), labels, keys]


def to_model_input(images: torch.Tensor, setup: DeviceSetup, transform: Callable[[torch.Tensor], torch.Tensor]
                   ) -> torch.Tensor:
    """A uint8 batch moved to the rank's device, through ``transform``, in the model's memory format."""
    images = images.to(setup.device, non_blocking=True)
    return transform(images).contiguous(memory_format=setup.memory_format)


class TrainLoader:
    """The training DataLoader, built once; ``epoch(e)`` yields ``(inputs on the device, labels)``.

    Args:
        dataset: a labelled dataset whose transform ships uint8 images (``ToUint8``).
        batch_sampler: the rank's batch sampler (``set_epoch`` is the caller's, as before).
        augment: ``augment(images, keys, epoch)`` on the device, e.g. ``BatchAugment``.
        workers: DataLoader worker processes (0: load in this process); they persist across epochs.
        setup: the rank's device (pinned memory and ``non_blocking`` copies on CUDA).
        prefetch_factor: batches each worker loads ahead (None: torch's default).

    Call :meth:`close` when done, to stop the workers.
    """

    def __init__(self, dataset: LabelledDataset, batch_sampler: Any, augment: Callable[..., torch.Tensor], *, workers: int,
                 setup: DeviceSetup, prefetch_factor: int | None = None) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"TrainLoader(workers=) must be an int >= 0, got {workers!r}")
        self.augment, self.setup = augment, setup
        self.batches = EpochBatches(batch_sampler)
        self.loader = DataLoader(KeyedSamples(dataset), batch_sampler=self.batches, num_workers=workers,
                                 collate_fn=collate_channels_last, pin_memory=setup.pin_memory,
                                 persistent_workers=workers > 0, prefetch_factor=prefetch_factor,
                                 multiprocessing_context=worker_context(dataset, workers))

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of the sampler's current pass, augmented with the keys of ``epoch``."""
        self.batches.epoch = int(epoch)
        for images, labels, keys in self.loader:
            yield to_model_input(images, self.setup, lambda batch: self.augment(batch, keys, epoch)), labels

    def worker_pids(self) -> list[int]:
        """Process ids of the running workers (empty before the first epoch or with ``workers=0``)."""
        iterator = getattr(self.loader, "_iterator", None)
        return [worker.pid for worker in getattr(iterator, "_workers", [])]

    def close(self) -> None:
        """Stop the persistent workers (torch offers no public call; dropping the iterator does it)."""
        iterator = getattr(self.loader, "_iterator", None)
        self.loader._iterator = None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

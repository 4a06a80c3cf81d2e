"""What every pksampler dataset shares: labels without decoding, per-sample augmentation keys."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import warnings

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from ._image import load_rgb, verify_image
from .transforms import apply_transform, sample_rng

__all__ = ["ImageFileDataset", "LabelledDataset", "LabelledSubset"]


class LabelledDataset(Dataset):
    """A map-style dataset with an int64 ``labels`` array and epoch-keyed augmentation.

    Subclasses implement ``load(index)`` (the untransformed sample, e.g. a PIL
    image). ``__getitem__`` returns ``(transform(sample, rng), label)`` where
    ``rng`` is keyed by ``(seed, epoch, index)``.

    Call :meth:`set_epoch` each epoch, as for the sampler; with
    ``persistent_workers=True`` the workers keep the epoch they started with.
    """

    labels: np.ndarray
    classes: list[str]

    def __init__(self, transform: Callable | None = None, *, seed: int = 0) -> None:
        self.transform = transform
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def load(self, index: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[Any, int]:
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"{type(self).__name__} index {index} out of range for {len(self)} samples")
        index %= len(self)
        sample = self.load(index)
        rng = sample_rng(self.seed, self.epoch, index)
        return apply_transform(self.transform, sample, rng), int(self.labels[index])

    @property
    def num_classes(self) -> int:
        return len(self.classes)


class ImageFileDataset(LabelledDataset):
    """A labelled dataset of image files: ``paths[i]`` decoded by Pillow is sample i."""

    paths: list[str]

    def load(self, index: int) -> Image.Image:
        return load_rgb(self.paths[index])

    def _drop_unreadable(self, where: str) -> None:
        """Decode every file and leave out those that fail, with a warning counting them."""
        good = np.fromiter((verify_image(p) for p in self.paths), dtype=bool, count=len(self.paths))
        if not good.all():
            warnings.warn(f"{type(self).__name__}: skipped {int((~good).sum())} unreadable image file(s) {where}",
                          stacklevel=3)
            self.paths = [p for p, ok in zip(self.paths, good) if ok]
            self.labels = self.labels[good]


class LabelledSubset(LabelledDataset):
    """Rows ``indices`` of a labelled dataset, with its labels and augmentation keys.

    The augmentation key stays the parent's sample index, so a sample is
    augmented identically whether it is reached through a subset or not.
    """

    def __init__(self, dataset: LabelledDataset, indices: Sequence[int] | np.ndarray,
                 transform: Callable | None = None) -> None:
        super().__init__(transform if transform is not None else dataset.transform, seed=dataset.seed)
        self.dataset = dataset
        self.indices = np.asarray(indices, dtype=np.int64)
        if self.indices.size and (self.indices.min() < 0 or self.indices.max() >= len(dataset)):
            raise IndexError(f"LabelledSubset(indices=) must lie in [0, {len(dataset)}), got range "
                             f"[{self.indices.min()}, {self.indices.max()}]")
        self.labels = dataset.labels[self.indices]
        self.classes = dataset.classes

    def load(self, index: int) -> Any:
        return self.dataset.load(int(self.indices[index]))

    def __getitem__(self, index: int) -> tuple[Any, int]:
        index = int(index) % len(self)
        parent = int(self.indices[index])
        sample = self.dataset.load(parent)
        rng = sample_rng(self.seed, self.epoch, parent)
        return apply_transform(self.transform, sample, rng), int(self.labels[index])

"""What every pksampler dataset shares: labels without decoding, per-sample augmentation keys, bad-image policy."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, get_worker_info

from ._image import MAX_IMAGE_PIXELS, ImageLoadError, load_rgb, verify_image
from .transforms import apply_transform, sample_rng

__all__ = ["BAD_IMAGE_POLICIES", "ImageFileDataset", "LabelledDataset", "LabelledSubset"]

#: ``on_bad="replace"``: a sample whose image fails to decode is replaced by another
#: sample of the same class; ``"raise"``: the ImageLoadError propagates (crashes the rank).
BAD_IMAGE_POLICIES = ("replace", "raise")

# One row of counters per DataLoader worker (row 0: the main process), so no two
# processes ever write the same memory and the counts need no lock.
_COUNTER_ROWS = 257
# How many other members of the class are tried before giving up on a replacement.
_REPLACEMENT_TRIES = 8
_REPLACEMENT_KEY = 0xBAD1


def _new_counters() -> torch.Tensor:
    """(rows, 2) int64 counters in shared memory: column 0 bad images, column 1 samples loaded."""
    return torch.zeros(_COUNTER_ROWS, 2, dtype=torch.int64).share_memory_()


def _counter_row() -> int:
    info = get_worker_info()
    return 0 if info is None else 1 + info.id % (_COUNTER_ROWS - 1)


def _check_policy(owner: str, on_bad: str) -> str:
    if on_bad not in BAD_IMAGE_POLICIES:
        raise ValueError(f"{owner}(on_bad=) must be one of {BAD_IMAGE_POLICIES}, got {on_bad!r}")
    return on_bad


def check_decoding(owner: str, decode_size: int | None, max_pixels: int) -> tuple[int | None, int]:
    """Validate the ``decode_size=`` and ``max_pixels=`` arguments every image dataset takes."""
    if decode_size is not None and (isinstance(decode_size, bool) or not isinstance(decode_size, int)
                                    or decode_size < 1):
        raise ValueError(f"{owner}(decode_size=) must be a positive int or None, got {decode_size!r}")
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise ValueError(f"{owner}(max_pixels=) must be a positive int, got {max_pixels!r}")
    return decode_size, max_pixels


class LabelledDataset(Dataset):
    """A map-style dataset with an int64 ``labels`` array, epoch-keyed augmentation and a bad-image policy.

    Subclasses implement ``load(index)`` (the untransformed sample, e.g. a PIL
    image) and may override ``describe(index)`` (how logs name a sample).
    ``__getitem__`` returns ``(transform(sample, rng), label)`` where ``rng`` is
    keyed by ``(seed, epoch, index)``.

    Bad images (``on_bad="replace"``, the default): when ``load(index)`` raises
    :class:`ImageLoadError`, another member of the same class is loaded instead,
    drawn by a generator keyed by ``(seed, epoch, index)``, so P×K batches keep
    their shape and every rank/worker makes the same choice. The bad sample is
    named once per process on stderr (path and reason). Counts of bad and total
    samples loaded this epoch, summed over DataLoader workers through shared
    memory, are returned by :meth:`bad_image_counts`; :meth:`set_epoch` resets
    them. ``on_bad="raise"`` lets the error propagate instead.

    Call :meth:`set_epoch` each epoch, as for the sampler; with
    ``persistent_workers=True`` the workers keep the epoch they started with.

    Capabilities some datasets have and the trainer uses, declared here with
    defaults that do nothing, so callers call them instead of probing for them:
    :attr:`store` (the object store read from), :meth:`prefetch` (read a
    batch's bytes ahead), :attr:`shard_ids` (for ``locality="shard"``),
    :meth:`verify` and :attr:`verifiable` (digests recorded at packing),
    :attr:`worker_start_method` (how DataLoader workers must start),
    :meth:`augmentation_key`, :meth:`sources` (the datasets of a union) and :meth:`files` (the image files read). :class:`~pksampler.datasets.ShardedDataset`
    overrides them; :class:`LabelledSubset` forwards them to its parent.
    """

    labels: np.ndarray
    classes: list[str]
    #: the object store samples are read from (an :class:`~pksampler.datasets.objectstore.ObjectStore`); None
    #: for local data
    store: Any = None
    #: whether :meth:`verify` checks anything (digests recorded when the data was packed)
    verifiable: bool = False
    #: the shard of every sample, for ``locality="shard"`` samplers; None for data not stored in shards (a class
    #: attribute, not a property: a subclass may assign ``self.shard_ids`` as datasets did before this default)
    shard_ids: np.ndarray | None = None

    def __init__(self, transform: Callable | None = None, *, seed: int = 0, on_bad: str = "replace") -> None:
        self.transform = transform
        self.seed = seed
        self.epoch = 0
        self.on_bad = _check_policy(type(self).__name__, on_bad)
        self._counters = _new_counters()
        self._reported: set[int] = set()
        self._labels_sorted: bool | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the augmentation and replacement keys of ``epoch`` and reset the bad-image counts."""
        self.epoch = int(epoch)
        self._counters.zero_()

    def bad_image_counts(self) -> tuple[int, int]:
        """``(bad, total)``: samples replaced because their image failed, and samples loaded, since the last set_epoch.

        Summed over the main process and every DataLoader worker (shared memory).
        """
        bad, total = self._counters.sum(dim=0).tolist()
        return int(bad), int(total)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def load(self, index: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self, index: int) -> str:
        """How messages name sample ``index`` (subclasses give a path)."""
        return f"{type(self).__name__}[{index}]"

    def _check_index(self, index: int) -> int:
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"{type(self).__name__} index {index} out of range for {len(self)} samples")
        return index % len(self)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        index = self._check_index(index)
        sample = self._load_or_replace(index, seed=self.seed, epoch=self.epoch, on_bad=self.on_bad,
                                       counters=self._counters)
        return apply_transform(self.transform, sample, self._rng(index)), int(self.labels[index])

    def _rng(self, key: int) -> np.random.Generator | None:
        """The generator keyed by (seed, epoch, key), made only for a transform that draws from it."""
        if not getattr(self.transform, "takes_rng", False):
            return None  # building it costs about a tenth of a JPEG decode in a DataLoader worker
        return sample_rng(self.seed, self.epoch, key)

    def _load_or_replace(self, index: int, *, seed: int, epoch: int, on_bad: str, counters: torch.Tensor,
                         members: Callable[[int], np.ndarray] | None = None) -> Any:
        """``load(index)``, or under ``on_bad="replace"`` the image of another member of its class (``members``:
        a class's candidate indices, by default all of them; a subset passes its own)."""
        row = _counter_row()
        counters[row, 1] += 1
        try:
            return self.load(index)
        except ImageLoadError as error:
            if on_bad == "raise":
                raise
            counters[row, 0] += 1
            self._report(index, error)
            first_error = error
        rng = np.random.default_rng([seed, epoch, index, _REPLACEMENT_KEY])
        members = (members or self._class_members)(int(self.labels[index]))
        candidates = members[members != index]
        if candidates.size > _REPLACEMENT_TRIES:
            candidates = rng.choice(candidates, size=_REPLACEMENT_TRIES, replace=False)
        else:
            candidates = rng.permutation(candidates)
        for candidate in candidates.tolist():
            try:
                return self.load(candidate)
            except ImageLoadError as error:
                self._report(candidate, error)
        raise ImageLoadError(f"{self.describe(index)}: bad image and no loadable replacement among "
                             f"{candidates.size} other member(s) of class {int(self.labels[index])}: "
                             f"{first_error}") from None

    def _report(self, index: int, error: Exception) -> None:
        """One line on stderr per bad sample and process."""
        if index in self._reported:
            return
        self._reported.add(index)
        print(f"pksampler: bad image {self.describe(index)} replaced by another sample of its class: {error}",
              file=sys.stderr, flush=True)

    def _class_members(self, label: int) -> np.ndarray:
        """Indices of class ``label``: a binary search when labels are grouped by class (folders, shards)."""
        labels = self.labels
        if self._labels_sorted is None:
            self._labels_sorted = bool(labels.size < 2 or np.all(labels[1:] >= labels[:-1]))
        if self._labels_sorted:
            start, stop = np.searchsorted(labels, [label, label + 1])
            return np.arange(start, stop, dtype=np.int64)
        return np.flatnonzero(labels == label)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def prefetch(self, indices: Sequence[int]) -> None:
        """Read the bytes of ``indices`` ahead (a batch, before its samples are loaded); local data: nothing to do."""

    def verify(self, *, index: bool = True, shards: bool = True) -> None:
        """Check the data against the digests recorded when it was packed; nothing to check here (see
        :attr:`verifiable`). Raises ValueError naming the first damaged file where there is something to check."""

    def sources(self) -> list[tuple[str, int, int]]:
        """``(name, images, classes)`` of each named dataset this one joins (:class:`~pksampler.datasets.UnionDataset`);
        empty for a single dataset."""
        return []

    def files(self) -> list[str] | None:
        """The real paths of the image files read (folders resolved, links among them followed), so that a union
        can tell when two of its datasets hold one image; None where the samples are not files of their own
        (packed shards, synthetic images)."""
        return None

    def item_names(self) -> list[str] | None:
        """Each sample's name within its class, stable while the set grows (a file's name in its class folder),
        for :func:`~.split.image_holdout`; None where samples have none (packed shards, synthetic images): their
        position in the class names them."""
        return None

    @property
    def worker_start_method(self) -> str | None:
        """How DataLoader workers over this dataset must start: ``"spawn"`` for an object store (its client cannot
        run in a forked child), else None (the platform's default, a fork on Linux)."""
        return "spawn" if self.store is not None else None

    def augmentation_key(self, index: int) -> int:
        """The key that draws sample ``index``'s augmentation and bad-image replacement: the index itself here, the
        parent's index in a :class:`LabelledSubset` (a sample is augmented alike whichever subset reaches it)."""
        return int(index)


class ImageFileDataset(LabelledDataset):
    """A labelled dataset of image files: ``paths[i]`` decoded by Pillow is sample i.

    ``decode_size`` (set by subclasses' constructors) is passed to
    :func:`load_rgb` as ``draft_size``: JPEGs much larger than the training
    size are DCT-downscaled while decoding. ``max_pixels`` is the bomb limit.
    """

    paths: list[str]
    decode_size: int | None = None
    max_pixels: int = MAX_IMAGE_PIXELS

    def load(self, index: int) -> Image.Image:
        return load_rgb(self.paths[index], draft_size=self.decode_size, max_pixels=self.max_pixels)

    def describe(self, index: int) -> str:
        return self.paths[index]

    def item_names(self) -> list[str]:
        """Each file's name (the class is the folder, or the list file's label)."""
        return [os.path.basename(path) for path in self.paths]

    def files(self) -> list[str]:
        """``paths`` with each folder's real path (one ``realpath`` per folder, not per file)."""
        real: dict[str, str] = {}
        out = []
        for path in self.paths:
            folder, name = os.path.split(path)
            if folder not in real:
                real[folder] = os.path.realpath(folder)
            out.append(os.path.join(real[folder], name))
        return out

    def _set_decoding(self, decode_size: int | None, max_pixels: int) -> None:
        self.decode_size, self.max_pixels = check_decoding(type(self).__name__, decode_size, max_pixels)

    def _drop_unreadable(self, where: str) -> None:
        """Decode every file and leave out those that fail, with a warning counting them."""
        good = np.fromiter((verify_image(p, max_pixels=self.max_pixels) for p in self.paths), dtype=bool,
                           count=len(self.paths))
        if not good.all():
            warnings.warn(f"{type(self).__name__}: skipped {int((~good).sum())} unreadable image file(s) {where}",
                          stacklevel=3)
            self.paths = [p for p, ok in zip(self.paths, good) if ok]
            self.labels = self.labels[good]
            self._labels_sorted = None


class LabelledSubset(LabelledDataset):
    """Rows ``indices`` of a labelled dataset, with its labels, augmentation keys and bad-image policy.

    The augmentation key stays the parent's sample index, so a sample is
    augmented identically whether it is reached through a subset or not; a bad
    image is replaced by another member of its class in the subset, chosen by
    the same key. Indices follow the parent's rule: ``-len <= index < len``,
    anything else is an IndexError. Bad-image counts are the subset's own.
    """

    def __init__(self, dataset: LabelledDataset, indices: Sequence[int] | np.ndarray,
                 transform: Callable | None = None, *, on_bad: str | None = None) -> None:
        super().__init__(transform if transform is not None else dataset.transform, seed=dataset.seed,
                         on_bad=on_bad if on_bad is not None else dataset.on_bad)
        self.dataset = dataset
        self.indices = np.asarray(indices, dtype=np.int64)
        if self.indices.size and (self.indices.min() < 0 or self.indices.max() >= len(dataset)):
            raise IndexError(f"LabelledSubset(indices=) must lie in [0, {len(dataset)}), got range "
                             f"[{self.indices.min()}, {self.indices.max()}]")
        self.labels = dataset.labels[self.indices]
        self.classes = dataset.classes

    def load(self, index: int) -> Any:
        return self.dataset.load(int(self.indices[index]))

    def prefetch(self, indices: Sequence[int]) -> None:
        """Let the parent read a batch's bytes ahead (an object store coalesces them into few requests)."""
        self.dataset.prefetch(self.indices[np.asarray(indices, dtype=np.int64) % len(self)].tolist())

    @property
    def store(self) -> Any:
        """The parent's object store (None for local data)."""
        return self.dataset.store

    @property
    def verifiable(self) -> bool:
        return self.dataset.verifiable

    def verify(self, *, index: bool = True, shards: bool = True) -> None:
        """The parent's check (it covers the subset's samples and the others)."""
        self.dataset.verify(index=index, shards=shards)

    @property
    def shard_ids(self) -> np.ndarray | None:
        """The parent's shard ids of the subset's samples, or None."""
        parent = self.dataset.shard_ids
        return None if parent is None else parent[self.indices]

    def augmentation_key(self, index: int) -> int:
        return int(self.indices[index])

    def _parent_members(self, label: int) -> np.ndarray:
        """The parent's indices of this subset's members of class ``label``: a bad image's replacement stays in
        the subset (a class's training images never borrow its held-out ones, ``data.heldout_images``)."""
        return self.indices[self._class_members(label)]

    def describe(self, index: int) -> str:
        return self.dataset.describe(int(self.indices[index]))

    def __getitem__(self, index: int) -> tuple[Any, int]:
        index = self._check_index(index)
        parent = int(self.indices[index])
        sample = self.dataset._load_or_replace(parent, seed=self.seed, epoch=self.epoch, on_bad=self.on_bad,
                                               counters=self._counters, members=self._parent_members)
        return apply_transform(self.transform, sample, self._rng(parent)), int(self.labels[index])

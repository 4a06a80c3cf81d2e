"""UnionDataset: several labelled datasets trained as one, each class namespaced by its dataset.

Example::

    >>> photos = SyntheticProducts(num_classes=3, images_per_class=2)
    >>> glyphs = SyntheticProducts(num_classes=2, images_per_class=2)
    >>> both = UnionDataset([("photos", photos), ("glyphs", glyphs)])
    >>> both.classes[3], both.labels.tolist()
    ('glyphs/product_00000', [0, 0, 1, 1, 2, 2, 3, 3, 4, 4])

1. Part ``i``'s samples follow part ``i - 1``'s: sample offsets and label
   offsets are cumulative sums, so part ``i``'s class ``c`` is global class
   ``class_offsets[i] + c`` and its name is ``"<dataset>/<class>"``. Two
   datasets never share a class, even when their class names are equal:
   a class is merged across sources by listing its images in one list file.
2. Labels stay grouped by class when every part's are (folders, shards), so
   a bad image's replacement is still a binary search.
3. A sample's augmentation key is its union index, so ranks agree whatever
   part holds it; loads, descriptions, prefetches and shard ids are the
   parts', shifted by the offsets. A bad image follows its part's
   ``on_bad`` ("raise" wins over the caller's "replace").

Corner cases: an empty part, two parts with one name, or two parts that
hold one image file (a folder inside another, a list file naming another's
images) is a ValueError naming them. Shard ids are offered only when every part is stored in shards
(a shard-local plan cannot place the others' samples).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .base import LabelledDataset

__all__ = ["UnionDataset"]


class UnionDataset(LabelledDataset):
    """The concatenation of named labelled datasets with disjoint, ``<name>/<class>`` classes.

    Args:
        parts: ``(name, dataset)`` pairs in order; names are unique and non-empty.
        seed: augmentation seed (default: the first part's).

    Attributes:
        names: the parts' names. parts: the datasets. offsets / class_offsets: where each part's samples and
        classes start (one more entry than parts: the totals).
    """

    def __init__(self, parts: Sequence[tuple[str, LabelledDataset]], *, seed: int | None = None) -> None:
        if not parts:
            raise ValueError("UnionDataset(parts=) needs at least one (name, dataset) pair, got none")
        names = [str(name) for name, _ in parts]
        for position, name in enumerate(names):
            if not name or names.index(name) != position:
                raise ValueError(f"UnionDataset(parts=): part {position} is named {name!r}; names must be unique "
                                 "and non-empty (they namespace the classes)")
            if len(parts[position][1]) == 0:
                raise ValueError(f"UnionDataset(parts=): dataset {name!r} has no images")
        datasets = [dataset for _, dataset in parts]
        _check_disjoint(names, datasets)
        on_bad = "raise" if all(d.on_bad == "raise" for d in datasets) else "replace"
        super().__init__(None, seed=datasets[0].seed if seed is None else seed, on_bad=on_bad)
        self.names, self.parts = names, datasets
        self.offsets = np.cumsum([0] + [len(d) for d in datasets]).astype(np.int64)
        self.class_offsets = np.cumsum([0] + [len(d.classes) for d in datasets]).astype(np.int64)
        self.labels = np.concatenate([np.asarray(d.labels, dtype=np.int64) + self.class_offsets[i]
                                      for i, d in enumerate(datasets)])
        self.classes = [f"{name}/{cls}" for name, d in zip(names, datasets) for cls in d.classes]

    def sources(self) -> list[tuple[str, int, int]]:
        """``(name, images, classes)`` of every part, for the start-up line."""
        return [(name, len(d), len(d.classes)) for name, d in zip(self.names, self.parts)]

    def locate(self, index: int) -> tuple[int, int]:
        """``(part, index inside that part)`` of union sample ``index``."""
        part = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return part, int(index) - int(self.offsets[part])

    def load(self, index: int) -> Any:
        part, inner = self.locate(index)
        return self.parts[part].load(inner)

    def _load_or_replace(self, index: int, *, on_bad: str, **rest: Any) -> Any:
        """A bad image raises when the caller or the part that holds it says ``on_bad="raise"``: each part keeps its
        own policy (the trainer's ``data.args`` reach only the parts of one layout), whatever part comes first."""
        policy = "raise" if "raise" in (on_bad, self.parts[self.locate(index)[0]].on_bad) else on_bad
        return super()._load_or_replace(index, on_bad=policy, **rest)

    def item_names(self) -> list[str] | None:
        """The parts' item names in order; None unless every part names its items."""
        names = [part.item_names() for part in self.parts]
        return None if any(n is None for n in names) else [name for part in names for name in part]

    def describe(self, index: int) -> str:
        part, inner = self.locate(index)
        return f"{self.names[part]}: {self.parts[part].describe(inner)}"

    def prefetch(self, indices: Sequence[int]) -> None:
        """Each part reads its own samples of the batch ahead."""
        indices = np.asarray(indices, dtype=np.int64)
        owner = np.searchsorted(self.offsets, indices, side="right") - 1
        for part in np.unique(owner).tolist():
            self.parts[part].prefetch((indices[owner == part] - self.offsets[part]).tolist())

    @property
    def shard_ids(self) -> np.ndarray | None:
        """Every part's shard ids, numbered apart (part i's after part i - 1's); None unless every part has them."""
        ids = [d.shard_ids for d in self.parts]
        if any(part is None for part in ids):
            return None
        starts = np.cumsum([0] + [int(np.max(part)) + 1 if len(part) else 0 for part in ids[:-1]])
        return np.concatenate([np.asarray(part, dtype=np.int64) + start for part, start in zip(ids, starts)])

    def unsharded(self) -> list[str]:
        """The names of the parts not stored in shards (a shard-local plan cannot take them)."""
        return [name for name, d in zip(self.names, self.parts) if d.shard_ids is None]

    @property
    def store(self) -> Any:
        """The parts' object stores as one (their request counts summed), or None when every part is local."""
        stores = [d.store for d in self.parts if d.store is not None]
        return None if not stores else stores[0] if len(stores) == 1 else _Stores(stores)

    @property
    def verifiable(self) -> bool:
        return any(d.verifiable for d in self.parts)

    def verify(self, *, index: bool = True, shards: bool = True) -> None:
        """Every part's check; the first damaged file is named with its dataset."""
        for name, dataset in zip(self.names, self.parts):
            try:
                dataset.verify(index=index, shards=shards)
            except ValueError as error:
                raise ValueError(f"dataset {name!r}: {error}") from None

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        for dataset in self.parts:
            dataset.set_epoch(epoch)


def _check_disjoint(names: list[str], datasets: list[LabelledDataset]) -> None:
    """Refuse two datasets that hold one image file (a folder inside another, a list file naming another's images):
    it would be a sample of two classes, its own negative. Packed datasets have no files to compare."""
    held: list[tuple[str, set[str]]] = []
    for name, dataset in zip(names, datasets):
        files = dataset.files()
        if files is None:
            continue
        mine = set(files)
        for other, theirs in held:
            shared = mine & theirs
            if shared:
                raise ValueError(f"UnionDataset(parts=): datasets {other!r} and {name!r} share {len(shared)} image "
                                 f"file(s), e.g. {min(shared)}; an image in two datasets would be two classes, each "
                                 "its own negative: list every image in one dataset")
        held.append((name, mine))


class _Stores:
    """Several object stores seen as one by the per-epoch request report: ``counts()`` sums theirs."""

    def __init__(self, stores: Sequence[Any]) -> None:
        self.stores = list(stores)

    def counts(self) -> tuple[int, int]:
        totals = np.sum([store.counts() for store in self.stores], axis=0)
        return int(totals[0]), int(totals[1])

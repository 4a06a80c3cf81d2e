"""Class-disjoint train/test splits (the retrieval protocol of CUB, Cars196, SOP), and held-out images inside classes.

:func:`class_disjoint_split` draws the test classes by a permutation of the
class codes: a dataset that gains classes gets another test set.
:func:`class_disjoint_split_by_name` keys each class's draw by its name, so a
class stays on its side as the label set grows (a model continued on a grown
set is never tested on a class it trained on). :func:`image_holdout` keeps a
few images of every training class out of training, each chosen by a key of
(class name, item name), stable under growth too: a class that gains images
never hands a held-out place to an image a previous run trained on.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

from pksampler.hashing import GOLDEN, mix64

__all__ = ["class_disjoint_split", "class_disjoint_split_by_name", "image_holdout", "name_keys"]


def class_disjoint_split(labels: Any, test_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Split sample indices so that no class is in both parts.

    A fraction ``test_fraction`` of the classes (rounded, at least one and at
    most all but one) is chosen with a generator keyed by ``seed``; their
    samples form the test part.

    Returns:
        ``(train_indices, test_indices)``, sorted int64 arrays.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise ValueError(f"class_disjoint_split(labels=) must be a non-empty 1-D array, got shape {labels.shape}")
    if isinstance(test_fraction, bool) or not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"class_disjoint_split(test_fraction=) must be in (0, 1), got {test_fraction!r}")
    classes, codes = _class_codes(labels)
    if classes.size < 2:
        raise ValueError(f"class_disjoint_split needs at least 2 classes, got {classes.size}")
    num_test = min(max(int(round(classes.size * float(test_fraction))), 1), classes.size - 1)
    chosen = np.random.default_rng([seed, 0x5B117]).permutation(classes.size)[:num_test]
    is_test = np.zeros(classes.size, dtype=bool)
    is_test[chosen] = True
    test_mask = is_test[codes.reshape(-1)]
    return np.flatnonzero(~test_mask), np.flatnonzero(test_mask)


def _class_codes(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(labels, return_inverse=True)``; for the datasets' dense int64 class codes in O(N + C).

    Every pksampler dataset encodes its labels once, as codes 0..C-1; they are
    used as they are here instead of being sorted again (10^8 labels).
    """
    if labels.dtype.kind in "iu" and labels.min() >= 0 and labels.max() < 4 * labels.size + 1024:
        present = np.bincount(labels) > 0
        classes = np.flatnonzero(present)
        position = np.cumsum(present) - 1
        return classes.astype(labels.dtype), position[labels]
    return np.unique(labels, return_inverse=True)


def name_keys(names: Sequence[str], seed: int = 0) -> np.ndarray:
    """A uint64 key per class name, a pure function of (name, seed): the same whatever the other classes are."""
    salt = int(seed).to_bytes(8, "little", signed=True)
    return np.array([int.from_bytes(hashlib.blake2b(str(name).encode(), digest_size=8, salt=salt[:8]).digest(),
                                    "little") for name in names], dtype=np.uint64)


def class_disjoint_split_by_name(labels: Any, names: Sequence[str], test_fraction: float,
                                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`class_disjoint_split`, but a class is a test class when its name's key falls below
    ``test_fraction``: a class keeps its side when classes are added or removed (``data.split_by: name``).

    About ``test_fraction`` of the classes are test classes (a binomial draw, at least one and at most all but
    one: the nearest ones to the threshold move over). ``labels`` are codes into ``names``.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise ValueError(f"class_disjoint_split_by_name(labels=) must be a non-empty 1-D array, got shape "
                         f"{labels.shape}")
    if isinstance(test_fraction, bool) or not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"class_disjoint_split_by_name(test_fraction=) must be in (0, 1), got {test_fraction!r}")
    present = np.flatnonzero(np.bincount(labels, minlength=len(names)) > 0)
    if present.size < 2:
        raise ValueError(f"class_disjoint_split_by_name needs at least 2 classes, got {present.size}")
    unit = (name_keys([names[c] for c in present], seed) >> np.uint64(11)).astype(np.float64) / 2.0**53
    order = np.argsort(unit, kind="stable")
    count = min(max(int(np.count_nonzero(unit < float(test_fraction))), 1), present.size - 1)
    is_test = np.zeros(len(names), dtype=bool)
    is_test[present[order[:count]]] = True
    test_mask = is_test[labels]
    return np.flatnonzero(~test_mask), np.flatnonzero(test_mask)


def image_holdout(labels: Any, names: Sequence[str], per_class: int, seed: int = 0, *,
                  items: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``(kept, held)`` of ``labels``: ``per_class`` images of every class held out (at most all but one).

    The held images of a class are those with the smallest key of (class name, item, seed), the item named by
    ``items`` (a file's name in its class folder: :meth:`~.base.LabelledDataset.item_names`), else by its position
    among the class's items. By name, the held images stay while classes come and go *and* while a class gains
    images: a new image can only take a held-out place, never hand one to an image a previous run trained on (by
    position, one new image sorting first moves every later key). The same at every world size; both arrays sorted.
    """
    labels = np.asarray(labels)
    if isinstance(per_class, bool) or not isinstance(per_class, (int, np.integer)) or per_class < 0:
        raise ValueError(f"image_holdout(per_class=) must be an int >= 0, got {per_class!r}")
    if labels.ndim != 1:
        raise ValueError(f"image_holdout(labels=) must be 1-D, got shape {labels.shape}")
    if items is not None and len(items) != labels.size:
        raise ValueError(f"image_holdout(items=) must name every item: {len(items)} names for {labels.size} labels")
    if per_class == 0 or labels.size == 0:
        return np.arange(labels.size, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.argsort(labels, kind="stable")
    sizes = np.bincount(labels, minlength=len(names))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    within = np.arange(labels.size) - starts[labels[order]]
    present = np.flatnonzero(sizes)
    keys = np.zeros(len(names), dtype=np.uint64)
    keys[present] = name_keys([names[c] for c in present], seed)
    step = (within.astype(np.uint64) if items is None
            else name_keys([items[i] for i in order.tolist()], seed))  # per item, in ``order``
    with np.errstate(over="ignore"):
        key = mix64(keys[labels[order]] + step * GOLDEN)
    ranked = order[np.lexsort((key, labels[order]))]  # by class, then key
    rank = np.arange(labels.size) - starts[labels[ranked]]
    held = rank < np.minimum(per_class, sizes[labels[ranked]] - 1)
    return np.sort(ranked[~held]).astype(np.int64), np.sort(ranked[held]).astype(np.int64)

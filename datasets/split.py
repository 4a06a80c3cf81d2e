"""Class-disjoint train/test splits (the retrieval protocol of CUB, Cars196, SOP)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["class_disjoint_split"]


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

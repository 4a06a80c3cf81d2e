"""How varied batch-mates are: the statistic behind the "as varied as a random deal" guarantee.

For a class with at least ``min_chunks`` chunks in an epoch, its *mate
fraction* is the number of distinct other classes it shares a global step
with, divided by ``chunks * (G - 1)`` (the most it could meet). The reference
is a *random deal*: the same multiset of chunks (the epoch's ``S*G`` class
codes) assigned to the ``S`` steps uniformly at random, G per step, ignoring
the distinct-class rule (a class meeting itself is simply not counted). The
benchmark (benchmarks/batch_mates.py) and the property test use these
functions, so they measure the same thing.

For triplets the same idea applies to the negatives an anchor class meets:
distinct negative classes over the number of its triplets, against the same
negatives dealt to the triplets at random.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mate_fraction", "negative_fraction", "random_deal", "well_represented"]


def well_represented(
    step_classes: np.ndarray, min_chunks: int = 8, *, limit: int | None = None, seed: int = 0
) -> np.ndarray:
    """Class codes with at least ``min_chunks`` chunks in the ``(S, G)`` epoch.

    With ``limit``, at most that many of them, drawn at random (keyed by
    ``seed``) and sorted: the statistic is a mean, and a sample of a few
    hundred classes keeps its cost at O(limit * chunks * G).
    """
    classes = np.flatnonzero(np.bincount(step_classes.reshape(-1)) >= min_chunks)
    if limit is not None and classes.size > limit:
        classes = np.sort(np.random.default_rng(seed).choice(classes, limit, replace=False))
    return classes


def mate_fraction(step_classes: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Per class in ``classes``: distinct other classes met / (chunks * (G - 1)).

    Args:
        step_classes: ``(S, G)`` class code of every chunk, one row per step.
        classes: the class codes to evaluate (each must occur).
    """
    num_steps, per_step = step_classes.shape
    flat = step_classes.reshape(-1)
    num_codes = int(flat.max()) + 1
    chunks = np.bincount(flat, minlength=num_codes)
    at = np.flatnonzero(np.isin(flat, classes))
    owner = flat[at]
    mates = step_classes[at // per_step]
    keys = (owner[:, None].astype(np.int64) * num_codes + mates)[mates != owner[:, None]]
    distinct = np.bincount(np.unique(keys) // num_codes, minlength=num_codes)
    return distinct[classes] / (chunks[classes] * (per_step - 1))


def random_deal(step_classes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The same chunks dealt to the steps uniformly at random (same shape)."""
    return rng.permutation(step_classes.reshape(-1)).reshape(step_classes.shape)


def negative_fraction(anchor_classes: np.ndarray, negative_classes: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Per anchor class in ``classes``: distinct negative classes (other than itself) / its triplets."""
    num_codes = int(max(anchor_classes.max(), negative_classes.max())) + 1
    triplets = np.bincount(anchor_classes, minlength=num_codes)
    keep = np.isin(anchor_classes, classes) & (negative_classes != anchor_classes)
    keys = anchor_classes[keep].astype(np.int64) * num_codes + negative_classes[keep]
    distinct = np.bincount(np.unique(keys) // num_codes, minlength=num_codes)
    return distinct[classes] / triplets[classes]

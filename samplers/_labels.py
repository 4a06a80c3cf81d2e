"""Label encoding and class grouping (CSR), computed once per sampler.

Labels of any hashable kind become dense class codes ``0..C-1``; the samples
are grouped by class as ``members`` (sample indices sorted by class) and
``offsets`` (class ``c`` owns ``members[offsets[c]:offsets[c+1]]``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ClassIndex", "extract_labels", "group_labels"]


def extract_labels(labels: Any, *, owner: str) -> np.ndarray:
    """Return a 1-D numpy array of labels from an array, a sequence or a dataset.

    A dataset is accepted if it exposes ``labels`` or ``targets``; the sampler
    never loads a sample to find its label.
    """
    source = labels
    for attribute in ("labels", "targets"):
        if not isinstance(labels, (np.ndarray, list, tuple)) and hasattr(labels, attribute):
            source = getattr(labels, attribute)
            break
    if hasattr(source, "detach") and hasattr(source, "cpu"):  # a torch tensor
        source = source.detach().cpu().numpy()
    try:
        array = np.asarray(source)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{owner}(labels=) could not be read as an array of labels: {error}") from None
    if array.ndim != 1:
        raise ValueError(
            f"{owner}(labels=) must be 1-D (one label per sample), got an array of shape {array.shape}"
        )
    if array.shape[0] == 0:
        raise ValueError(f"{owner}(labels=) is empty: the dataset has no samples")
    if array.dtype.kind == "f":
        if not np.all(np.isfinite(array)) or not np.all(array == np.round(array)):
            raise ValueError(
                f"{owner}(labels=) has float labels that are not whole numbers; "
                "pass integer or string class labels"
            )
    if array.dtype.kind in "fb":
        array = array.astype(np.int64)
    return array


def _encode(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense codes ``0..C-1`` in sorted label order, and the class values."""
    if array.dtype.kind in "iu":
        low, high = int(array.min()), int(array.max())
        # Dense non-negative integer labels: a lookup table is O(N), no sort.
        if high - low <= 4 * array.shape[0] + 1024:
            present = np.bincount(array - low, minlength=high - low + 1) > 0
            values = np.flatnonzero(present) + low
            lookup = np.cumsum(present) - 1
            codes = lookup[array - low]
            return codes, values
    if array.dtype == object:
        try:
            values, codes = np.unique(array, return_inverse=True)
        except TypeError:  # unorderable mix of hashables: encode by first appearance
            table: dict[Any, int] = {}
            codes = np.fromiter((table.setdefault(v, len(table)) for v in array), np.int64, len(array))
            values = np.empty(len(table), dtype=object)
            values[:] = list(table)
        return codes, values
    values, codes = np.unique(array, return_inverse=True)
    return codes.reshape(-1), values


@dataclass(frozen=True)
class ClassIndex:
    """Samples grouped by class.

    Attributes:
        members: sample indices ordered by class (int32 when N < 2**31).
        offsets: ``C + 1`` boundaries; class ``c`` owns ``members[offsets[c]:offsets[c+1]]``.
        sizes: samples per class, ``np.diff(offsets)``.
        classes: the original label value of each class code.
        fingerprint: a digest of the label sequence, equal across ranks iff the labels are.
    """

    members: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    classes: np.ndarray
    fingerprint: str = field(repr=False)

    @property
    def num_samples(self) -> int:
        return int(self.members.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.sizes.shape[0])

    def codes_of(self, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Class codes of original ``labels`` values, and which of them this index knows.

        Unknown labels get code 0 and ``False`` in the second array.
        """
        classes = self.classes
        try:
            if classes.size < 2 or bool(np.all(classes[:-1] < classes[1:])):
                position = np.minimum(np.searchsorted(classes, labels), classes.size - 1)
                return position, classes[position] == labels
        except TypeError:  # unorderable labels: encoded by first appearance
            pass
        lookup = {value: code for code, value in enumerate(classes.tolist())}
        codes = np.array([lookup.get(value, -1) for value in np.asarray(labels).tolist()], dtype=np.int64)
        return np.maximum(codes, 0), codes >= 0


def group_labels(labels: Any, *, owner: str = "group_labels") -> ClassIndex:
    """Group sample indices by class in O(N) memory (one pass plus a stable sort)."""
    array = extract_labels(labels, owner=owner)
    codes, values = _encode(array)
    n = codes.shape[0]
    index_dtype = np.int32 if n < 2**31 else np.int64
    code_dtype = np.int32 if len(values) < 2**31 else np.int64
    codes = codes.astype(code_dtype, copy=False)
    sizes = np.bincount(codes, minlength=len(values)).astype(np.int64)
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    members = np.argsort(codes, kind="stable").astype(index_dtype, copy=False)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.ascontiguousarray(codes).tobytes())
    digest.update(sizes.tobytes())
    if values.dtype == object or values.dtype.kind in "US":
        digest.update(repr(values.tolist()).encode("utf-8", "backslashreplace"))
    else:
        digest.update(np.ascontiguousarray(values).tobytes())
    return ClassIndex(members, offsets, sizes, values, digest.hexdigest())

"""Label encoding and class grouping (CSR), computed once per sampler.

Labels of any hashable kind become dense class codes ``0..C-1``; the samples
are grouped by class as ``members`` (sample indices sorted by class, stable)
and ``offsets`` (class ``c`` owns ``members[offsets[c]:offsets[c+1]]``).

Integer labels whose range is at most a few times N take a fast path: codes
come from a lookup table (``bincount``, no sort) and the grouping is a
counting sort done in blocks, so the full ``(N,)`` code array never exists
and peak memory stays near the ``members`` array itself. Other labels go
through ``np.unique``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

__all__ = ["ClassIndex", "extract_labels", "group_labels"]

#: float labels must be whole numbers of magnitude below this to be exact int64 classes
_FLOAT_LIMIT = 2.0**63
#: samples per block of the counting sort (bounds its temporaries)
_BLOCK = 1 << 18


def _is_array_like(value: Any) -> bool:
    """Arrays, sequences and tensors that hold labels directly (never a dataset)."""
    if isinstance(value, (np.ndarray, list, tuple, range)):
        return True
    return hasattr(value, "detach") and hasattr(value, "cpu") and hasattr(value, "numpy")


def _top_module(value: Any) -> str:
    return (getattr(type(value), "__module__", "") or "").split(".")[0]


def _arrow_numpy(array: Any, owner: str) -> np.ndarray:
    """A pyarrow ``Array`` or ``ChunkedArray`` as numpy, whole columns at a time; nulls are refused."""
    if array.null_count:
        position = int(np.flatnonzero(np.asarray(array.is_null()))[0])
        raise ValueError(f"{owner}(labels=) has {array.null_count} missing (null) labels, the first at index "
                         f"{position}; every sample needs a class label")
    try:
        return np.asarray(array.to_numpy(zero_copy_only=False))
    except TypeError:  # ChunkedArray.to_numpy of older pyarrow takes no argument
        return np.asarray(array.to_numpy())


def _hf_dataset_column(dataset: Any, name: str, owner: str) -> np.ndarray:
    """Column ``name`` of a Hugging Face ``Dataset``, in the dataset's current row order.

    Read from the Arrow table in one piece, then put in row order with the
    dataset's indices mapping (what ``shuffle``, ``select`` and ``filter``
    leave) as one numpy gather; no row is formatted one by one.
    """
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "data"):
        raise TypeError(
            f"{owner}(labels=) got a streaming {type(dataset).__name__}: the sampler needs one label per sample "
            "of a map-style dataset (load it without streaming=True)"
        )
    values = _arrow_numpy(dataset.data.column(name), owner)
    # ``_indices`` is the mapping datasets itself applies to every read (its formatting reads it row by row);
    # tests/samplers/test_columnar_labels.py compares this read with row-by-row reads after each transform.
    indices = getattr(dataset, "_indices", None)
    if indices is not None:
        values = values[_arrow_numpy(indices.column(0), owner).astype(np.int64)]
    return values


def _columnar(labels: Any, owner: str) -> Any | None:
    """Labels from a columnar source as numpy, or None when ``labels`` is not one.

    Accepted: a Hugging Face ``Column`` (``ds["label"]``), a pyarrow
    ``Array``/``ChunkedArray``, a Hugging Face ``Dataset`` with a ``label`` or
    ``labels`` column, and anything with ``to_numpy()`` or ``__array__``
    (pandas, polars). Each is read whole, never row by row.
    """
    module = _top_module(labels)
    if module == "datasets" and type(labels).__name__ in ("Column", "IterableColumn"):
        source = getattr(labels, "source", None)
        if source is not None and hasattr(source, "column_names"):
            return _hf_dataset_column(source, labels.column_name, owner)
        return np.asarray(labels[:] if hasattr(labels, "__getitem__") else list(labels))
    if module == "pyarrow" and hasattr(labels, "null_count"):
        return _arrow_numpy(labels, owner)
    if module == "datasets" and isinstance(labels, dict):  # DatasetDict / IterableDatasetDict: splits, not columns
        splits = list(labels)
        example = splits[0] if splits else "train"
        raise TypeError(f"{owner}(labels=) got a {type(labels).__name__} of splits {splits}, not one dataset: "
                        f"pass one split, e.g. labels=ds[{example!r}] (or its label column, ds[{example!r}]['label'])")
    if module == "datasets" and hasattr(labels, "column_names"):
        for name in ("label", "labels"):
            if name in labels.column_names:
                return _hf_dataset_column(labels, name, owner)
        raise TypeError(f"{owner}(labels=) got a {type(labels).__name__} with columns {list(labels.column_names)} "
                        "but no 'label' or 'labels' column: pass labels=dataset['<your label column>']")
    if callable(getattr(labels, "to_numpy", None)):
        return labels.to_numpy()
    if hasattr(labels, "__array__"):
        return np.asarray(labels)
    return None


def _source_of(labels: Any, owner: str) -> Any:
    """The label container: ``labels`` itself, a columnar source read whole, or a dataset's ``labels``/``targets``.

    A dataset without either is refused instead of loading every sample to
    read labels from it.
    """
    if _is_array_like(labels):
        return labels
    for attribute in ("labels", "targets"):
        value = getattr(labels, attribute, None)
        if value is not None:  # labels=None next to valid targets: the targets hold the labels
            found = None if _is_array_like(value) else _columnar(value, owner)
            return value if found is None else found
    columnar = _columnar(labels, owner)
    if columnar is not None:
        return columnar
    raise TypeError(
        f"{owner}(labels=) got a {type(labels).__name__} without a .labels or .targets attribute (or both None); "
        "the sampler never loads samples to read their labels: pass labels= as an array or list "
        "with one class label per sample, a Hugging Face dataset column (ds['label']) or a pyarrow array "
        "(or give the dataset a .labels attribute)"
    )


def _is_missing(value: Any) -> bool:
    """None, NaN (the one value unequal to itself) or a value whose comparison has no truth (pandas' ``NA``)."""
    if value is None:
        return True
    try:
        return bool(value != value)
    except TypeError:
        return True


def _check_missing(array: np.ndarray, owner: str) -> None:
    """Refuse None, NaN and pandas' ``NA`` in object labels: they are missing labels, not classes."""
    missing = np.frompyfunc(_is_missing, 1, 1)(array).astype(bool)
    if missing.any():
        position = int(np.flatnonzero(missing)[0])
        raise ValueError(
            f"{owner}(labels=) has a missing label ({array[position]!r}) at index {position}; "
            "every sample needs a class label (no None or NaN)"
        )


def _check_floats(array: np.ndarray, owner: str) -> np.ndarray:
    """Float labels must be exact integers of magnitude below 2**63; returned as int64."""
    finite = np.isfinite(array)
    whole = finite & (array == np.round(array)) & (np.abs(array) < _FLOAT_LIMIT)
    if not whole.all():
        position = int(np.flatnonzero(~whole)[0])
        raise ValueError(
            f"{owner}(labels=) has the float label {float(array[position])!r} at index {position}; float labels must "
            "be finite whole numbers of magnitude below 2**63 (exact integer classes); "
            "pass integer or string class labels"
        )
    return array.astype(np.int64)


def _python_ints(values: Any) -> bool:
    """True when every value is a Python (or numpy) integer, not a bool or a float."""
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values)


def extract_labels(labels: Any, *, owner: str) -> np.ndarray:
    """Return a 1-D numpy array of labels from an array, a sequence, a tensor or a dataset.

    A dataset is accepted if it exposes ``labels`` or ``targets``; the sampler
    never loads a sample to find its label. Missing labels (None, NaN) and
    floats that are not exact integers are refused.
    """
    source = _source_of(labels, owner)
    from pksampler.arrays import as_numpy

    try:
        array = as_numpy(source, name=f"{owner}(labels=)", kinds=None, contiguous=False)
    except OverflowError:  # Python integers beyond 64 bits of either sign: keep them exact
        array = np.array(source, dtype=object)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{owner}(labels=) could not be read as an array of labels: {error}") from None
    if array.dtype.kind == "f" and isinstance(source, (list, tuple)) and _python_ints(source):
        array = np.array(source, dtype=object)  # numpy made floats of integers >= 2**63 next to negatives
    if array.ndim != 1:
        raise ValueError(
            f"{owner}(labels=) must be 1-D (one label per sample), got an array of shape {array.shape}"
        )
    if array.shape[0] == 0:
        raise ValueError(f"{owner}(labels=) is empty: the dataset has no samples")
    if array.dtype == object:
        _check_missing(array, owner)
    elif array.dtype.kind in "US" and not isinstance(source, np.ndarray):
        # numpy turns None/NaN inside a list of strings into the strings 'None'/'nan'
        _check_missing(np.asarray(source, dtype=object), owner)
    if array.dtype.kind == "f":
        array = _check_floats(array, owner)
    elif array.dtype.kind == "b":
        array = array.astype(np.int64)
    elif array.dtype.kind not in "iuUSO":
        raise TypeError(f"{owner}(labels=) must hold integer, string or other hashable labels, got dtype {array.dtype}")
    return array


def _encode_objects(array: np.ndarray, owner: str) -> tuple[np.ndarray, np.ndarray]:
    """Codes of object labels: sorted order when orderable, else by first appearance."""
    try:
        values, codes = np.unique(array, return_inverse=True)
        return codes.reshape(-1), values
    except TypeError:
        pass
    table: dict[Any, int] = {}
    try:
        codes = np.fromiter((table.setdefault(v, len(table)) for v in array), np.int64, len(array))
    except TypeError as error:
        raise TypeError(
            f"{owner}(labels=) must hold hashable class labels (ints, strings, tuples, ...): {error}"
        ) from None
    values = np.empty(len(table), dtype=object)
    values[:] = list(table)
    return codes, values


def _dense_range(array: np.ndarray) -> tuple[int, int] | None:
    """``(low, high)`` of integer labels when a lookup table over the range is cheap, else None."""
    if array.dtype.kind not in "iu":
        return None
    low, high = int(array.min()), int(array.max())
    return (low, high) if high - low <= 4 * array.shape[0] + 1024 else None


def _offsets(chunk: np.ndarray, low: int) -> np.ndarray:
    """``chunk - low`` as int64 without overflow: uint64 labels >= 2**63 are subtracted in uint64 first."""
    if chunk.dtype == np.uint64:
        return (chunk - np.uint64(low)).astype(np.int64)
    return chunk.astype(np.int64) - low


def _stable_order(codes: np.ndarray, num_classes: int) -> np.ndarray:
    """Stable argsort of class codes: numpy's radix sort on 16-bit keys, two passes above 2**16 classes."""
    if num_classes <= 1 << 16:
        return np.argsort(codes.astype(np.uint16), kind="stable")
    first = np.argsort((codes & 0xFFFF).astype(np.uint16), kind="stable")
    second = np.argsort((codes[first] >> 16).astype(np.uint16), kind="stable")
    return first[second]


def _counting_sort(
    blocks: Callable[[], Iterator[tuple[int, np.ndarray]]], sizes: np.ndarray, offsets: np.ndarray, index_dtype: type
) -> np.ndarray:
    """``members``: sample indices grouped by class, in index order inside a class.

    ``blocks()`` yields ``(first_index, codes)`` for consecutive blocks; each
    block is stably sorted (O(block)) and scattered after the members of its
    classes placed by earlier blocks.
    """
    members = np.empty(int(offsets[-1]), dtype=index_dtype)
    cursor = offsets[:-1].astype(np.int64)
    for first, codes in blocks():
        order = _stable_order(codes, sizes.size)
        ordered = codes[order]
        run_start = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        run_length = np.diff(np.r_[run_start, ordered.size])
        rank = np.arange(ordered.size) - np.repeat(run_start, run_length)
        members[cursor[ordered] + rank] = order + first
        cursor[ordered[run_start]] += run_length
    return members


@dataclass(frozen=True)
class ClassIndex:
    """Samples grouped by class.

    Attributes:
        members: sample indices ordered by class (int32 when N < 2**31).
        offsets: ``C + 1`` boundaries; class ``c`` owns ``members[offsets[c]:offsets[c+1]]``
            (int32 when N < 2**31).
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


def _digest_values(digest: Any, values: np.ndarray) -> None:
    if values.dtype == object or values.dtype.kind in "US":
        digest.update(repr(values.tolist()).encode("utf-8", "backslashreplace"))
    else:
        digest.update(np.ascontiguousarray(values).tobytes())


def group_labels(labels: Any, *, owner: str = "group_labels") -> ClassIndex:
    """Group sample indices by class: O(N) for dense integer labels, else one ``np.unique``.

    The fingerprint digests the code sequence, the class sizes and the class
    values, so it is equal on two ranks exactly when their labels are.
    """
    array = extract_labels(labels, owner=owner)
    n = array.shape[0]
    index_dtype = np.int32 if n < 2**31 else np.int64
    dense = _dense_range(array)
    if dense is not None:
        low, high = dense
        present = np.bincount(_offsets(array, low), minlength=high - low + 1)
        values = np.flatnonzero(present)
        values = values.astype(np.uint64) + np.uint64(low) if high >= 2**63 else values + low
        lookup = (np.cumsum(present > 0) - 1).astype(index_dtype)

        def blocks() -> Iterator[tuple[int, np.ndarray]]:
            for first in range(0, n, _BLOCK):
                yield first, lookup[_offsets(array[first:first + _BLOCK], low)]

        sizes = present[present > 0].astype(index_dtype)
        del present
    else:
        if array.dtype == object:
            codes, values = _encode_objects(array, owner)
        else:
            values, codes = np.unique(array, return_inverse=True)
        codes = codes.reshape(-1).astype(index_dtype)
        sizes = np.bincount(codes, minlength=len(values)).astype(index_dtype)

        def blocks() -> Iterator[tuple[int, np.ndarray]]:
            for first in range(0, n, _BLOCK):
                yield first, codes[first:first + _BLOCK]

    offsets = np.zeros(len(values) + 1, dtype=index_dtype)
    np.cumsum(sizes, out=offsets[1:])
    digest = hashlib.blake2b(digest_size=16)
    code_dtype = np.int32 if len(values) < 2**31 else np.int64
    for _, codes_block in blocks():
        digest.update(np.ascontiguousarray(codes_block, dtype=code_dtype).tobytes())
    digest.update(sizes.astype(np.int64).tobytes())
    _digest_values(digest, values)
    members = _counting_sort(blocks, sizes, offsets, index_dtype)
    return ClassIndex(members, offsets, sizes, values, digest.hexdigest())

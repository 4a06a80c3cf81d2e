"""One coercion from "array-like or tensor" to a checked numpy array.

Samplers, metrics and plots all accept numpy arrays, torch tensors (on any
device, with or without grad) and nested sequences. :func:`as_numpy` is the
single place that turns them into numpy and checks dtype kind, rank, emptiness
and finiteness, with errors that name the argument, the value and the rule.
It imports nothing heavy: torch is recognised by duck typing (``detach`` and
``cpu``), so numpy-only callers never load torch.

Example::

    x = as_numpy(embeddings, name="retrieval_metrics(query=)", dtype=np.float32, ndim=2,
                 non_empty=True, finite=True)
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["as_numpy"]

_KINDS = {"f": "float", "i": "signed int", "u": "unsigned int", "b": "bool"}


def as_numpy(
    value: Any,
    *,
    name: str,
    dtype: Any = None,
    ndim: int | None = None,
    kinds: str | None = "fiu",
    non_empty: bool = False,
    finite: bool = False,
    contiguous: bool = True,
) -> np.ndarray:
    """Return ``value`` as a numpy array, checked; tensors are detached and moved to the CPU.

    Args:
        value: numpy array, torch tensor, or anything ``np.asarray`` accepts.
        name: how the caller names the argument in errors, e.g. ``"knn_search(query=)"``.
        dtype: convert to this dtype after the checks (``None`` keeps the dtype).
        ndim: required number of dimensions (``None``: any).
        kinds: accepted dtype kinds (``"f"`` float, ``"i"``/``"u"`` ints, ``"b"`` bool);
            ``None`` accepts any. Checked before conversion, so strings never become floats.
        non_empty: every dimension must be non-zero.
        finite: reject NaN and Inf (float input only); the error names the first bad row.
        contiguous: return a C-contiguous array (what faiss and BLAS want).

    Raises:
        TypeError: the dtype kind is not accepted.
        ValueError: wrong number of dimensions, empty, or not finite.
    """
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if kinds is not None and array.dtype.kind not in kinds:
        wanted = " or ".join(_KINDS.get(kind, kind) for kind in kinds)
        raise TypeError(f"{name} must be numeric ({wanted}), got dtype {array.dtype}")
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {array.shape}")
    if non_empty and (array.ndim == 0 or 0 in array.shape):
        raise ValueError(f"{name} must be non-empty, got shape {array.shape}")
    if dtype is not None:
        array = array.astype(dtype, copy=False)
    if contiguous:
        array = np.ascontiguousarray(array)
    if finite and array.dtype.kind == "f" and not np.isfinite(array).all():
        bad = ~np.isfinite(array)
        first = int(np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1))[0]) if array.ndim else 0
        raise ValueError(f"{name} contains NaN or Inf (first in row {first})")
    return array

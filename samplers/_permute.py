"""Keyed pseudo-random permutations evaluated point-wise and vectorised.

``keyed_permute(positions, sizes, keys)`` returns, for each row i, the image
of ``positions[i, :]`` under a pseudo-random bijection of ``[0, sizes[i])``
chosen by ``keys[i]``. It lets a rank ask for "position j of class c's shuffled
members" without shuffling every class: the cost is proportional to the number
of positions asked for, not to the class sizes.

Construction:

* domains of up to 32 elements: two rows, picked by the key, of a fixed table
  of 1024 uniformly random permutations per size, composed. (Feistel networks on a few
  bits reach only a biased subset of permutations, so small classes, the bulk
  of long-tail data, get exact uniform permutations instead.)
* larger domains: a 6-round alternating (unbalanced) Feistel network on
  ``b = ceil(log2(size))`` bits, so the domain is less than twice the size,
  made a bijection of ``[0, size)`` by cycle walking (re-apply until the value
  falls in range; on average fewer than two applications).
"""

from __future__ import annotations

import numpy as np

from pksampler.hashing import GOLDEN as _GOLDEN
from pksampler.hashing import M1 as _M1
from pksampler.hashing import M2 as _M2
from pksampler.hashing import mix64

__all__ = ["keyed_permute", "mix64"]

_ROUNDS = 6
_TABLE_MAX_SIZE = 32
_TABLE_ROWS = 1024
_table: np.ndarray | None = None


def _bit_widths(sizes: np.ndarray) -> np.ndarray:
    """Smallest b with 2**b >= size, per element (0 for size 1)."""
    bits = np.ceil(np.log2(np.maximum(sizes, 1).astype(np.float64))).astype(np.uint64)
    one = np.uint64(1)
    bits += ((one << bits) < sizes).astype(np.uint64)  # float rounding at exact powers of two
    bits -= ((bits > 0) & ((one << (bits - (bits > 0).astype(np.uint64))) >= sizes)).astype(np.uint64)
    return bits


def _round_function(b: np.ndarray, round_key: np.ndarray) -> np.ndarray:
    """A cheap keyed mixer (multiply, xor-shift, multiply): every output bit depends on every input bit."""
    with np.errstate(over="ignore"):
        x = (b ^ round_key) * _M1
        x ^= x >> np.uint64(32)
        x *= _M2
        x ^= x >> np.uint64(29)
        return x


def _feistel(x: np.ndarray, bits: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """One application of the keyed bijection of ``[0, 2**bits)``.

    The value is split into a high part ``a`` and a low part ``b``; a round
    maps ``(a, b) -> (b, a ^ F(b))`` and swaps their widths, which is
    invertible for any round function F. ``bits`` and ``keys`` may broadcast
    against ``x`` (one per chunk), which keeps the per-round work small.
    """
    one = np.uint64(1)
    width_b = (bits + one) >> one
    width_a = bits - width_b
    mask_a, mask_b = (one << width_a) - one, (one << width_b) - one
    a = x >> width_b
    b = x & mask_b
    with np.errstate(over="ignore"):
        for round_index in range(_ROUNDS):
            round_key = keys + np.uint64(round_index + 1) * _GOLDEN
            f = _round_function(b, round_key)
            f &= mask_a
            f ^= a
            a, b = b, f
            width_a, width_b = width_b, width_a
            mask_a, mask_b = mask_b, mask_a
    return (a << width_b) | b


def _small_table() -> np.ndarray:
    """``table[n, row, :n]``: 1024 uniformly random permutations of each size n <= 32.

    Built once from a fixed seed, so every process has the same table.
    """
    global _table
    if _table is None:
        rng = np.random.default_rng(0x5EED_7AB1E)
        table = np.zeros((_TABLE_MAX_SIZE + 1, _TABLE_ROWS, _TABLE_MAX_SIZE), dtype=np.int16)
        for size in range(1, _TABLE_MAX_SIZE + 1):
            table[size, :, :size] = np.argsort(rng.random((_TABLE_ROWS, size)), axis=1)
        _table = table
    return _table


def keyed_permute(positions: np.ndarray, sizes: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Map ``positions[i, j]`` in ``[0, sizes[i])`` through the bijection keyed by ``keys[i]``.

    Args:
        positions: ``(M, L)`` non-negative integers with ``positions[i] < sizes[i]``.
        sizes: ``(M,)`` domain size per row (>= 1).
        keys: ``(M,)`` uint64 key per row; use well-mixed keys (see :func:`mix64`).

    Returns:
        ``(M, L)`` int64: for every fixed ``(size, key)`` a permutation of ``[0, size)``.
    """
    positions = np.asarray(positions)
    sizes = np.asarray(sizes).astype(np.uint64, copy=False)
    keys = np.asarray(keys).astype(np.uint64, copy=False)
    if positions.ndim != 2 or sizes.shape != positions.shape[:1] or keys.shape != sizes.shape:
        raise ValueError(
            f"keyed_permute expects positions (M, L) with sizes and keys (M,), got "
            f"{positions.shape}, {sizes.shape}, {keys.shape}"
        )
    result = np.empty(positions.shape, dtype=np.int64)
    small = sizes <= _TABLE_MAX_SIZE
    if small.any():
        rows = np.flatnonzero(small)
        # Two table permutations composed: 1024**2 permutations per size and key.
        first = (keys[rows] % np.uint64(_TABLE_ROWS)).astype(np.intp)[:, None]
        second = ((keys[rows] >> np.uint64(32)) % np.uint64(_TABLE_ROWS)).astype(np.intp)[:, None]
        size_index = sizes[rows].astype(np.intp)[:, None]
        table = _small_table()
        inner = table[size_index, first, positions[rows]]
        result[rows] = table[size_index, second, inner]
    if small.all():
        return result
    rows = np.flatnonzero(~small) if small.any() else slice(None)
    big_sizes, big_keys = sizes[rows][:, None], keys[rows][:, None]
    bits = _bit_widths(big_sizes)
    permuted = _feistel(positions[rows].astype(np.uint64), bits, big_keys)  # row values broadcast
    shape = permuted.shape
    permuted = permuted.reshape(-1)
    sizes_b = np.broadcast_to(big_sizes, shape).reshape(-1)
    pending = np.flatnonzero(permuted >= sizes_b)
    if pending.size:
        bits_b = np.broadcast_to(bits, shape).reshape(-1)
        keys_b = np.broadcast_to(big_keys, shape).reshape(-1)
        while pending.size:
            walked = _feistel(permuted[pending], bits_b[pending], keys_b[pending])
            permuted[pending] = walked
            pending = pending[walked >= sizes_b[pending]]
    result[rows] = permuted.reshape(shape).astype(np.int64)
    return result

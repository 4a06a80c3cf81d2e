"""Keyed pseudo-random permutations evaluated point-wise and vectorised.

``keyed_permute(positions, sizes, keys)`` returns, for each element, the image
of ``positions[i]`` under a pseudo-random bijection of ``[0, sizes[i])`` chosen
by ``keys[i]``. It lets a rank ask for "position j of class c's shuffled
members" without shuffling every class: the cost is proportional to the number
of positions asked for, not to the class sizes.

Construction: a balanced 4-round Feistel network on ``2*h`` bits with
``4**h >= size`` (so the domain is at most four times too large), made a
bijection of ``[0, size)`` by cycle walking (re-apply until the value falls in
range; on average fewer than four applications).
"""

from __future__ import annotations

import numpy as np

__all__ = ["keyed_permute", "mix64"]

_ROUNDS = 4
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: a fast, well-mixing bijection of uint64 values."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def _half_bits(sizes: np.ndarray) -> np.ndarray:
    """Smallest h >= 1 with 4**h >= size, per element."""
    need = np.ceil(np.log2(np.maximum(sizes, 2).astype(np.float64)))
    half = np.maximum(np.ceil(need / 2.0), 1.0).astype(np.uint64)
    # guard against float rounding at exact powers of two
    too_small = (np.uint64(1) << (np.uint64(2) * half)) < sizes.astype(np.uint64)
    return half + too_small.astype(np.uint64)


def _feistel(x: np.ndarray, half: np.ndarray, mask: np.ndarray, keys: np.ndarray) -> np.ndarray:
    left = x >> half
    right = x & mask
    with np.errstate(over="ignore"):
        for round_index in range(_ROUNDS):
            round_key = keys + np.uint64(round_index + 1) * _GOLDEN
            f = mix64(right ^ round_key) & mask
            left, right = right, left ^ f
    return (left << half) | right


def keyed_permute(positions: np.ndarray, sizes: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Map each ``positions[i]`` in ``[0, sizes[i])`` through the bijection keyed by ``keys[i]``.

    Args:
        positions: non-negative integers, ``positions < sizes`` element-wise.
        sizes: domain size per element (>= 1); broadcastable to ``positions``.
        keys: uint64 key per element; broadcastable to ``positions``.

    Returns:
        int64 array of the same shape: a permutation of ``[0, size)`` for every
        fixed ``(size, key)``.
    """
    positions = np.asarray(positions)
    shape = positions.shape
    x = positions.astype(np.uint64).reshape(-1)
    sizes_b = np.broadcast_to(np.asarray(sizes, dtype=np.uint64), shape).reshape(-1)
    keys_b = np.broadcast_to(np.asarray(keys, dtype=np.uint64), shape).reshape(-1)
    half = _half_bits(sizes_b)
    mask = (np.uint64(1) << half) - np.uint64(1)
    result = _feistel(x, half, mask, keys_b)
    pending = np.flatnonzero(result >= sizes_b)
    while pending.size:
        walked = _feistel(result[pending], half[pending], mask[pending], keys_b[pending])
        result[pending] = walked
        pending = pending[walked >= sizes_b[pending]]
    return result.astype(np.int64).reshape(shape)

"""SplitMix64, written once: the counter-based hash behind every keyed draw in pksampler.

The samplers' keyed permutations, the batch augmentation's per-sample
uniforms, the sharded head's negative classes and the evaluation's stratified
queries all need "a pseudo-random number that is a pure function of a few
integers", the same in every process and for every world size. They take it
from here, so the constants and the arithmetic exist in one place and a
change to them is one change (the tests pin the outputs bit for bit).

* :func:`mix64`: SplitMix64's finaliser, a bijection of uint64 in which every
  input bit reaches every output bit;
* :func:`splitmix64`: one full SplitMix64 step, ``mix64(x + GOLDEN)`` (the
  generator's output for state ``x``).

Both are vectorised over numpy arrays (a numpy scalar works too); uint64
arithmetic wraps modulo 2**64 by design, so overflow warnings are silenced.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GOLDEN", "M1", "M2", "mix64", "splitmix64"]

#: SplitMix64's increment: 2**64 / golden ratio, odd
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
#: the finaliser's two multipliers (also the samplers' Feistel round function's)
M1 = np.uint64(0xBF58476D1CE4E5B9)
M2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray | np.integer | int) -> np.ndarray:
    """SplitMix64's finaliser of ``x`` (as uint64): a fast, well-mixing bijection of uint64 values."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * M1
        x = (x ^ (x >> np.uint64(27))) * M2
        return x ^ (x >> np.uint64(31))


def splitmix64(x: np.ndarray | np.integer | int) -> np.ndarray:
    """One SplitMix64 step of state ``x`` (as uint64): ``mix64(x + GOLDEN)``, wrapping modulo 2**64."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return mix64(x + GOLDEN)

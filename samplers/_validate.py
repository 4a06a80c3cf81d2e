"""Argument checks shared by the samplers: errors name the argument, the value and the rule."""

from __future__ import annotations

import numbers
from typing import Any


#: seeds and epochs must fit the int64 fields of the cross-rank fingerprint
SEED_LIMIT = 2**63


def check_int(
    name: str, value: Any, *, minimum: int | None = None, below: int | None = None, owner: str = ""
) -> int:
    """Return ``value`` as an ``int`` or raise a TypeError/ValueError naming ``name``.

    ``bool`` is rejected even though it is an ``int`` subclass: ``True`` as a
    batch size is always a mistake. ``below`` is an exclusive upper bound.
    """
    where = f"{owner}({name}=)" if owner else f"{name}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where} expects an int, got {value!r} of type {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{where} must be >= {minimum}, got {value}")
    if below is not None and value >= below:
        low = "" if minimum is None else f"{minimum}, "
        bound = "2**63" if below == SEED_LIMIT else str(below)
        raise ValueError(f"{where} must be in [{low}{bound}) ({bound} and above are not allowed), got {value}")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...], *, owner: str = "") -> str:
    """Return ``value`` if it is one of ``choices``, else raise a ValueError listing them."""
    where = f"{owner}({name}=)" if owner else f"{name}"
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{where} must be one of {list(choices)}, got {value!r}")
    return value


def check_real(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    owner: str = "",
) -> float:
    """Return ``value`` as a finite float within ``[low, high]``."""
    where = f"{owner}({name}=)" if owner else f"{name}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} expects a real number, got {value!r} of type {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{where} must be finite, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{where} must be in [{low}, {high}], got {value}")
    return value

"""Validation rules for configuration values, written once.

A rule is ``rule(path, value) -> None`` that raises :class:`ConfigError`
with the dotted key, the value and what was expected. The schema attaches a
rule to each field; the environment and ``--set`` layers use the same rules.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable, Mapping

from pksampler.samplers._validate import SEED_LIMIT
from pksampler.train.config import choices
from pksampler.train.errors import ConfigError

__all__ = [
    "ConfigError",
    "Rule",
    "augment",
    "boolean",
    "choice",
    "closed_interval",
    "dataset_entries",
    "dataset_names",
    "int_at_least",
    "int_between",
    "non_empty_string",
    "non_negative_finite",
    "open_interval",
    "optional",
    "positive_finite",
    "positive_int",
    "positive_int_list",
    "memory",
    "seed",
]

Rule = Callable[[str, Any], None]




def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def boolean(path: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: must be true or false, got {value!r}")


def int_at_least(minimum: int) -> Rule:
    def rule(path: str, value: Any) -> None:
        if not _is_int(value) or value < minimum:
            raise ConfigError(f"{path}: must be an integer >= {minimum}, got {value!r}")

    return rule


positive_int = int_at_least(1)


def int_between(minimum: int, maximum: int) -> Rule:
    def rule(path: str, value: Any) -> None:
        if not _is_int(value) or not minimum <= value <= maximum:
            raise ConfigError(f"{path}: must be an integer in [{minimum}, {maximum}], got {value!r}")

    return rule


def positive_int_list(path: str, value: Any) -> None:
    if not value or any(not _is_int(v) or v < 1 for v in value):
        raise ConfigError(f"{path}: must be a non-empty list of positive integers, got {list(value)!r}")


def seed(path: str, value: Any) -> None:
    """A seed of the samplers' range (``SEED_LIMIT``: numpy's SeedSequence and the int64 fingerprint)."""
    if not _is_int(value) or not 0 <= value < SEED_LIMIT:
        raise ConfigError(f"{path}: must be an integer in [0, 2**63), got {value!r}")


def positive_finite(path: str, value: Any) -> None:
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{path}: must be a finite number > 0, got {value!r}")


def non_negative_finite(path: str, value: Any) -> None:
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{path}: must be a finite number >= 0, got {value!r}")


def non_empty_string(path: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path}: must be a non-empty string, got {value!r}")


#: layouts an entry of ``data.datasets`` may name after a colon (``photos:folder``); detected when left out
DATASET_LAYOUTS = ("folder", "list", "shards")


def dataset_entries(where: str, entries: Iterable[str]) -> list[tuple[str, str | None]]:
    """``[(name, layout or None)]`` of ``data.datasets`` entries (``name`` or ``name:layout``), checked.

    A name is a relative path under the datasets' root: not empty, not absolute, no ``..`` part (it would
    leave ``DATASETS_PATH``), never two entries for one dataset (its classes would count twice). ``where``
    names the source in the message (``data.datasets`` or the ``DATASETS`` variable).
    """
    seen: dict[str, int] = {}
    result = []
    for position, entry in enumerate(entries, start=1):
        if "://" in entry:
            raise ConfigError(f"{where}: entry {position} {entry!r} is a URL, not a name; put the store in "
                              "DATASETS_PATH (s3://bucket/prefix) and the dataset's name under it here")
        name, colon, layout = entry.partition(":")
        name, layout = name.strip(), layout.strip()
        if colon and layout not in DATASET_LAYOUTS:
            raise ConfigError(f"{where}: entry {position} {entry!r} names the layout {layout!r}; after a colon "
                              f"give one of {list(DATASET_LAYOUTS)}, or leave it out to detect it")
        parts = [part for part in name.replace("\\", "/").split("/") if part not in ("", ".")]
        if not parts:
            raise ConfigError(f"{where}: entry {position} is empty ({entry!r}); give one dataset name between "
                              "single commas")
        if name.startswith("/") or ".." in parts:
            raise ConfigError(f"{where}: entry {position} {entry!r} leaves the datasets' root; a dataset is a "
                              "name under DATASETS_PATH, with no '..' and no leading '/'")
        key = "/".join(parts)
        if key in seen:
            raise ConfigError(f"{where}: entry {position} {entry!r} repeats entry {seen[key]}; every dataset is "
                              "listed once (its classes would count twice)")
        seen[key] = position
        result.append((key, layout or None))
    return result


def dataset_names(path: str, value: Any) -> None:
    """``data.datasets``: entries accepted by :func:`dataset_entries` (the schema has checked they are strings)."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: must be a list of names under data.root, each once, with no '..' (a name or "
                          f"name:{'|'.join(DATASET_LAYOUTS)}), got {value!r}")
    dataset_entries(path, value)


def open_interval(low: float, high: float) -> Rule:
    def rule(path: str, value: Any) -> None:
        if not _is_real(value) or not low < value < high:
            raise ConfigError(f"{path}: must be in ({low:g}, {high:g}), got {value!r}")

    return rule


def left_open_interval(low: float, high: float) -> Rule:
    def rule(path: str, value: Any) -> None:
        if not _is_real(value) or not low < value <= high:
            raise ConfigError(f"{path}: must be in ({low:g}, {high:g}], got {value!r}")

    return rule


def right_open_interval(low: float, high: float) -> Rule:
    def rule(path: str, value: Any) -> None:
        if not _is_real(value) or not low <= value < high:
            raise ConfigError(f"{path}: must be in [{low:g}, {high:g}), got {value!r}")

    return rule


def closed_interval(low: float, high: float) -> Rule:
    def rule(path: str, value: Any) -> None:
        if not _is_real(value) or not low <= value <= high:
            raise ConfigError(f"{path}: must be in [{low:g}, {high:g}], got {value!r}")

    return rule


def optional(inner: Rule) -> Rule:
    def rule(path: str, value: Any) -> None:
        if value is not None:
            inner(path, value)

    return rule


def choice(options: Callable[[], Iterable[str]], *, prefixes: tuple[str, ...] = ()) -> Rule:
    """One of ``options()`` (read lazily from a registry), or any name starting with one of ``prefixes``."""

    def rule(path: str, value: Any) -> None:
        allowed = list(options())
        if isinstance(value, str) and (value in allowed or any(value.startswith(p) and len(value) > len(p)
                                                                for p in prefixes)):
            return
        extra = "".join(f" or {p}<Name>" for p in prefixes)
        raise ConfigError(f"{path}: must be one of {allowed}{extra}, got {value!r}")

    return rule


#: ``loss.memory`` keys and their rules (cross-batch memory: :func:`pksampler.train.losses.memory.build_memory`)
MEMORY_KEYS: dict[str, Rule] = {"size": positive_int, "size_items": positive_int, "warmup_steps": int_at_least(0)}


def memory(path: str, value: Any) -> None:
    """``{size: M, warmup_steps: N}`` (or ``size_items`` instead of ``size``): known keys, exactly one size."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {value!r}")
    unknown = sorted(set(value) - set(MEMORY_KEYS))
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}: unknown key (known: {sorted(MEMORY_KEYS)})")
    for key, rule in MEMORY_KEYS.items():
        if key in value:
            rule(f"{path}.{key}", value[key])
    if ("size" in value) == ("size_items" in value):
        raise ConfigError(f"{path}: needs exactly one of size (batches) and size_items (rows), got {dict(value)!r}")


#: ``data.augment`` keys: the strengths of :class:`pksampler.datasets.BatchAugment`
AUGMENT_KEYS = ("scale", "ratio", "flip", "jitter", "rotation")


def augment(path: str, value: Any) -> None:
    """``{scale: [lo, hi], ratio: [lo, hi], flip: p, jitter: s, rotation: deg}``: known keys, values BatchAugment takes."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {value!r}")
    unknown = sorted(set(value) - set(AUGMENT_KEYS), key=str)
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}: unknown key (known: {list(AUGMENT_KEYS)})")
    for key, given in value.items():
        pair = key in ("scale", "ratio")
        if pair and not (isinstance(given, (list, tuple)) and len(given) == 2 and all(map(_is_real, given))):
            raise ConfigError(f"{path}.{key}: expected two numbers [low, high], got {given!r}")
        if not pair and not _is_real(given):
            raise ConfigError(f"{path}.{key}: expected a number, got {given!r}")
    try:
        choices.check("augment", value)  # the ranges are BatchAugment's own rules, registered from above
    except ValueError as error:
        raise ConfigError(f"{path}: {error}") from None

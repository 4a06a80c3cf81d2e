"""Named choices and extra checks that the layers above give the configuration.

The configuration is the bottom layer: it knows which keys exist and what
shape their values take, but not which backbones, losses, data sources or
samplers are implemented. Those names belong to the modules that implement
them (OML's registries work the same way). The application layer registers
one *provider* per kind here (:func:`register`), a function returning the
names, called only when a config is validated, so loading and checking a
YAML file imports no model or dataset code until a name has to be checked.

Checks that need an implementation (the augmentation's ranges are
BatchAugment's own rules) are registered the same way (:func:`register_check`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["check", "names", "register", "register_check"]

_PROVIDERS: dict[str, Callable[[], Iterable[str]]] = {}
_CHECKS: dict[str, Callable[[Any], None]] = {}


def register(kind: str, provider: Callable[[], Iterable[str]]) -> None:
    """Let ``provider()`` answer which names are valid for ``kind`` (replaces an earlier provider)."""
    _PROVIDERS[kind] = provider


def names(kind: str) -> tuple[str, ...]:
    """The valid names for ``kind``; a kind nobody registered is a wiring error, not a user error."""
    try:
        provider = _PROVIDERS[kind]
    except KeyError:
        raise LookupError(f"no provider of {kind!r} choices is registered; import pksampler.train first") from None
    return tuple(provider())


def register_check(kind: str, check_value: Callable[[Any], None]) -> None:
    """Let ``check_value(value)`` raise ValueError for a value of ``kind`` the implementation refuses."""
    _CHECKS[kind] = check_value


def check(kind: str, value: Any) -> None:
    """Run the registered check for ``kind`` (nothing when none is registered)."""
    if kind in _CHECKS:
        _CHECKS[kind](value)

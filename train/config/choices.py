"""Named choices and extra checks that the layers above give the configuration.

The configuration is the bottom layer: it knows which keys exist and what
shape their values take, but not which backbones, losses, data sources or
samplers are implemented. Those names belong to the modules that implement
them (OML's registries work the same way). The application layer registers
one *provider* per kind here (:func:`register`), a function returning the
names, called only when a config is validated, so loading and checking a
YAML file imports no model or dataset code until a name has to be checked.

Checks that need an implementation (the augmentation's ranges are
BatchAugment's own rules) are registered the same way (:func:`register_check`),
and so are the implementations behind a free-form ``args`` block
(:func:`register_arguments`: ``data.args`` are ShardedDataset's keyword
arguments for ``data.name: shards``), which the configuration reference
documents from their signatures and docstrings.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

__all__ = ["arguments", "check", "names", "register", "register_arguments", "register_check"]

_PROVIDERS: dict[str, Callable[[], Iterable[str]]] = {}
_CHECKS: dict[str, Callable[[Any], None]] = {}
#: a choice's ``args``: the callable that takes them as keyword arguments, and the arguments the builder sets itself
Arguments = Mapping[str, tuple[Callable[..., Any], Iterable[str]]]
_ARGUMENTS: dict[str, Callable[[], Arguments]] = {}


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


def register_arguments(kind: str, provider: Callable[[], Arguments]) -> None:
    """Let ``provider()`` say, per name of ``kind``, what takes ``<kind>.args``: ``{name: (callable, set by the
    builder)}``; the reference lists the callable's other keyword arguments (replaces an earlier provider)."""
    _ARGUMENTS[kind] = provider


def arguments(kind: str) -> Arguments:
    """What takes ``<kind>.args`` per name (see :func:`register_arguments`); empty when nobody registered it."""
    return _ARGUMENTS[kind]() if kind in _ARGUMENTS else {}

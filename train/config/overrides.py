"""The training platform's environment variables and ``--set key=value`` overrides.

Environment (the platform's contract): ``DATASETS_PATH`` and ``DATASETS``
(data root = ``$DATASETS_PATH/$DATASETS``; read-only; several names,
``DATASETS=photos,products``, set ``data.datasets``: their union under the
root ``$DATASETS_PATH``), ``WORKSPACE``,
``EPOCHS``, ``LR``, ``BATCH_SIZE`` (images per process: sets the global
``sampler.classes_per_step = W * BATCH_SIZE / K``, W read from the launcher's
environment) and ``WORKER_PER_NODE`` (DataLoader workers per process).
``BACKEND`` is torch.distributed's, read where the process group starts
(:mod:`pksampler.train.runtime.process_group`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from pksampler.comm import launcher_world
from pksampler.locations import is_remote

from pksampler.train.config import rules
from pksampler.train.errors import ConfigError

__all__ = ["apply_environment", "load_yaml", "parse_override", "set_path"]


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e-3`` as a number (YAML 1.2; YAML 1.1 wants ``1.0e-3``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(stream: Any) -> Any:
    """``yaml.safe_load`` with YAML 1.2 exponent floats (``1e-3``); nothing read executes code."""
    return yaml.load(stream, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def set_path(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``dotted = "a.b.c"``, creating sections."""
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {part!r} is not a section (it holds {child!r})")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``key.path=value`` with the value parsed as YAML (numbers, booleans, lists)."""
    key, separator, raw = text.partition("=")
    if not separator or not key.strip():
        raise ConfigError(f"--set expects key=value, got {text!r}")
    try:
        value = load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as error:
        reason = str(error).splitlines()[0]
        raise ConfigError(f"--set {key.strip()}: {raw!r} is not a valid YAML value ({reason})") from None
    glued = _glued_key(value)
    if glued is not None:
        name, _, rest = glued.partition(":")
        raise ConfigError(f"--set {key.strip()}: {raw!r} reads {glued!r} as one key with no value; YAML needs a "
                          f"space after the colon, as in {{{name}: {rest}}}")
    return key.strip(), value


#: ``name:value`` read as one key: a config-like name, a colon, then no space (a URL's ``s3://`` is not one)
_GLUED = re.compile(r"^[A-Za-z_][\w.]*:[^\s/]")


def _glued_key(value: Any) -> str | None:
    """A mapping key like ``'num_classes:160'`` with no value: ``{a:1}`` written without YAML's space."""
    if isinstance(value, dict):
        glued = [key for key, item in value.items() if item is None and isinstance(key, str) and _GLUED.match(key)]
        if glued:
            return glued[0]
        children = list(value.values())
    elif isinstance(value, list):
        children = value
    else:
        return None
    return next((found for found in map(_glued_key, children) if found is not None), None)


def epochs_replace_steps(tree: dict, environ: Mapping[str, str], overrides: Sequence[tuple[str, Any]]) -> None:
    """``EPOCHS`` or ``--set train.epochs=N`` over a file with ``train.steps``: the epochs asked for win.

    The length of a run is given one way; the later source sets it, unless
    ``--set`` also names ``train.steps``.
    """
    def names(key: str, value: Any, field: str) -> bool:
        return key == f"train.{field}" or (key == "train" and isinstance(value, dict) and field in value)

    epochs_given = bool(environ.get("EPOCHS")) or any(names(k, v, "epochs") for k, v in overrides)
    if epochs_given and not any(names(k, v, "steps") for k, v in overrides):
        if isinstance(tree.get("train"), dict):
            tree["train"].pop("steps", None)


def _number(environ: Mapping[str, str], key: str, kind: type) -> Any:
    try:
        return kind(environ[key])
    except ValueError:
        raise ConfigError(f"environment variable {key}={environ[key]!r} must be a{'n' if kind is int else ''} "
                          f"{'integer' if kind is int else 'number'}") from None


def apply_environment(tree: dict, environ: Mapping[str, str], *, overrides: Sequence[tuple[str, Any]] = ()) -> None:
    """Apply the platform's variables to the raw config ``tree`` (before validation).

    ``overrides`` are the ``--set`` pairs that will be applied afterwards: ``BATCH_SIZE``
    is resolved with the sampler and K they give, not the file's.
    """
    if environ.get("DATASETS_PATH") or environ.get("DATASETS"):
        _apply_datasets(tree, environ)
    if environ.get("WORKSPACE"):
        set_path(tree, "workspace", environ["WORKSPACE"])
    if environ.get("EPOCHS"):
        set_path(tree, "train.epochs", _number(environ, "EPOCHS", int))
    if environ.get("LR"):
        set_path(tree, "optim.lr", _number(environ, "LR", float))
    if environ.get("WORKER_PER_NODE"):
        set_path(tree, "data.workers", _number(environ, "WORKER_PER_NODE", int))
    if environ.get("BATCH_SIZE"):
        _apply_batch_size(tree, _number(environ, "BATCH_SIZE", int), environ, overrides)


def _apply_datasets(tree: dict, environ: Mapping[str, str]) -> None:
    """``DATASETS`` under ``DATASETS_PATH``: one name is the data root; several (commas) or ``name:layout`` are
    ``data.datasets`` under the root ``DATASETS_PATH``, trained as their union. A name is checked by the same rule
    either way (:func:`~pksampler.train.config.rules.dataset_entries`): one name may not leave ``DATASETS_PATH``
    any more than one of several."""
    base = environ.get("DATASETS_PATH")
    names = environ.get("DATASETS", "")
    where = f"environment variable DATASETS={names!r}"
    if "," in names or ":" in names:
        entries = rules.dataset_entries(where, names.split(","))
        if not base:
            raise ConfigError(f"{where} lists datasets by name, but DATASETS_PATH (the folder or s3:// prefix that "
                              "holds them) is not set: set it")
        set_path(tree, "data.root", base)
        set_path(tree, "data.datasets", [name if layout is None else f"{name}:{layout}" for name, layout in entries])
        return
    if names and base:
        names = rules.dataset_entries(where, [names])[0][0]
    base = base or "."
    sub = names or tree.get("data", {}).get("root") or ""
    set_path(tree, "data.root", str(Path(base) / sub) if not is_remote(base) else f"{base.rstrip('/')}/{sub}")


def _apply_batch_size(tree: dict, per_process: int, environ: Mapping[str, str],
                      overrides: Sequence[tuple[str, Any]]) -> None:
    """BATCH_SIZE is images per process; the config is global, so multiply by the world size."""
    found = launcher_world(dict(environ))
    world = found[1] if found is not None else 1
    sampler = dict(tree.get("sampler") or {}) if isinstance(tree.get("sampler"), dict) else {}
    for key, value in overrides:
        if key == "sampler" and isinstance(value, dict):
            sampler.update(value)
        elif key.startswith("sampler.") and key.count(".") == 1:
            sampler[key.split(".", 1)[1]] = value
    if per_process < 1:
        raise ConfigError(f"environment variable BATCH_SIZE={per_process} must be a positive integer")
    if sampler.get("name", "balanced") == "triplet":
        if per_process % 3:
            raise ConfigError(f"environment variable BATCH_SIZE={per_process} must be a multiple of 3 "
                              "(images per triplet) for the triplet sampler")
        set_path(tree, "sampler.triplets_per_step", world * per_process // 3)
        return
    k = sampler.get("samples_per_class", 4)
    if not isinstance(k, int) or per_process % k:
        raise ConfigError(f"environment variable BATCH_SIZE={per_process} must be a multiple of "
                          f"sampler.samples_per_class={k!r} (images per process = classes per rank x K)")
    set_path(tree, "sampler.classes_per_step", world * per_process // k)

"""Load a run configuration: YAML file, then the platform's environment, then ``--set``.

Precedence, lowest first: the dataclass defaults (:mod:`.schema`), the YAML
file (``yaml.safe_load``), the training platform's environment variables
(:mod:`.overrides`) and ``--set key.path=value``. The result is a frozen
:class:`RunConfig` whose every value passed its rule; unknown keys are
refused with their dotted name.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from pksampler.train.config.overrides import apply_environment, epochs_replace_steps, load_yaml, parse_override, set_path
from pksampler.train.config import schema
from pksampler.train.errors import ConfigError
from pksampler.train.config.schema import (
    DataConfig,
    DistributedConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    SamplerConfig,
    TrainConfig,
    resolve_head_defaults,
    validate,
)

__all__ = [*schema.__all__, "build_config", "load_config"]


def _convert(value: Any, annotation: Any, path: str) -> Any:
    """``value`` checked against the field's type annotation (no coercion between kinds)."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(annotation) if o is not type(None)]
        if value is None and len(options) < len(typing.get_args(annotation)):
            return None
        errors = []
        for option in options:
            try:
                return _convert(value, option, path)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if errors else f"{path}: invalid value {value!r}")
    if dataclasses.is_dataclass(annotation):
        return _build(annotation, value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item,) = typing.get_args(annotation)[:1]
        return tuple(_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict) or annotation in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    expected = {bool: ("true or false", (bool,)), int: ("an integer", (int,)), float: ("a number", (int, float)),
                str: ("a string", (str,))}.get(annotation)
    if expected is None:
        return value
    words, kinds = expected
    if not isinstance(value, kinds) or (annotation is not bool and isinstance(value, bool)):
        raise ConfigError(f"{path}: expected {words}, got {value!r}")
    if annotation is int and abs(value) >= 2**64:  # the field rules give the exact range
        raise ConfigError(f"{path}: expected an integer that fits in 64 bits, got {value!r}")
    if annotation is float:
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{path}: {value!r} is too large for a floating-point number") from None
    return value


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names), key=str)
    if unknown:
        where = f"{prefix}." if prefix else ""
        removed = REMOVED_KEYS.get(f"{where}{unknown[0]}")
        if removed is not None:
            raise ConfigError(f"{where}{unknown[0]}: this key was removed, {removed}; delete it from the config")
        raise ConfigError(f"unknown config key {where}{unknown[0]!r} "
                          f"(known keys under {prefix or 'the top level'}: {sorted(names)})")
    values = {name: _convert(data[name], hints[name], f"{prefix}.{name}" if prefix else name)
              for name in names if name in data}
    return cls(**values)


#: keys removed from the schema, and what replaced them (a config file that sets one is told)
REMOVED_KEYS: dict[str, str] = {
    "head.lr_scale": "replaced by head.lr, head.momentum and head.weight_decay (the rows' own SGD, not a multiple "
                     "of AdamW's rate; docs/sharded-head.md)",
}
#: keys added after checkpoints were written, and the value every run before the key had
ADDED_KEYS: dict[str, Any] = {"model.projection_bias": True, "model.pool_norm": False, "data.datasets": [],
                               "data.split_by": "index", "data.heldout_images": 0}


def build_config(tree: Mapping[str, Any]) -> RunConfig:
    """A validated RunConfig from a plain nested mapping (a config file's; a checkpoint's: :func:`saved_config`)."""
    config = _build(RunConfig, tree, "")
    validate(config)
    return resolve_head_defaults(config)


def saved_config(tree: Mapping[str, Any]) -> RunConfig:
    """The RunConfig of a checkpoint's saved config, which may predate the schema: a removed key is dropped (it
    trained the run, it does not describe the network) and an added key takes the value its run had."""
    tree = {section: dict(value) if isinstance(value, Mapping) else value for section, value in tree.items()}
    for key in REMOVED_KEYS:
        section, name = key.split(".")
        if isinstance(tree.get(section), dict):
            tree[section].pop(name, None)
    for key, value in ADDED_KEYS.items():
        section, name = key.split(".")
        if isinstance(tree.get(section), dict):
            tree[section].setdefault(name, value)
    return build_config(tree)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as handle:
            tree = load_yaml(handle) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path} cannot be read: {error}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level, got {type(tree).__name__}")
    return tree


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Load a RunConfig from YAML, then environment variables, then ``--set`` overrides."""
    tree: dict = _read_yaml(Path(path)) if path is not None else {}
    pairs = [parse_override(text) for text in overrides]
    environ = os.environ if environ is None else environ
    apply_environment(tree, environ, overrides=pairs)
    for key, value in pairs:
        set_path(tree, key, value)
    epochs_replace_steps(tree, environ, pairs)
    return build_config(tree)

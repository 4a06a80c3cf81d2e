"""Run configuration: YAML files loaded into frozen dataclasses that reject unknown keys.

Precedence, lowest first: the dataclass defaults, the YAML file, the training
platform's environment variables (DATASETS_PATH, DATASETS, WORKSPACE, EPOCHS,
LR, BATCH_SIZE, WORKER_PER_NODE) and ``--set key.path=value`` overrides.
Derived values (the batch size P*K) are computed, never typed twice.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

__all__ = [
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "SamplerConfig",
    "TrainConfig",
    "load_config",
]

ENVIRONMENT_KEYS = ("DATASETS_PATH", "DATASETS", "WORKSPACE", "EPOCHS", "LR", "BATCH_SIZE", "WORKER_PER_NODE")


class ConfigError(ValueError):
    """A configuration problem; the message names the key (dotted path) and the value."""


@dataclass(frozen=True)
class DataConfig:
    """Where the images come from and how they are split and augmented.

    ``name``: ``synthetic`` (built-in SyntheticProducts; ``args`` are its
    arguments), ``folder`` (ImageFolderDataset under ``root``) or ``list``
    (ListFileDataset; ``args.list_file`` relative to ``root``).
    """

    name: str = "synthetic"
    args: Mapping[str, Any] = field(default_factory=lambda: {"num_classes": 160, "images_per_class": 16, "image_size": 48})
    root: str | None = None
    test_fraction: float = 0.3
    image_size: int = 40
    workers: int = 1
    split_seed: int = 0


@dataclass(frozen=True)
class SamplerConfig:
    """``balanced`` (P x K: args classes_per_batch, samples_per_class, small_classes,
    class_weighting) or ``triplet`` (args triplets_per_batch, negatives, hard_classes, hard_fraction)."""

    name: str = "balanced"
    args: Mapping[str, Any] = field(default_factory=lambda: {"classes_per_batch": 8, "samples_per_class": 4})


@dataclass(frozen=True)
class ModelConfig:
    """Compact ResNet-style backbone with an L2-normalised embedding head."""

    backbone: str = "resnet"  # resnet | torchvision:<name>
    width: int = 32
    depth: tuple[int, ...] = (1, 1, 1, 1)
    embedding_dim: int = 64
    norm: str = "group"  # group | batch | sync_batch | none
    pooling: str = "avg"  # avg | gem | avgmax
    neck: str = "none"  # none | batch | layer (normalises the embedding before the L2 norm)


@dataclass(frozen=True)
class LossConfig:
    """``batch_hard`` (args margin: "soft" or a float), ``multi_similarity``
    (alpha, beta, base, epsilon), ``contrastive`` (pos_margin, neg_margin) or
    ``triplet`` (margin) for the triplet sampler."""

    name: str = "multi_similarity"
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW or SGD. ``lr`` is for ``base_batch`` images per global step; the
    effective rate scales linearly with the global batch (so with the world
    size at a fixed per-rank batch), after a linear warm-up, then cosine decay."""

    name: str = "adamw"
    lr: float = 0.004
    base_batch: int = 64
    weight_decay: float = 0.0005
    momentum: float = 0.9
    warmup_steps: int = 30


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 8
    gather_embeddings: bool = True
    fp16_allreduce: bool = False
    backward_passes_per_step: int = 1
    eval_every: int = 2
    checkpoint_every: int = 50
    resume: bool = True
    threads: int = 1
    max_steps: int | None = None  # stop (and checkpoint) after this many global steps
    gallery_queries: int = 8


@dataclass(frozen=True)
class DistributedConfig:
    backend: str = "auto"  # auto | horovod | torch | none


@dataclass(frozen=True)
class RunConfig:
    seed: int = 0
    workspace: str = "workspace/demo"
    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    @property
    def batch_size(self) -> int:
        """Images per rank batch, derived from the sampler arguments."""
        args = self.sampler.args
        if self.sampler.name == "triplet":
            return 3 * int(args.get("triplets_per_batch", 0))
        return int(args.get("classes_per_batch", 0)) * int(args.get("samples_per_class", 0))

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


_CHOICES = {
    "data.name": ("synthetic", "folder", "list"),
    "sampler.name": ("balanced", "triplet"),
    "model.norm": ("group", "batch", "sync_batch", "none"),
    "loss.name": ("batch_hard", "multi_similarity", "contrastive", "triplet"),
    "optim.name": ("adamw", "sgd"),
    "distributed.backend": ("auto", "horovod", "torch", "none"),
}


def _convert(value: Any, annotation: Any, path: str) -> Any:
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
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
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return value


def _build(cls: type, data: Any, prefix: str) -> Any:
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown config key {where}{unknown[0]!r} (known keys under {prefix or 'the top level'}: {sorted(names)})")
    values = {}
    for name in names:
        if name in data:
            path = f"{prefix}.{name}" if prefix else name
            values[name] = _convert(data[name], hints[name], path)
            choices = _CHOICES.get(path)
            if choices and values[name] not in choices:
                raise ConfigError(f"{path}: must be one of {list(choices)}, got {values[name]!r}")
    return cls(**values)


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {} if child is None else child
            if not isinstance(child, dict):
                raise ConfigError(f"--set {dotted}: {part!r} is not a section")
            node[part] = child
        node = child
    node[parts[-1]] = value


def _environment_overrides(tree: dict, environ: Mapping[str, str]) -> None:
    def number(key: str, kind: type) -> Any:
        try:
            return kind(environ[key])
        except ValueError:
            raise ConfigError(f"environment variable {key}={environ[key]!r} must be a {kind.__name__}") from None

    if environ.get("DATASETS_PATH") or environ.get("DATASETS"):
        base = Path(environ.get("DATASETS_PATH", "."))
        sub = environ.get("DATASETS") or tree.get("data", {}).get("root") or ""
        _set_path(tree, "data.root", str(base / sub))
    if environ.get("WORKSPACE"):
        _set_path(tree, "workspace", environ["WORKSPACE"])
    if environ.get("EPOCHS"):
        _set_path(tree, "train.epochs", number("EPOCHS", int))
    if environ.get("LR"):
        _set_path(tree, "optim.lr", number("LR", float))
    if environ.get("WORKER_PER_NODE"):
        _set_path(tree, "data.workers", number("WORKER_PER_NODE", int))
    if environ.get("BATCH_SIZE"):
        batch = number("BATCH_SIZE", int)
        sampler = tree.setdefault("sampler", {})
        name = sampler.get("name", "balanced")
        args = dict(sampler.get("args") or SamplerConfig().args)
        if name == "triplet":
            if batch % 3:
                raise ConfigError(f"environment variable BATCH_SIZE={batch} must be a multiple of 3 for the triplet sampler")
            args["triplets_per_batch"] = batch // 3
        else:
            k = int(args.get("samples_per_class", 4))
            if batch % k:
                raise ConfigError(
                    f"environment variable BATCH_SIZE={batch} must be a multiple of sampler.args.samples_per_class={k}"
                )
            args["classes_per_batch"] = batch // k
        sampler["args"] = args


def parse_override(text: str) -> tuple[str, Any]:
    """``key.path=value`` with the value parsed as YAML (numbers, booleans, lists)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"--set expects key=value, got {text!r}")
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Load a RunConfig from YAML, then environment variables, then ``--set`` overrides."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        with open(path, encoding="utf-8") as handle:
            try:
                tree = yaml.safe_load(handle) or {}
            except yaml.YAMLError as error:
                raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
    _environment_overrides(tree, os.environ if environ is None else environ)
    for text in overrides:
        key, value = parse_override(text)
        _set_path(tree, key, value)
    config = _build(RunConfig, tree, "")
    _validate(config)
    return config


def _validate(config: RunConfig) -> None:
    def positive(path: str, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{path}: must be a positive integer, got {value!r}")

    positive("train.epochs", config.train.epochs)
    positive("train.backward_passes_per_step", config.train.backward_passes_per_step)
    positive("train.eval_every", config.train.eval_every)
    positive("train.threads", config.train.threads)
    positive("model.width", config.model.width)
    positive("model.embedding_dim", config.model.embedding_dim)
    positive("data.image_size", config.data.image_size)
    if not config.model.depth or any(d < 1 for d in config.model.depth):
        raise ConfigError(f"model.depth: must be a non-empty list of positive integers, got {list(config.model.depth)!r}")
    if not 0.0 < config.data.test_fraction < 1.0:
        raise ConfigError(f"data.test_fraction: must be in (0, 1), got {config.data.test_fraction!r}")
    if config.data.workers < 0:
        raise ConfigError(f"data.workers: must be >= 0, got {config.data.workers!r}")
    if config.optim.lr <= 0:
        raise ConfigError(f"optim.lr: must be positive, got {config.optim.lr!r}")
    if config.batch_size < 1:
        raise ConfigError(f"sampler.args: a batch needs positive sizes, got {dict(config.sampler.args)!r}")
    if config.sampler.name == "triplet" and config.loss.name != "triplet":
        raise ConfigError(f"loss.name: the triplet sampler needs loss 'triplet', got {config.loss.name!r}")
    if config.sampler.name == "balanced" and config.loss.name == "triplet":
        raise ConfigError("loss.name: 'triplet' needs sampler.name 'triplet'")

"""The metric-learning trainer, in sub-packages by role.

``train/retrieval.py`` is the command-line script; ``pksampler.train.main(config)``
(:func:`pksampler.train.run_setup.main`) runs a configured job and
``pksampler.train.train(config, backend)`` trains on a given backend;
``pksampler.train.load_config`` reads a YAML file with the environment and
``--set`` overrides; ``pksampler.train.HookBase`` is the hook interface.
Horovod is imported only when its backend is chosen.

Sub-packages, imports running one way (``tests/packaging/test_layering.py``)::

    errors      ConfigError, below everything
    config      schema, rules, loader, agreement checks, the registry of choices
    modeling    backbones, pretrained weights, necks          (-> config)
    losses      pair losses, cross-batch memory, mining       (-> config)
    runtime     comm backends, device, workspace, loader      (-> config)
    evaluation  metrics, held-out evaluator, gallery          (-> runtime)
    engine      Trainer + HookBase, hooks, events, checkpoints, writers, elastic
    solver      optimizer, schedule, fine-tuning              (-> engine, modeling)
    run_setup, builders, retrieval.py: the application, which knows the config and everything else

The configuration's choice lists (backbones, norms, losses, data sources,
samplers, optimizers) are registered here, by the application, from the
modules that implement them, and are read only when a config is validated.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable

from pksampler.train.config import choices as _choices
from pksampler.train.evaluation.metrics import knn_search, retrieval_metrics
from pksampler.train.evaluation.render import save_gallery_png

__all__ = ["HookBase", "knn_search", "load_config", "main", "retrieval_metrics", "save_gallery_png", "train"]


def _names(module: str, attribute: str) -> Callable[[], Iterable[str]]:
    """A provider reading ``module.attribute`` (a collection of names, or a function returning them) when asked."""

    def provide() -> Iterable[str]:
        value = getattr(importlib.import_module(module), attribute)
        return value() if callable(value) else value

    return provide


def _check_effective_lr(value: Any) -> None:
    from pksampler.train.solver.build import check_learning_rate

    check_learning_rate(value)


def _check_augment(value: Any) -> None:
    from pksampler.datasets import BatchAugment

    BatchAugment(8, **value)


for _kind, _module, _attribute in (
    ("data", "pksampler.train.builders", "DATA_SOURCES"),
    ("sampler", "pksampler.train.builders", "SAMPLERS"),
    ("optimizer", "pksampler.train.solver.build", "OPTIMIZERS"),
    ("lr_scaling", "pksampler.train.solver.build", "SCALING_RULES"),
    ("norm", "pksampler.train.modeling.model", "NORM_CHOICES"),
    ("backbone", "pksampler.train.modeling.model", "BACKBONES"),
    ("pooling", "pksampler.train.modeling.model", "POOLINGS"),
    ("neck", "pksampler.train.modeling.model", "NECKS"),
    ("loss", "pksampler.train.losses.pair", "loss_names"),
    ("head", "pksampler.train.modeling.sharded_head", "HEADS"),
):
    _choices.register(_kind, _names(_module, _attribute))
_choices.register_check("augment", _check_augment)
_choices.register_check("effective_lr", _check_effective_lr)
_choices.register_arguments("data", _names("pksampler.train.builders", "DATA_ARGS"))
_choices.register_arguments("sampler", _names("pksampler.train.builders", "SAMPLER_ARGS"))


def __getattr__(name: str) -> Any:
    """The application layer and the loop load on first use, so ``import pksampler.train`` stays light."""
    if name in ("train", "main"):
        from pksampler.train.run_setup import main, train

        return {"train": train, "main": main}[name]
    if name == "load_config":
        from pksampler.train.config.load import load_config

        return load_config
    if name == "HookBase":
        from pksampler.train.engine.trainer import HookBase

        return HookBase
    raise AttributeError(f"module 'pksampler.train' has no attribute {name!r}")

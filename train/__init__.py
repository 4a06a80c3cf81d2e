"""The metric-learning trainer: configuration, model, losses, backends, evaluation and the loop.

``train/retrieval.py`` is the command-line script; ``pksampler.train.main(config)``
(:func:`pksampler.train.run_setup.main`) runs a configured job and
``pksampler.train.train(config, backend)`` trains on a given backend. Horovod
is imported only when its backend is chosen.

Layers, imports running one way: the library (``pksampler``, samplers,
datasets) <- the loop (:mod:`.trainer` with ``HookBase``, :mod:`.hooks`,
:mod:`.events`) <- the application (:mod:`.run_setup`, :mod:`.builders`, the
config modules).
"""

from __future__ import annotations

from typing import Any

from .metrics import knn_search, retrieval_metrics
from .render import save_gallery_png

__all__ = ["knn_search", "main", "retrieval_metrics", "save_gallery_png", "train"]


def __getattr__(name: str) -> Any:
    """``train`` and ``main`` load the application layer on first use, so ``import pksampler.train`` stays light."""
    if name in ("train", "main"):
        from .run_setup import main, train

        return {"train": train, "main": main}[name]
    raise AttributeError(f"module 'pksampler.train' has no attribute {name!r}")

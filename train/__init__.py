"""The metric-learning trainer: configuration, model, losses, backends, evaluation and the loop.

``train/retrieval.py`` is the command-line script; ``pksampler.train.trainer.main(config)``
runs a configured job. Horovod is imported only when its backend is chosen.
"""

from __future__ import annotations

from .evaluate import knn_search, retrieval_metrics, save_gallery_png

__all__ = ["knn_search", "retrieval_metrics", "save_gallery_png"]

"""Evaluation API, kept importable where it always was.

The code lives in two modules: :mod:`pksampler.train.metrics` (faiss
retrieval metrics and k-NN search, exact ties) and
:mod:`pksampler.train.render` (the result gallery PNG). This module only
re-exports their public names so ``from pksampler.train.evaluate import
retrieval_metrics`` keeps working.
"""

from __future__ import annotations

from .metrics import METRICS, RetrievalResult, evaluate_retrieval, knn_search, retrieval_metrics
from .render import save_gallery_png

__all__ = ["METRICS", "RetrievalResult", "evaluate_retrieval", "knn_search", "retrieval_metrics", "save_gallery_png"]

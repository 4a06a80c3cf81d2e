"""Retrieval evaluation: faiss k-NN metrics (pure functions, :mod:`.metrics`), the search of a gallery
split over the ranks, each holding a share (:mod:`.shard_search`, :mod:`.sharded`; :func:`sharded_retrieval` is
the entry point for users' own loops), the query sample (:mod:`.queries`), the held-out evaluator that
embeds on every rank (:mod:`.heldout`) and the gallery picture (:mod:`.render`).
"""

from __future__ import annotations

from pksampler.train.evaluation.metrics import RetrievalResult, evaluate_retrieval, knn_search, retrieval_metrics
from pksampler.train.evaluation.queries import recall_standard_error, stratified_queries
from pksampler.train.evaluation.sharded import ShardedResult, sharded_retrieval

__all__ = ["RetrievalResult", "ShardedResult", "evaluate_retrieval", "knn_search", "recall_standard_error",
           "retrieval_metrics", "sharded_retrieval", "stratified_queries"]

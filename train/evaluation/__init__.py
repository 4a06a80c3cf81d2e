"""Retrieval evaluation: faiss k-NN metrics (pure functions, :mod:`.metrics`), the held-out
evaluator that embeds on every rank (:mod:`.heldout`) and the gallery picture (:mod:`.render`).
"""

from __future__ import annotations

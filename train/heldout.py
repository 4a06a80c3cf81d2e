"""Embedding a dataset across ranks, and the held-out retrieval evaluation the trainer runs.

Every rank embeds a strided share of the items on its device; the shares are
all-gathered and faiss runs on a host copy on rank 0, which also renders the
result gallery from the neighbours that evaluation already found.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from pksampler.datasets import LabelledSubset

from .distributed import Backend
from .metrics import evaluate_retrieval
from .render import save_gallery_png

__all__ = ["HeldOutEvaluator", "embed"]


def embed(model: torch.nn.Module, dataset: LabelledSubset, backend: Backend, batch_size: int = 128,
          workers: int = 0) -> np.ndarray:
    """Embeddings of every item of ``dataset`` (float32, host memory), the same on every rank."""
    setup = backend.setup
    count = len(dataset)
    per_rank = -(-count // backend.size)
    mine = np.arange(backend.rank, count, backend.size)
    mine = np.concatenate([mine, np.full(per_rank - mine.size, mine[-1] if mine.size else 0)]).astype(np.int64)
    loader = DataLoader(Subset(dataset, mine.tolist()), batch_size=batch_size, num_workers=workers,
                        pin_memory=setup.pin_memory)
    parts = []
    model.eval()
    with torch.no_grad():
        for images, _ in loader:
            with setup.autocast():
                parts.append(model(setup.to_device(images)).float())
    local = torch.cat(parts) if parts else torch.zeros(0, 1, device=setup.device)
    gathered = backend.allgather(local).cpu().numpy()  # (W * per_rank, D): rank-major
    order = np.arange(backend.size)[:, None] + backend.size * np.arange(per_rank)[None, :]
    result = np.empty((count, gathered.shape[1]), dtype=np.float32)
    valid = order < count
    result[order[valid]] = gathered.reshape(backend.size, per_rank, -1)[valid]
    return result


class HeldOutEvaluator:
    """Recall@K, MAP@R etc. on held-out classes and a result gallery PNG per call (the hook records them)."""

    def __init__(self, model: torch.nn.Module, dataset, test_set: LabelledSubset, backend: Backend, *,
                 galleries: Path, gallery_queries: int) -> None:
        self.model, self.dataset, self.test_set, self.backend = model, dataset, test_set, backend
        self.galleries, self.gallery_queries = galleries, gallery_queries
        self.last_gallery: Path | None = None

    def __call__(self, epoch: int, global_step: int = 0) -> dict[str, float]:
        embeddings = embed(self.model, self.test_set, self.backend)
        if self.backend.rank != 0:
            return {}
        labels = self.test_set.labels
        queries = np.unique(np.linspace(0, len(labels) - 1, num=min(self.gallery_queries, len(labels))).astype(int))
        result = evaluate_retrieval(embeddings, labels, ks=(1, 5, 10), neighbour_rows=queries, num_neighbours=5)
        metrics = result.metrics
        print(f"[pksampler] epoch {epoch}: " + " ".join(
            f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float)), flush=True)
        self.last_gallery = self._gallery(epoch, queries, result, metrics)
        return metrics

    def _gallery(self, epoch: int, queries: np.ndarray, result, metrics: dict) -> Path:
        labels, parent = self.test_set.labels, self.test_set.indices
        neighbours = result.neighbours
        correct = labels[neighbours] == labels[queries][:, None]
        title = (f"epoch {epoch}: held-out classes, Recall@1 {metrics['recall_at_1']:.3f}, "
                 f"MAP@R {metrics.get('map_at_r', float('nan')):.3f}")
        return save_gallery_png(
            self.galleries / f"epoch_{epoch:03d}.png",
            [self.dataset.load(int(parent[q])) for q in queries],
            [[self.dataset.load(int(parent[n])) for n in row] for row in neighbours],
            correct, similarities=result.similarities, title=title,
        )

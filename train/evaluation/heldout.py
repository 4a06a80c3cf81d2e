"""Embedding a dataset across ranks, and the held-out retrieval evaluation the trainer runs.

Every rank embeds a strided share of the items on its device; the shares are
all-gathered and faiss runs on a host copy on rank 0, which also renders the
result gallery from the neighbours that evaluation already found.

Unreadable held-out images are left out of the evaluation, never replaced:
a replacement by another image of the class would be its own nearest
neighbour and inflate Recall@K. They are named on stderr, counted in the
``eval`` record (``num_unreadable``) and held to ``data.max_bad_fraction``
like the training images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import sys

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset

from pksampler.datasets import ImageLoadError, LabelledSubset
from pksampler.datasets.transforms import apply_transform, sample_rng

from pksampler.train.runtime.distributed import Backend
from pksampler.train.runtime.loader import worker_context, to_model_input
from pksampler.train.evaluation.metrics import evaluate_retrieval
from pksampler.train.evaluation.render import save_gallery_png
from pksampler.train.errors import ConfigError

__all__ = ["HeldOutEvaluator", "embed"]


def embed(model: torch.nn.Module, dataset: LabelledSubset, backend: Backend, batch_size: int = 128,
          workers: int = 0, *, view: Callable[[torch.Tensor], torch.Tensor] | None = None) -> np.ndarray:
    """Embeddings of every item of ``dataset`` (float32, host memory), the same on every rank.

    With ``view`` (e.g. :class:`~pksampler.datasets.CenterView`) the dataset
    yields uint8 images and ``view`` makes the model's input on the device;
    without it the batches already are the model's input.
    """
    setup = backend.setup
    count = len(dataset)
    per_rank = -(-count // backend.size)
    mine = np.arange(backend.rank, count, backend.size)
    mine = np.concatenate([mine, np.full(per_rank - mine.size, mine[-1] if mine.size else 0)]).astype(np.int64)
    loader = DataLoader(Subset(dataset, mine.tolist()), batch_size=batch_size, num_workers=workers,
                        pin_memory=setup.pin_memory, multiprocessing_context=worker_context(dataset, workers))
    parts = []
    model.eval()
    with torch.no_grad():
        for images, _ in loader:
            inputs = setup.to_device(images) if view is None else to_model_input(images, setup, view)
            with setup.autocast():
                parts.append(model(inputs).float())
    local = torch.cat(parts) if parts else torch.zeros(0, 1, device=setup.device)
    gathered = backend.allgather(local).cpu().numpy()  # (W * per_rank, D): rank-major
    order = np.arange(backend.size)[:, None] + backend.size * np.arange(per_rank)[None, :]
    result = np.empty((count, gathered.shape[1]), dtype=np.float32)
    valid = order < count
    result[order[valid]] = gathered.reshape(backend.size, per_rank, -1)[valid]
    return result


class _FlagUnreadable(Dataset):
    """Held-out items loaded with ``on_bad="raise"``: an unreadable one gives a blank image and sets its flag.

    The flags live in shared memory, so DataLoader workers set them too. Each
    unreadable item is named on stderr once per process (``reported`` is kept
    across evaluations).
    """

    def __init__(self, test_set: LabelledSubset, reported: set[int]) -> None:
        self.reported = reported
        parent = getattr(test_set, "dataset", test_set)
        indices = getattr(test_set, "indices", np.arange(len(test_set)))
        self.items = LabelledSubset(parent, indices, transform=test_set.transform, on_bad="raise")
        self.items.set_epoch(test_set.epoch)
        self.labels = test_set.labels
        self.unreadable = torch.zeros(len(test_set), dtype=torch.bool).share_memory_()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        try:
            return self.items[index]
        except ImageLoadError as error:
            if index not in self.reported:
                self.reported.add(index)
                print(f"pksampler: held-out image left out of the evaluation: {error}", file=sys.stderr, flush=True)
            self.unreadable[index] = True
            blank = apply_transform(self.items.transform, Image.new("RGB", (64, 64)),
                                    sample_rng(self.items.seed, self.items.epoch, index))
            return blank, int(self.labels[index])


def _flagged_on_any_rank(backend: Backend, flags: np.ndarray) -> np.ndarray:
    """The OR of every rank's boolean ``flags`` (sent as packed bits)."""
    if backend.size == 1:
        return flags
    packed = np.packbits(flags)
    words = np.zeros(-(-max(packed.size, 1) // 8) * 8, dtype=np.uint8)
    words[:packed.size] = packed
    rows = backend.allgather_numpy(words.view(np.int64))
    merged = np.bitwise_or.reduce(rows, axis=0).astype(np.int64).view(np.uint8)[:packed.size]
    return np.unpackbits(merged, count=flags.size).astype(bool)


class HeldOutEvaluator:
    """Recall@K, MAP@R etc. on held-out classes and a result gallery PNG per call (the hook records them).

    Unreadable held-out images are left out and counted (``num_unreadable``);
    more than ``max_bad_fraction`` of them is a ConfigError on every rank.
    """

    def __init__(self, model: torch.nn.Module, dataset, test_set: LabelledSubset, backend: Backend, *,
                 galleries: Path, gallery_queries: int, max_bad_fraction: float = 0.001,
                 view: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.model, self.dataset, self.test_set, self.backend = model, dataset, test_set, backend
        self.galleries, self.gallery_queries = galleries, gallery_queries
        self.max_bad_fraction = max_bad_fraction
        self.view = view
        self._reported: set[int] = set()
        self.last_gallery: Path | None = None

    def _readable_embeddings(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Embeddings of the readable held-out items and their positions; unreadable ones counted and checked."""
        flagged = _FlagUnreadable(self.test_set, self._reported)
        embeddings = embed(self.model, flagged, self.backend, view=self.view)
        unreadable = _flagged_on_any_rank(self.backend, flagged.unreadable.numpy())
        bad, total = int(unreadable.sum()), int(unreadable.size)
        if bad > self.max_bad_fraction * total or bad == total:
            raise ConfigError(f"data.max_bad_fraction: {bad} of {total} held-out images ({bad / max(total, 1):.2%}) "
                              f"could not be decoded at the evaluation of epoch {epoch}, more than the allowed "
                              f"{self.max_bad_fraction:.2%}: the data looks broken (paths above); fix it or raise "
                              "data.max_bad_fraction")
        keep = np.flatnonzero(~unreadable)
        return embeddings[keep], keep

    def __call__(self, epoch: int, global_step: int = 0) -> dict[str, float]:
        embeddings, keep = self._readable_embeddings(epoch)
        if self.backend.rank != 0:
            return {}
        labels = self.test_set.labels[keep]
        queries = np.unique(np.linspace(0, len(labels) - 1, num=min(self.gallery_queries, len(labels))).astype(int))
        result = evaluate_retrieval(embeddings, labels, ks=(1, 5, 10), neighbour_rows=queries, num_neighbours=5)
        metrics = {**result.metrics, "num_unreadable": int(len(self.test_set) - keep.size)}
        print(f"[pksampler] epoch {epoch}: " + " ".join(
            f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float)), flush=True)
        self.last_gallery = self._gallery(epoch, queries, result, metrics, keep)
        return metrics

    def _gallery(self, epoch: int, queries: np.ndarray, result, metrics: dict, keep: np.ndarray) -> Path:
        labels, parent = self.test_set.labels[keep], self.test_set.indices[keep]
        neighbours = result.neighbours
        correct = labels[neighbours] == labels[queries][:, None]
        title = (f"epoch {epoch}: held-out classes, Recall@1 {metrics['recall_at_1']:.3f}, "
                 f"MAP@R {metrics.get('map_at_r', float('nan')):.3f}")
        return save_gallery_png(
            self.galleries / f"epoch_{epoch:03d}.png",
            [self._tile(int(parent[q])) for q in queries],
            [[self._tile(int(parent[n])) for n in row] for row in neighbours],
            correct, similarities=result.similarities, title=title,
        )

    def _tile(self, index: int) -> Image.Image:
        """The image of dataset item ``index`` for the gallery; grey if it cannot be decoded now."""
        try:
            return self.dataset.load(index)
        except ImageLoadError:
            return Image.new("RGB", (32, 32), (128, 128, 128))

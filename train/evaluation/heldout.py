"""Embedding a dataset across ranks, and the held-out retrieval evaluation the trainer runs.

Every rank embeds a strided share of the held-out items on its device and
keeps it: the gallery stays spread over the ranks, and each rank searches its
own share for every query (:func:`~.sharded.sharded_retrieval`); only the
queries and each rank's top-k lists travel. The queries are every held-out
item up to ``eval.queries``, above it a fixed class-stratified sample
(:func:`~.queries.stratified_queries`). Rank 0 renders the result gallery,
loading each neighbour's image by its global id.

Unreadable held-out images are left out of the evaluation, never replaced:
a replacement by another image of the class would be its own nearest
neighbour and inflate Recall@K. They are named on stderr, counted in the
``eval`` record (``num_unreadable``) and held to ``data.max_bad_fraction``
like the training images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import sys

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset

from pksampler.datasets import ImageLoadError, LabelledSubset
from pksampler.datasets.transforms import apply_transform, sample_rng

from pksampler.train.runtime.distributed import Backend
from pksampler.train.runtime.loader import worker_context, to_model_input
from pksampler.train.evaluation.collapse import sampled_collapse_metrics
from pksampler.train.evaluation.queries import stratified_queries
from pksampler.train.evaluation.sharded import ShardedResult, sharded_retrieval
from pksampler.train.evaluation.render import save_gallery_png
from pksampler.train.errors import ConfigError

__all__ = ["HeldOutEvaluator", "embed", "embed_rows", "embed_share"]


def embed_rows(model: torch.nn.Module, dataset, rows: np.ndarray, backend: Backend, batch_size: int, workers: int,
                view: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """The model's float32 embeddings of ``dataset[rows]``, on the rank's device."""
    setup = backend.setup
    loader = DataLoader(Subset(dataset, rows.tolist()), batch_size=batch_size, num_workers=workers,
                        pin_memory=setup.pin_memory, multiprocessing_context=worker_context(dataset, workers))
    parts = []
    model.eval()
    with torch.no_grad():
        for images, _ in loader:
            inputs = setup.to_device(images) if view is None else to_model_input(images, setup, view)
            with setup.autocast():
                parts.append(model(inputs).float())
    return torch.cat(parts) if parts else torch.zeros(0, 1, device=setup.device)


def embed(model: torch.nn.Module, dataset: LabelledSubset, backend: Backend, batch_size: int = 128,
          workers: int = 0, *, view: Callable[[torch.Tensor], torch.Tensor] | None = None) -> np.ndarray:
    """Embeddings of every item of ``dataset`` (float32, host memory), the same on every rank.

    With ``view`` (e.g. :class:`~pksampler.datasets.CenterView`) the dataset
    yields uint8 images and ``view`` makes the model's input on the device;
    without it the batches already are the model's input.
    """
    count = len(dataset)
    per_rank = -(-count // backend.size)
    mine = np.arange(backend.rank, count, backend.size)
    mine = np.concatenate([mine, np.full(per_rank - mine.size, mine[-1] if mine.size else 0)]).astype(np.int64)
    local = embed_rows(model, dataset, mine, backend, batch_size, workers, view)
    gathered = backend.allgather(local).cpu().numpy()  # (W * per_rank, D): rank-major
    order = np.arange(backend.size)[:, None] + backend.size * np.arange(per_rank)[None, :]
    result = np.empty((count, gathered.shape[1]), dtype=np.float32)
    valid = order < count
    result[order[valid]] = gathered.reshape(backend.size, per_rank, -1)[valid]
    return result


def embed_share(model: torch.nn.Module, dataset, backend: Backend, batch_size: int = 128, workers: int = 0, *,
                view: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """This rank's share of the embeddings, kept here: items ``rank, rank + W, ...`` and their positions.

    No embedding is gathered: at catalogue scale no rank holds every one. A
    rank whose share is empty (fewer items than ranks) gets ``(0, D)`` with
    the model's embedding dimension D, which the ranks agree on in one small
    collective (call this on every rank).
    """
    mine = np.arange(backend.rank, len(dataset), backend.size, dtype=np.int64)
    local = embed_rows(model, dataset, mine, backend, batch_size, workers, view).cpu().numpy()
    local = local.reshape(mine.size, -1) if mine.size else local
    if backend.size > 1:  # an empty share has no row to tell D: take it from the ranks that embedded some
        dims = backend.allgather_numpy(np.array([local.shape[1] if mine.size else -1], dtype=np.int64))[:, 0]
        if not mine.size:
            local = np.zeros((0, max(int(dims.max()), 0)), dtype=np.float32)
    return local, mine


class _FlagUnreadable(Dataset):
    """Held-out items loaded with ``on_bad="raise"``: an unreadable one gives a blank image and sets its flag.

    The flags live in shared memory, so DataLoader workers set them too. Each
    unreadable item is named on stderr once per process (``reported`` is kept
    across evaluations).
    """

    def __init__(self, test_set: LabelledSubset, reported: set[int]) -> None:
        self.reported = reported
        self.items = LabelledSubset(test_set.dataset, test_set.indices, transform=test_set.transform, on_bad="raise")
        self.items.set_epoch(test_set.epoch)
        self.labels = test_set.labels
        self.unreadable = torch.zeros(len(test_set), dtype=torch.bool).share_memory_()

    def __len__(self) -> int:
        return len(self.items)

    @property
    def worker_start_method(self) -> str | None:
        """The held-out data's (DataLoader workers over an object store are spawned)."""
        return self.items.worker_start_method

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

    The gallery is split over the ranks (each keeps the embeddings it
    computed); at most ``queries`` of the held-out items are queries, a fixed
    class-stratified sample keyed by ``seed`` above that; ``search`` picks exact
    or IVF search (:func:`~.sharded.sharded_retrieval`'s ``index``, ``nprobe``,
    ``check_queries``). Unreadable held-out
    images are left out and counted (``num_unreadable``); more than
    ``max_bad_fraction`` of them is a ConfigError on every rank.
    """

    def __init__(self, model: torch.nn.Module, dataset, test_set: LabelledSubset, backend: Backend, *,
                 galleries: Path, gallery_queries: int, queries: int = 100_000, seed: int = 0,
                 search: dict[str, Any] | None = None, max_bad_fraction: float = 0.001,
                 view: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.model, self.dataset, self.test_set, self.backend = model, dataset, test_set, backend
        self.galleries, self.gallery_queries = galleries, gallery_queries
        self.queries, self.seed = queries, seed
        self.search = dict(search or {})  # index / nprobe / check_queries for sharded_retrieval
        self.max_bad_fraction = max_bad_fraction
        self.view = view
        self._reported: set[int] = set()
        self.last_gallery: Path | None = None

    def _readable_share(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This rank's readable embeddings and their positions, and every readable position (all ranks)."""
        flagged = _FlagUnreadable(self.test_set, self._reported)
        local, mine = embed_share(self.model, flagged, self.backend, view=self.view)
        unreadable = _flagged_on_any_rank(self.backend, flagged.unreadable.numpy())
        bad, total = int(unreadable.sum()), int(unreadable.size)
        if bad > self.max_bad_fraction * total or bad == total:
            raise ConfigError(f"data.max_bad_fraction: {bad} of {total} held-out images ({bad / max(total, 1):.2%}) "
                              f"could not be decoded at the evaluation of epoch {epoch}, more than the allowed "
                              f"{self.max_bad_fraction:.2%}: the data looks broken (paths above); fix it or raise "
                              "data.max_bad_fraction")
        keep = ~unreadable[mine]
        return local[keep], mine[keep], np.flatnonzero(~unreadable)

    def __call__(self, epoch: int, global_step: int = 0) -> dict[str, float]:
        local, mine, readable = self._readable_share(epoch)
        labels = np.asarray(self.test_set.labels)
        query_ids = readable[stratified_queries(labels[readable], self.queries, seed=self.seed)]
        shown = query_ids[np.unique(np.linspace(0, query_ids.size - 1,
                                                num=min(self.gallery_queries, query_ids.size)).astype(int))]
        result = sharded_retrieval(local, labels[mine], mine, query_ids=query_ids, ks=(1, 5, 10),
                                   neighbour_ids=shown, num_neighbours=5, seed=self.seed, collectives=self.backend,
                                   **self.search)
        collapse = sampled_collapse_metrics(local, mine, readable, labels, self.backend, seed=self.seed)
        if self.backend.rank != 0:
            return {}
        metrics = {**result.metrics, **collapse, "num_unreadable": int(len(self.test_set) - readable.size)}
        print(f"[pksampler] epoch {epoch}: " + " ".join(
            f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float)), flush=True)
        self.last_gallery = self._gallery(epoch, result, metrics)
        return metrics

    def _gallery(self, epoch: int, result: ShardedResult, metrics: dict) -> Path:
        """The shown queries and their neighbours, each image loaded by its global id (a held-out position)."""
        labels, parent = np.asarray(self.test_set.labels), self.test_set.indices
        queries, neighbours = result.rows, result.neighbours
        correct = (neighbours >= 0) & (labels[np.maximum(neighbours, 0)] == labels[queries][:, None])
        title = (f"epoch {epoch}: held-out classes, Recall@1 {metrics['recall_at_1']:.3f} "
                 f"± {metrics['recall_at_1_se']:.3f}, MAP@R {metrics.get('map_at_r', float('nan')):.3f}")
        return save_gallery_png(
            self.galleries / f"epoch_{epoch:03d}.png",
            [self._tile(int(parent[q])) for q in queries],
            [[self._tile(int(parent[n])) if n >= 0 else Image.new("RGB", (32, 32), (128, 128, 128)) for n in row]
             for row in neighbours],
            correct, similarities=result.similarities, title=title,
        )

    def _tile(self, index: int) -> Image.Image:
        """The image of dataset item ``index`` for the gallery; grey if it cannot be decoded now."""
        try:
            return self.dataset.load(index)
        except ImageLoadError:
            return Image.new("RGB", (32, 32), (128, 128, 128))

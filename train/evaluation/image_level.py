"""Image-level retrieval inside the training classes: does a new photo of a product we train on find that product?

The class-disjoint evaluation (:mod:`.heldout`, the SOP protocol) measures
generalisation to classes never trained on. A catalogue also asks the other
question. ``data.heldout_images`` keeps a few images of every training class
out of training (:func:`pksampler.datasets.image_holdout`); here they are the
queries, and the gallery is the training images of the queries' classes:

* queries: a class-stratified sample of the held-out images, at most
  ``eval.queries`` (fixed at start-up, the same at every world size);
* gallery: every training image of those classes, plus the queries (each
  query's own image is left out of its list; another class's held-out image
  is a distractor like any other image of that class);
* the search is the held-out evaluation's, the gallery split over the ranks
  (:func:`~.sharded.sharded_retrieval`), so the metrics do not depend on W.

For a run continued on a grown label set (``train.init_from``), the metrics
are also reported for the classes the saved model trained on (``known``) and
the new ones (``new``): ``image_known_recall_at_1``, ``image_new_recall_at_1``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from pksampler.datasets import LabelledSubset
from pksampler.train.evaluation.heldout import HeldOutEvaluator
from pksampler.train.evaluation.queries import recall_standard_error, stratified_queries
from pksampler.train.evaluation.sharded import sharded_retrieval
from pksampler.train.runtime.distributed import Backend

__all__ = ["ImageLevelEvaluator", "image_level_items"]

#: the per-query metrics reported for each group
_REPORTED = ("recall_at_1", "recall_at_5", "map_at_r")


def image_level_items(labels: np.ndarray, train_indices: np.ndarray, heldout: np.ndarray, *, queries: int,
                      seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The evaluation's dataset indices (sorted) and the positions of its queries among them.

    ``labels``: the dataset's, by index; ``heldout``: the held-out images of the training classes.
    """
    labels = np.asarray(labels)
    chosen = heldout[stratified_queries(labels[heldout], queries, seed=seed)] if heldout.size else heldout
    gallery = train_indices[np.isin(labels[train_indices], np.unique(labels[chosen]))]
    items = np.union1d(gallery, chosen).astype(np.int64)
    return items, np.searchsorted(items, chosen).astype(np.int64)


class ImageLevelEvaluator(HeldOutEvaluator):
    """Recall@K and MAP@R of the held-out images of the training classes against their classes' training images.

    ``known``: per class code, whether the model the run continued from trained on it (``None``: no split
    into known and new). Embedding and unreadable images as :class:`~.heldout.HeldOutEvaluator`.
    """

    def __init__(self, model: torch.nn.Module, dataset, train_indices: np.ndarray, heldout: np.ndarray,
                 backend: Backend, *, transform: Callable | None, queries: int, seed: int = 0,
                 known: np.ndarray | None = None, search: dict[str, Any] | None = None,
                 max_bad_fraction: float = 0.001, view: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        items, self.query_positions = image_level_items(dataset.labels, train_indices, heldout, queries=queries,
                                                        seed=seed)
        super().__init__(model, dataset, LabelledSubset(dataset, items, transform=transform), backend,
                         galleries=None, gallery_queries=1, queries=queries, seed=seed, search=search,
                         max_bad_fraction=max_bad_fraction, view=view)
        self.known = known

    def __call__(self, epoch: int, global_step: int = 0) -> dict[str, float]:
        local, mine, readable = self._readable_share(epoch)
        labels = np.asarray(self.test_set.labels)
        query_ids = np.intersect1d(self.query_positions, readable)
        result = sharded_retrieval(local, labels[mine], mine, query_ids=query_ids, ks=(1, 5, 10), seed=self.seed,
                                   collectives=self.backend, **self.search)
        if self.backend.rank != 0:
            return {}
        metrics = {f"image_{name}": result.metrics[name] for name in (*_REPORTED, "recall_at_1_se")}
        metrics["image_num_queries"] = result.metrics["num_queries"]
        if self.known is not None:
            for group, mask in (("known", self.known), ("new", ~self.known)):
                metrics.update(_group(result, mask[result.query_labels], f"image_{group}_"))
        print(f"[pksampler] epoch {epoch}, image-level (training classes): " + " ".join(
            f"{k[len('image_'):]}={v:.4f}" for k, v in metrics.items() if isinstance(v, float)), flush=True)
        return metrics


def _group(result: Any, rows: np.ndarray, prefix: str) -> dict[str, float]:
    """The reported metrics over the queries in ``rows`` (a mask in query order), their count and R@1's error."""
    scored = rows & np.isfinite(result.per_query["recall_at_1"])
    count = int(scored.sum())
    out = {f"{prefix}{name}": float(result.per_query[name][scored].mean()) if count else float("nan")
           for name in _REPORTED}
    out[f"{prefix}recall_at_1_se"] = recall_standard_error(out[f"{prefix}recall_at_1"], count)
    out[f"{prefix}num_queries"] = count
    return out

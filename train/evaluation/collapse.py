"""Whether the embeddings have collapsed: effective rank and mean cosines of held-out embeddings.

A head that pulls every embedding onto one direction leaves Recall@1 at
chance while its loss may still move; these numbers show it at each
evaluation (a neck-less head once ended at mean cosine 0.99999 between held-out embeddings):

* ``effective_rank``: exp of the entropy of the normalised singular values
  of the embedding matrix (Roy & Vetterli 2007): D for a spread that uses
  every dimension equally, 1 for embeddings on one line;
* ``mean_cosine``, ``mean_cosine_same``, ``mean_cosine_other``: the mean
  cosine over pairs of distinct items, over pairs of one class, over pairs
  of different classes. A healthy space has same ≫ other; collapse brings
  all three to 1.

:func:`collapse_metrics` is a pure function (numpy in, numpy out);
:func:`sampled_collapse_metrics` runs it on a fixed stratified sample of at
most :data:`SAMPLE` held-out items gathered from every rank, so the cost is
bounded at any gallery size and the numbers do not depend on the world size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pksampler.train.evaluation.queries import stratified_queries

__all__ = ["COLLAPSE_KEYS", "SAMPLE", "collapse_metrics", "effective_rank", "sampled_collapse_metrics"]

#: the keys :func:`collapse_metrics` adds to an evaluation's metrics
COLLAPSE_KEYS = ("effective_rank", "mean_cosine", "mean_cosine_same", "mean_cosine_other")

#: held-out items the collapse metrics read (a stratified sample above it)
SAMPLE = 4096


def effective_rank(embeddings: np.ndarray) -> float:
    """exp(H(p)), p the singular values of ``embeddings`` (N, D) divided by their sum; 0 for an all-zero matrix."""
    x = np.asarray(embeddings, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"effective_rank(embeddings=) expects a 2-D array, got shape {x.shape}")
    singular = np.linalg.svd(x, compute_uv=False)
    total = singular.sum()
    if total <= 0:
        return 0.0
    p = singular[singular > 0] / total
    return float(np.exp(-(p * np.log(p)).sum()))


def collapse_metrics(embeddings: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Effective rank and mean cosines (all, same class, other class) of ``embeddings`` (N, D) with ``labels`` (N,).

    Rows are L2-normalised first (a zero row stays zero). Pair means are over
    distinct items (i ≠ j), computed from class sums in O(N·D): Σ_{i≠j} xᵢ·xⱼ
    = ‖Σx‖² − Σ‖x‖². A mean with no pair (one class only, singleton classes) is NaN;
    every metric is NaN when an embedding is NaN or infinite (a diverged model has no spread to measure).
    """
    x = np.asarray(embeddings, dtype=np.float64)
    labels = np.asarray(labels)
    if x.ndim != 2 or labels.shape != (x.shape[0],):
        raise ValueError(f"collapse_metrics: embeddings (N, D) and labels (N,) expected, got {x.shape} and "
                         f"{labels.shape}")
    if not np.isfinite(x).all():
        return dict.fromkeys(COLLAPSE_KEYS, float("nan"))
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)
    squares = float((x * x).sum())
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    sums = np.zeros((counts.size, x.shape[1]))
    np.add.at(sums, inverse, x)
    per_class = np.bincount(inverse, weights=(x * x).sum(axis=1), minlength=counts.size)
    total_sum = x.sum(axis=0)
    all_dot = float(total_sum @ total_sum) - squares
    same_dot = float((sums * sums).sum() - per_class.sum())
    n = x.shape[0]
    all_pairs, same_pairs = n * (n - 1), float((counts * (counts - 1)).sum())

    def mean(dot: float, pairs: float) -> float:
        return dot / pairs if pairs > 0 else float("nan")

    return {"effective_rank": effective_rank(x), "mean_cosine": mean(all_dot, all_pairs),
            "mean_cosine_same": mean(same_dot, same_pairs),
            "mean_cosine_other": mean(all_dot - same_dot, all_pairs - same_pairs)}


def sampled_collapse_metrics(local: np.ndarray | torch.Tensor, mine: np.ndarray, readable: np.ndarray, labels: np.ndarray,
                             collectives: Any, *, seed: int = 0, sample: int = SAMPLE) -> dict[str, float]:
    """:func:`collapse_metrics` of a stratified sample of the readable held-out items (a collective).

    ``local``: this rank's embeddings, at global positions ``mine``; ``readable``: every readable position (the
    same on every rank); ``labels``: the whole held-out set's. The sample is chosen by position, so every world
    size reads the same items; each rank contributes its rows of it (one all-gather, ``sample × D`` floats).
    """
    chosen = readable[stratified_queries(labels[readable], sample, seed=seed)]
    keep = np.isin(mine, chosen)
    vectors = local.detach().cpu().numpy() if isinstance(local, torch.Tensor) else np.asarray(local)
    # positions travel as a float64 column (exact below 2**53), so one all-gather carries rows and ids
    rows = np.concatenate([vectors[keep].astype(np.float64), mine[keep].astype(np.float64)[:, None]], axis=1)
    rows = torch.from_numpy(np.ascontiguousarray(rows))
    gathered = (collectives.allgather(rows) if collectives.size > 1 else rows).cpu().numpy()
    order = np.argsort(gathered[:, -1], kind="stable")
    ids = gathered[order, -1].astype(np.int64)
    return collapse_metrics(gathered[order, :-1], labels[ids])

"""Metric-learning losses on L2-normalised embeddings of a (global) batch.

All losses are means over anchors of the whole batch they are given, so with
gathered embeddings every rank computes the same value as one process with
the global batch.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch.nn import functional as F

__all__ = ["batch_hard_triplet", "build_loss", "contrastive", "multi_similarity", "triplet"]


def _distances(embeddings: torch.Tensor) -> torch.Tensor:
    """Euclidean distances, with a floor inside the square root so gradients stay finite."""
    squared = (2.0 - 2.0 * embeddings @ embeddings.T).clamp_min(0.0)
    return torch.sqrt(squared + 1e-12)


def _masks(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(labels.shape[0], dtype=torch.bool, device=labels.device)
    return same & ~eye, ~same


def batch_hard_triplet(embeddings: torch.Tensor, labels: torch.Tensor, margin: float | str = "soft") -> torch.Tensor:
    """Batch-hard triplet loss (Hermans, Beyer, Leibe 2017).

    For each anchor: its farthest positive and nearest negative in the batch;
    ``softplus(d_ap - d_an)`` for ``margin="soft"``, else ``relu(d_ap - d_an + margin)``.
    Anchors without a positive or a negative are left out.
    """
    dist = _distances(embeddings)
    positive, negative = _masks(labels)
    hardest_positive = torch.where(positive, dist, torch.zeros_like(dist)).max(dim=1).values
    hardest_negative = torch.where(negative, dist, torch.full_like(dist, float("inf"))).min(dim=1).values
    valid = positive.any(dim=1) & negative.any(dim=1)
    if not valid.any():
        return embeddings.sum() * 0.0
    gap = hardest_positive[valid] - hardest_negative[valid]
    losses = F.softplus(gap) if margin == "soft" else F.relu(gap + float(margin))
    return losses.mean()


def multi_similarity(embeddings: torch.Tensor, labels: torch.Tensor, alpha: float = 2.0, beta: float = 50.0,
                     base: float = 0.5, epsilon: float = 0.1) -> torch.Tensor:
    """Multi-similarity loss with its pair mining (Wang et al. 2019), on cosine similarities."""
    sim = embeddings @ embeddings.T
    positive, negative = _masks(labels)
    big = torch.finfo(sim.dtype).max
    min_positive = torch.where(positive, sim, torch.full_like(sim, big)).min(dim=1, keepdim=True).values
    max_negative = torch.where(negative, sim, torch.full_like(sim, -big)).max(dim=1, keepdim=True).values
    mined_negative = negative & (sim + epsilon > min_positive)
    mined_positive = positive & (sim - epsilon < max_negative)
    pos_term = torch.log1p(torch.where(mined_positive, torch.exp(-alpha * (sim - base)), torch.zeros_like(sim)).sum(1)) / alpha
    neg_term = torch.log1p(torch.where(mined_negative, torch.exp(beta * (sim - base)), torch.zeros_like(sim)).sum(1)) / beta
    valid = positive.any(dim=1) & negative.any(dim=1)
    if not valid.any():
        return embeddings.sum() * 0.0
    return (pos_term + neg_term)[valid].mean()


def contrastive(embeddings: torch.Tensor, labels: torch.Tensor, pos_margin: float = 0.0,
                neg_margin: float = 0.8) -> torch.Tensor:
    """Contrastive loss (Hadsell et al. 2006): pull positives within ``pos_margin``, push negatives past ``neg_margin``."""
    dist = _distances(embeddings)
    positive, negative = _masks(labels)
    pos = F.relu(dist - pos_margin).pow(2)[positive]
    neg = F.relu(neg_margin - dist).pow(2)[negative]
    terms = torch.cat([pos, neg])
    return terms.mean() if terms.numel() else embeddings.sum() * 0.0


def triplet(embeddings: torch.Tensor, labels: torch.Tensor, margin: float | str = 0.2) -> torch.Tensor:
    """Triplet loss on rows laid out as (anchor, positive, negative) triples."""
    if embeddings.shape[0] % 3:
        raise ValueError(f"triplet loss expects a multiple of 3 rows, got {embeddings.shape[0]}")
    a, p, n = embeddings[0::3], embeddings[1::3], embeddings[2::3]
    gap = (a - p).norm(dim=1) - (a - n).norm(dim=1)
    return (F.softplus(gap) if margin == "soft" else F.relu(gap + float(margin))).mean()


_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "batch_hard": batch_hard_triplet,
    "multi_similarity": multi_similarity,
    "contrastive": contrastive,
    "triplet": triplet,
}


def loss_names() -> tuple[str, ...]:
    """The built-in loss names (the values of ``loss.name`` besides ``pml.<Name>``)."""
    return tuple(_LOSSES)


def build_loss(name: str, args: Mapping[str, Any]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(embeddings, labels)`` for a LossConfig; unknown arguments are an error."""
    import inspect

    if name not in _LOSSES:
        raise ValueError(f"loss.name must be one of {sorted(_LOSSES)}, got {name!r}")
    function = _LOSSES[name]
    accepted = list(inspect.signature(function).parameters)[2:]
    unknown = sorted(set(args) - set(accepted))
    if unknown:
        raise ValueError(f"loss.args: unknown argument {unknown[0]!r} for loss {name!r} (accepted: {accepted})")
    arguments = dict(args)
    return lambda embeddings, labels: function(embeddings, labels, **arguments)

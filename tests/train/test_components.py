"""Model, losses and checkpoints."""

from __future__ import annotations

import pytest
import torch

from pksampler.train.losses.pair import batch_hard_triplet, build_loss, contrastive, multi_similarity, triplet
from pksampler.train.modeling.model import EmbeddingNet, norm_factory


def test_model_outputs_unit_embeddings():
    model = EmbeddingNet(width=8, depth=(1, 1), embedding_dim=12)
    out = model(torch.randn(5, 3, 24, 24))
    assert out.shape == (5, 12)
    assert torch.allclose(out.norm(dim=1), torch.ones(5), atol=1e-5)
    with pytest.raises(ValueError, match="model.norm must be one of"):
        norm_factory("layer")


def _points():
    # Two classes on the unit circle; anchor 0's farthest positive is 1, nearest negative 2.
    angles = torch.tensor([0.0, 0.5, 0.8, 2.0])
    embeddings = torch.stack([angles.cos(), angles.sin()], dim=1)
    return embeddings, torch.tensor([0, 0, 1, 1])


def test_batch_hard_triplet_hand_computed():
    x, y = _points()
    d = torch.cdist(x, x)
    expected = torch.stack([
        torch.nn.functional.relu(d[0, 1] - d[0, 2] + 0.1),
        torch.nn.functional.relu(d[1, 0] - d[1, 2] + 0.1),
        torch.nn.functional.relu(d[2, 3] - d[2, 1] + 0.1),
        torch.nn.functional.relu(d[3, 2] - d[3, 1] + 0.1),
    ]).mean()
    assert batch_hard_triplet(x, y, margin=0.1) == pytest.approx(float(expected), abs=1e-5)
    soft_expected = torch.nn.functional.softplus(torch.stack([
        d[0, 1] - d[0, 2], d[1, 0] - d[1, 2], d[2, 3] - d[2, 1], d[3, 2] - d[3, 1]])).mean()
    assert batch_hard_triplet(x, y, "soft") == pytest.approx(float(soft_expected), abs=1e-5)


def test_losses_are_finite_differentiable_and_reward_separation():
    torch.manual_seed(0)
    labels = torch.arange(8).repeat_interleave(4)
    centres = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    separated = torch.nn.functional.normalize(centres[labels] + 0.05 * torch.randn(32, 16), dim=1)
    mixed = torch.nn.functional.normalize(torch.randn(32, 16), dim=1)
    for loss in (batch_hard_triplet, multi_similarity, contrastive):
        leaf = mixed.clone().requires_grad_(True)
        value = loss(leaf, labels)
        value.backward()
        assert torch.isfinite(leaf.grad).all()
        assert loss(separated, labels) < value, loss.__name__
    rows = torch.nn.functional.normalize(torch.randn(9, 4), dim=1)
    a, p, n = rows[0::3], rows[1::3], rows[2::3]
    expected = torch.nn.functional.relu((a - p).norm(dim=1) - (a - n).norm(dim=1) + 0.2).mean()
    assert triplet(rows, torch.zeros(9), margin=0.2) == pytest.approx(float(expected), abs=1e-6)
    with pytest.raises(ValueError, match="multiple of 3"):
        triplet(rows[:8], torch.zeros(8))


def test_build_loss_rejects_unknown_arguments():
    with pytest.raises(ValueError, match=r"unknown argument 'margn' for loss 'batch_hard'"):
        build_loss("batch_hard", {"margn": 0.2})

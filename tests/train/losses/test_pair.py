"""The loss registry, pytorch-metric-learning losses and miners, and losses against references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from pksampler.train.losses.pair import (
    LOSSES,
    PML_PREFIX,
    MetricLoss,
    batch_hard_triplet,
    build_loss,
    build_miner,
    check_loss_name,
    contrastive,
    loss_names,
    multi_similarity,
    triplet,
)
from pksampler.train.losses.memory import CrossBatchMemory

PAIR_LOSSES = (batch_hard_triplet, multi_similarity, contrastive)


def _clustered(seed: int, classes: int = 6, per_class: int = 4, dim: int = 16, noise: float = 0.6):
    """Features of ``classes`` noisy clusters, labels contiguous per class (a P×K batch)."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=generator)
    labels = torch.arange(classes).repeat_interleave(per_class)
    features = centres[labels] + noise * torch.randn(classes * per_class, dim, generator=generator)
    return features, labels


# --- registry ------------------------------------------------------------------

def test_loss_names_are_the_registry_keys():
    assert loss_names() == tuple(LOSSES) == ("batch_hard", "multi_similarity", "contrastive", "triplet")
    for name in loss_names():
        check_loss_name(name)
    check_loss_name("pml.TripletMarginLoss")  # spelling only: no import needed
    with pytest.raises(ValueError, match=r"loss.name must be one of .* got 'tripplet'"):
        check_loss_name("tripplet")
    with pytest.raises(ValueError, match=r"got 'pml\.'"):
        check_loss_name("pml.")
    with pytest.raises(TypeError, match="loss.name must be a string"):
        check_loss_name(3)  # type: ignore[arg-type]


def test_builtin_loss_errors_name_the_key():
    with pytest.raises(ValueError, match=r"unknown argument 'margn' for loss 'batch_hard'"):
        build_loss("batch_hard", {"margn": 0.2})
    with pytest.raises(TypeError, match=r"loss.args must be a mapping"):
        build_loss("batch_hard", [("margin", 0.2)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"loss.miner: a miner needs a 'pml\.\*' loss"):
        build_loss("batch_hard", {}, miner={"name": "pml.MultiSimilarityMiner"})
    with pytest.raises(ValueError, match=r"loss.memory: loss 'triplet' takes no reference embeddings"):
        build_loss("triplet", {}, memory=CrossBatchMemory(size_batches=2))
    with pytest.raises(TypeError, match="memory must be a CrossBatchMemory"):
        build_loss("batch_hard", {}, memory={"size": 2})  # type: ignore[arg-type]


def test_builtin_loss_without_memory_equals_the_plain_function():
    features, labels = _clustered(0)
    embeddings = F.normalize(features, dim=1)
    loss = build_loss("multi_similarity", {"beta": 40.0})
    assert isinstance(loss, MetricLoss) and loss.parameters() == []
    assert torch.equal(loss(embeddings, labels), multi_similarity(embeddings, labels, beta=40.0))


# --- pytorch-metric-learning ---------------------------------------------------------

def test_pml_errors_name_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"loss.name 'pml.TripletMarginLos': pytorch-metric-learning has no loss "
                                         r"class 'TripletMarginLos'; choose one of \[.*'pml.TripletMarginLoss'"):
        build_loss("pml.TripletMarginLos", {})
    with pytest.raises(ValueError, match=r"loss.args \{'margn': 0.1\} do not fit pml.TripletMarginLoss: .*margn"):
        build_loss("pml.TripletMarginLoss", {"margn": 0.1})
    with pytest.raises(ValueError, match=r"loss.miner.name 'pml.MultiSimilarityMine': pytorch-metric-learning "
                                         r"has no miner class"):
        build_loss("pml.TripletMarginLoss", {}, miner={"name": "pml.MultiSimilarityMine"})
    with pytest.raises(ValueError, match=r"loss.miner.args \{'epsilonn': 0.1\} do not fit pml.MultiSimilarityMiner"):
        build_miner("pml.MultiSimilarityMiner", {"epsilonn": 0.1})
    with pytest.raises(ValueError, match=r"loss.miner.name must be 'pml.<MinerClass>'.*got 'batch_hard'"):
        build_miner("batch_hard", {})
    with pytest.raises(ValueError, match=r"loss.miner must be \{name: pml.<MinerClass>"):
        build_loss("pml.TripletMarginLoss", {}, miner={"nam": "pml.MultiSimilarityMiner"})
    with pytest.raises(ValueError, match="loss.memory: pml.FastAPLoss does not accept reference embeddings"):
        loss = build_loss("pml.FastAPLoss", {}, memory=CrossBatchMemory(size_batches=2))
        features, labels = _clustered(1)
        for _ in range(2):
            loss(F.normalize(features, dim=1), labels)


def test_pml_loss_matches_the_library_called_directly():
    from pytorch_metric_learning import losses, miners

    features, labels = _clustered(2)
    embeddings = F.normalize(features, dim=1)
    built = build_loss("pml.TripletMarginLoss", {"margin": 0.1},
                       miner={"name": "pml.MultiSimilarityMiner", "args": {"epsilon": 0.1}})
    direct_miner = miners.MultiSimilarityMiner(epsilon=0.1)
    direct = losses.TripletMarginLoss(margin=0.1)(embeddings, labels, direct_miner(embeddings, labels))
    assert torch.allclose(built(embeddings, labels), direct)
    assert repr(built).startswith("MetricLoss('pml.TripletMarginLoss'")


def _train(loss: MetricLoss, steps: int, seed: int = 0) -> list[float]:
    """A linear embedding of clustered features trained with ``loss``; the loss per step."""
    torch.manual_seed(seed)
    features, labels = _clustered(seed, classes=8, per_class=4, dim=24, noise=1.0)
    layer = torch.nn.Linear(24, 8)
    optimizer = torch.optim.SGD([*layer.parameters(), *loss.parameters()], lr=0.5)
    values = []
    for _ in range(steps):
        value = loss(F.normalize(layer(features), dim=1), labels)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
        values.append(float(value.detach()))
    return values


def test_pml_triplet_with_multi_similarity_miner_trains():
    loss = build_loss("pml.TripletMarginLoss", {"margin": 0.2},
                      miner={"name": "pml.MultiSimilarityMiner", "args": {"epsilon": 0.1}})
    values = _train(loss, steps=30)
    assert values[0] > 0.05
    assert np.mean(values[-5:]) < 0.5 * values[0], values


def test_pml_loss_with_memory_trains_and_uses_the_references():
    memory = CrossBatchMemory(size_batches=3, warmup_steps=2)
    loss = build_loss("pml.TripletMarginLoss", {"margin": 0.2},
                      miner={"name": "pml.MultiSimilarityMiner"}, memory=memory)
    values = _train(loss, steps=30)
    assert memory.steps == 30 and len(memory) == 3 * 32
    assert np.mean(values[-5:]) < 0.5 * values[0], values


def test_pml_loss_parameters_and_state_round_trip(tmp_path):
    loss = build_loss("pml.ArcFaceLoss", {"num_classes": 8, "embedding_size": 8},
                      memory=None)
    assert [p.shape for p in loss.parameters()] == [torch.Size([8, 8])]
    before = _train(loss, steps=3)
    path = tmp_path / "loss.pt"
    torch.save(loss.state_dict(), path)
    again = build_loss("pml.ArcFaceLoss", {"num_classes": 8, "embedding_size": 8})
    again.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(again.parameters()[0], loss.parameters()[0])
    assert before[-1] < before[0]


def test_pml_self_pairs_are_not_positives_with_references():
    """With references [batch; memory], anchor i must not be paired with its own copy (similarity 1)."""
    features, labels = _clustered(3)
    first = F.normalize(features, dim=1)
    alpha, beta, base = 2.0, 50.0, 0.5
    memory = CrossBatchMemory(size_items=1000)
    loss = build_loss("pml.MultiSimilarityLoss", {"alpha": alpha, "beta": beta, "base": base}, memory=memory)
    loss(first, labels)  # warm-up 0: the second call sees the first batch as references
    second = F.normalize(_clustered(4)[0], dim=1)
    with_memory = loss(second, labels)
    # By hand: each anchor of the second batch against [second; first], its own row excluded.
    refs, ref_labels = torch.cat([second, first]), torch.cat([labels, labels])
    sim = second @ refs.T
    same = labels[:, None] == ref_labels[None, :]
    itself = torch.zeros_like(same)
    itself[:, : len(labels)] = torch.eye(len(labels), dtype=torch.bool)
    positive, negative = same & ~itself, ~same
    pos = torch.log1p((torch.exp(-alpha * (sim - base)) * positive).sum(1)) / alpha
    neg = torch.log1p((torch.exp(beta * (sim - base)) * negative).sum(1)) / beta
    assert float(with_memory) == pytest.approx(float((pos + neg).mean()), rel=1e-4)


# --- built-in pair losses against references -------------------------------------------

def _batch_hard_reference(embeddings: np.ndarray, labels: np.ndarray, refs: np.ndarray, ref_labels: np.ndarray,
                          margin: float) -> float:
    """Per-anchor loop: farthest positive and nearest negative among batch (minus itself) and references."""
    others, other_labels = np.concatenate([embeddings, refs]), np.concatenate([labels, ref_labels])
    terms = []
    for i, (anchor, label) in enumerate(zip(embeddings, labels)):
        dist = np.linalg.norm(others - anchor, axis=1)
        positive = (other_labels == label) & (np.arange(len(others)) != i)
        negative = other_labels != label
        if positive.any() and negative.any():
            terms.append(max(0.0, dist[positive].max() - dist[negative].min() + margin))
    return float(np.mean(terms))


def test_batch_hard_with_references_matches_a_per_anchor_loop():
    features, labels = _clustered(5)
    ref_features, ref_labels = _clustered(6, classes=9, per_class=3)
    embeddings, refs = F.normalize(features, dim=1), F.normalize(ref_features, dim=1)
    value = batch_hard_triplet(embeddings, labels, 0.3, ref_embeddings=refs, ref_labels=ref_labels)
    expected = _batch_hard_reference(embeddings.numpy().astype(np.float64), labels.numpy(),
                                     refs.numpy().astype(np.float64), ref_labels.numpy(), 0.3)
    assert float(value) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("loss", PAIR_LOSSES, ids=lambda f: f.__name__)
def test_references_get_no_gradient_and_empty_references_change_nothing(loss):
    features, labels = _clustered(7)
    embeddings = F.normalize(features, dim=1).requires_grad_(True)
    refs = F.normalize(_clustered(8)[0], dim=1).requires_grad_(True)
    value = loss(embeddings, labels, ref_embeddings=refs, ref_labels=labels)
    value.backward()
    assert refs.grad is None and torch.isfinite(embeddings.grad).all() and embeddings.grad.abs().sum() > 0
    empty = loss(embeddings, labels, ref_embeddings=refs[:0], ref_labels=labels[:0])
    assert torch.equal(empty, loss(embeddings, labels))
    assert not torch.equal(value, empty)


@pytest.mark.parametrize("loss", PAIR_LOSSES, ids=lambda f: f.__name__)
def test_memory_adds_hard_negatives(loss):
    """A reference of another class sitting on an anchor makes the loss larger."""
    features, labels = _clustered(9, noise=0.1)
    embeddings = F.normalize(features, dim=1)
    impostors = embeddings[::4] + 0.01  # one per class, labelled as the next class
    impostor_labels = (labels[::4] + 1) % 6
    assert loss(embeddings, labels, ref_embeddings=F.normalize(impostors, dim=1),
                ref_labels=impostor_labels) > loss(embeddings, labels)


def test_reference_arguments_are_checked():
    features, labels = _clustered(10)
    embeddings = F.normalize(features, dim=1)
    with pytest.raises(ValueError, match="ref_embeddings and ref_labels must be given together"):
        contrastive(embeddings, labels, ref_embeddings=embeddings)
    with pytest.raises(ValueError, match=r"ref_embeddings must have shape \(M, 16\), got \(3, 4\)"):
        contrastive(embeddings, labels, ref_embeddings=torch.zeros(3, 4), ref_labels=torch.zeros(3))
    with pytest.raises(ValueError, match=r"ref_labels must have shape \(3,\), got \(2,\)"):
        contrastive(embeddings, labels, ref_embeddings=torch.zeros(3, 16), ref_labels=torch.zeros(2))


def test_builtin_loss_with_memory_reads_before_it_enqueues():
    """The batch is enqueued after the loss: the first call has no references, the second has the first batch."""
    features, labels = _clustered(11)
    first, second = F.normalize(features, dim=1), F.normalize(_clustered(12)[0], dim=1)
    memory = CrossBatchMemory(size_batches=1)
    loss = build_loss("batch_hard", {"margin": 0.2}, memory=memory)
    assert torch.equal(loss(first, labels), batch_hard_triplet(first, labels, 0.2))
    expected = batch_hard_triplet(second, labels, 0.2, ref_embeddings=first, ref_labels=labels)
    assert torch.equal(loss(second, labels), expected)
    refs, _ = memory.references()
    assert torch.equal(refs, second)  # size 1 batch: the newest replaced the oldest


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

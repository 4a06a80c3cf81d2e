"""Cross-batch memory: ring buffer, warm-up, state round trip, identity across world sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn import functional as F

from pksampler.train.losses.pair import build_loss
from pksampler.train.losses.memory import CrossBatchMemory, build_memory


def _batch(step: int, rows: int = 8, dim: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose first coordinate encodes (step, row), so the queue's content can be read back."""
    ids = step * 100 + torch.arange(rows, dtype=torch.float32)
    embeddings = torch.zeros(rows, dim)
    embeddings[:, 0] = ids
    return embeddings, torch.arange(rows) + step


def test_holds_the_last_batches_oldest_first():
    memory = CrossBatchMemory(size_batches=2)
    assert memory.references()[0].shape == (0, 0) and memory.capacity == 0
    for step in range(4):
        memory.enqueue(*_batch(step))
    embeddings, labels = memory.references()
    assert memory.capacity == 16 and len(memory) == 16 and memory.steps == 4
    assert embeddings[:, 0].tolist() == [200 + i for i in range(8)] + [300 + i for i in range(8)]
    assert labels.tolist() == [2 + i for i in range(8)] + [3 + i for i in range(8)]


@given(sizes=st.lists(st.integers(1, 12), min_size=1, max_size=12), capacity=st.integers(1, 20))
def test_size_items_keeps_exactly_the_newest_rows(sizes, capacity):
    memory = CrossBatchMemory(size_items=capacity)
    seen: list[float] = []
    for step, rows in enumerate(sizes):
        batch, labels = _batch(step, rows=rows)
        memory.enqueue(batch, labels)
        seen.extend(batch[:, 0].tolist())
    embeddings, labels = memory.references()
    assert embeddings[:, 0].tolist() == seen[-capacity:]
    assert len(memory) == min(capacity, len(seen)) == labels.shape[0]


def test_warmup_hides_references_until_enough_batches():
    memory = CrossBatchMemory(size_batches=3, warmup_steps=2)
    memory.enqueue(*_batch(0))
    assert not memory.active and memory.references()[0].shape == (0, 4)
    memory.enqueue(*_batch(1))
    assert memory.active and memory.references()[0].shape == (16, 4)


def test_enqueue_detaches_and_copies():
    memory = CrossBatchMemory(size_items=4)
    source = torch.randn(4, 3, requires_grad=True)
    memory.enqueue(source * 2, torch.arange(4))
    embeddings, _ = memory.references()
    assert not embeddings.requires_grad
    with torch.no_grad():
        source.zero_()
    assert embeddings.abs().sum() > 0


def test_state_round_trips_through_weights_only_load(tmp_path):
    memory = CrossBatchMemory(size_batches=2, warmup_steps=1)
    for step in range(3):  # wraps the ring: the state must come back oldest first
        memory.enqueue(*_batch(step, rows=5))
    path = tmp_path / "memory.pt"
    torch.save(memory.state_dict(), path)
    restored = CrossBatchMemory(size_batches=2, warmup_steps=1)
    restored.load_state_dict(torch.load(path, weights_only=True))
    for a, b in zip(memory.references(), restored.references()):
        assert torch.equal(a, b)
    assert (restored.steps, restored.capacity, len(restored)) == (3, 10, 10)
    # Both continue identically.
    memory.enqueue(*_batch(3, rows=5))
    restored.enqueue(*_batch(3, rows=5))
    for a, b in zip(memory.references(), restored.references()):
        assert torch.equal(a, b)
    empty = CrossBatchMemory(size_items=3)
    again = CrossBatchMemory(size_items=3)
    again.load_state_dict(empty.state_dict())
    assert len(again) == 0 and again.capacity == 0


def test_state_with_other_sizes_is_refused():
    memory = CrossBatchMemory(size_batches=2)
    memory.enqueue(*_batch(0))
    with pytest.raises(ValueError, match=r"loss.memory: the checkpoint's memory has size_batches=2, "
                                         r"the configuration size_batches=3"):
        CrossBatchMemory(size_batches=3).load_state_dict(memory.state_dict())
    with pytest.raises(ValueError, match=r"memory state has dim=4, this memory dim=8"):
        CrossBatchMemory(size_batches=2, dim=8).load_state_dict(memory.state_dict())
    with pytest.raises(ValueError, match=r"memory state is missing \['steps'\]"):
        CrossBatchMemory(size_batches=2).load_state_dict(
            {k: v for k, v in memory.state_dict().items() if k != "steps"})


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="exactly one of size_batches and size_items"):
        CrossBatchMemory(size_batches=2, size_items=3)
    with pytest.raises(ValueError, match="size_batches must be >= 1, got 0"):
        CrossBatchMemory(size_batches=0)
    with pytest.raises(TypeError, match="size_items must be an int, got bool True"):
        CrossBatchMemory(size_items=True)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1"):
        CrossBatchMemory(size_batches=1, warmup_steps=-1)
    memory = CrossBatchMemory(size_batches=1, dim=4)
    with pytest.raises(ValueError, match="embeddings have dimension 3, the memory holds dim=4"):
        memory.enqueue(torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(ValueError, match=r"labels must have shape \(2,\), got \(3,\)"):
        memory.enqueue(torch.zeros(2, 4), torch.zeros(3))


def test_build_memory_from_config():
    assert build_memory(None) is None
    memory = build_memory({"size": 4, "warmup_steps": 10})
    assert (memory.size_batches, memory.size_items, memory.warmup_steps) == (4, None, 10)
    assert build_memory({"size_items": 100}).size_items == 100
    with pytest.raises(ValueError, match="loss.memory: unknown key 'sise'"):
        build_memory({"sise": 4})
    with pytest.raises(ValueError, match="loss.memory needs exactly one of size"):
        build_memory({"warmup_steps": 4})
    with pytest.raises(ValueError, match=r"loss.memory.size must be a positive int, got 0"):
        build_memory({"size": 0})
    with pytest.raises(ValueError, match=r"loss.memory.warmup_steps must be a non-negative int, got -2"):
        build_memory({"size": 1, "warmup_steps": -2})

    class Config:  # a frozen-dataclass-like config object
        size, warmup_steps = 2, 0

    assert build_memory(Config()).size_batches == 2


def test_to_moves_buffers_and_later_allocations():
    # "meta" stands in for a GPU: a device other than the CPU that exists everywhere.
    later = CrossBatchMemory(size_batches=1).to("meta")
    later.enqueue(torch.zeros(2, 3), torch.zeros(2))
    assert later.references()[0].device.type == "meta"
    moved = CrossBatchMemory(size_batches=1)
    moved.enqueue(torch.ones(2, 3), torch.zeros(2))
    assert moved.references()[0].device.type == "cpu"
    assert moved.to("meta").references()[1].device.type == "meta"


def _model(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(12, 6)


@pytest.mark.parametrize("loss_name", ["batch_hard", "multi_similarity", "contrastive", "pml.TripletMarginLoss"])
def test_world_size_one_and_two_give_the_same_memory_and_loss(loss_name):
    """W=1 with a G-class batch vs W=2 with two G/2-class halves all-gathered: same memory, same loss.

    Each simulated rank embeds its own half with its own copy of the model and
    keeps its own memory; the "all-gather" concatenates the halves in rank
    order, as hvd.allgather does.
    """
    classes, per_class, steps = 8, 3, 6
    generator = torch.Generator().manual_seed(0)
    world = {w: {"model": _model(1), "loss": [build_loss(loss_name, {}, memory=build_memory({"size": 2}))
                                              for _ in range(w)]} for w in (1, 2)}
    for step in range(steps):
        features = torch.randn(classes * per_class, 12, generator=generator)
        labels = torch.randperm(100, generator=generator)[:classes].repeat_interleave(per_class)
        values = {}
        for w, parts in world.items():
            halves = [F.normalize(parts["model"](chunk), dim=1) for chunk in features.chunk(w)]
            gathered, gathered_labels = torch.cat(halves), torch.cat(list(labels.chunk(w)))
            values[w] = [loss(gathered, gathered_labels) for loss in parts["loss"]]
        reference = values[1][0]
        for value in values[2]:
            assert torch.allclose(value, reference, atol=1e-6), (step, value, reference)
        one = world[1]["loss"][0].memory.references()
        for loss in world[2]["loss"]:
            two = loss.memory.references()
            assert torch.allclose(two[0], one[0], atol=1e-6) and torch.equal(two[1], one[1])
        assert len(world[1]["loss"][0].memory) == min(step + 1, 2) * classes * per_class

"""DistributedTripletSampler: triple validity, rank disjointness, anchor coverage, invariance, hard negatives."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from sampler_invariants import check_anchor_coverage, check_triplet_ranks, check_triplets, make_labels

from pksampler.samplers import (
    DistributedTripletBatchSampler,
    DistributedTripletSampler,
    check_consistent,
    SamplerMismatchError,
)
from pksampler.train.losses.mining import mine_class_neighbours


@st.composite
def triplet_configs(draw: st.DrawFn, max_world: int = 16) -> dict:
    world = draw(st.integers(1, max_world))
    per_rank = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["uniform", "zipf", "small", "dominant"]))
    num_classes = draw(st.integers(2, 40))
    num_samples = draw(st.integers(world * per_rank + num_classes, 10 * (world * per_rank + num_classes)))
    labels = make_labels(kind, num_classes, num_samples, draw(st.integers(0, 2**31 - 1)))
    return {"labels": labels, "world": world, "T": per_rank, "seed": draw(st.integers(0, 1000)),
            "epoch": draw(st.integers(0, 5))}


def rank_plans(cfg: dict, world: int | None = None, per_rank: int | None = None, **kwargs) -> list[np.ndarray]:
    world = cfg["world"] if world is None else world
    per_rank = cfg["T"] if per_rank is None else per_rank
    plans = []
    for rank in range(world):
        sampler = DistributedTripletBatchSampler(cfg["labels"], per_rank, num_replicas=world, rank=rank,
                                                 seed=cfg["seed"], **kwargs)
        sampler.set_epoch(cfg["epoch"])
        batches = list(sampler)
        assert len(batches) == len(sampler)
        plans.append(np.asarray(batches, dtype=np.int64).reshape(len(batches), per_rank, 3))
    return plans


def has_enough_anchors(cfg: dict) -> bool:
    sizes = np.bincount(cfg["labels"])
    return int(sizes[sizes >= 2].sum()) >= cfg["world"] * cfg["T"]


@given(triplet_configs())
def test_triples_are_valid_and_ranks_disjoint_with_equal_lengths(cfg):
    if not has_enough_anchors(cfg):
        with pytest.raises(ValueError, match="not enough anchors"):
            rank_plans(cfg)
    else:
        plans = rank_plans(cfg)
        for plan in plans:
            check_triplets(plan, cfg["labels"])
        check_triplet_ranks(plans)


@given(triplet_configs(max_world=8))
def test_every_anchor_once_per_epoch_up_to_the_remainder(cfg):
    assume(has_enough_anchors(cfg))
    check_anchor_coverage(rank_plans(cfg), cfg["labels"], cfg["world"] * cfg["T"])


@given(triplet_configs())
def test_world_size_invariance(cfg):
    assume(has_enough_anchors(cfg))
    merged = np.concatenate(rank_plans(cfg), axis=1)
    single = rank_plans(cfg, world=1, per_rank=cfg["world"] * cfg["T"])[0]
    assert np.array_equal(merged, single)


def test_deterministic_across_processes_and_epochs():
    code = ("import numpy as np, sys; from pksampler.samplers import DistributedTripletSampler as S;"
            "s = S(np.arange(300) % 11, 4, num_replicas=3, rank=2, seed=9); s.set_epoch(4);"
            "sys.stdout.write(','.join(map(str, s)))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    sampler = DistributedTripletSampler(np.arange(300) % 11, 4, num_replicas=3, rank=2, seed=9)
    sampler.set_epoch(4)
    stream = list(sampler)
    assert out == ",".join(map(str, stream)) and len(stream) == len(sampler)
    sampler.set_epoch(5)
    assert list(sampler) != stream


def mine_into(sampler, embeddings, labels) -> np.ndarray:
    """Mine a neighbour table train-side and give it to the sampler (what the trainer's hook does)."""
    return sampler.set_class_neighbours(mine_class_neighbours(embeddings, labels, sampler.index, sampler.hard_classes))


def planted_embeddings(num_classes: int = 12, per_class: int = 20, seed: int = 0):
    """Class 1's centroid lies right next to class 0's; the others are spread out."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(num_classes, 16))
    centres[1] = centres[0] + 0.05 * rng.normal(size=16)
    labels = np.repeat(np.arange(num_classes), per_class)
    return centres[labels] + 0.01 * rng.normal(size=(labels.size, 16)), labels


def test_hard_negatives_come_from_the_nearest_class_at_the_requested_fraction():
    embeddings, labels = planted_embeddings()
    sampler = DistributedTripletBatchSampler(labels, 8, num_replicas=2, rank=0, seed=1, negatives="hard",
                                             hard_classes=1, hard_fraction=0.6)
    table = mine_into(sampler, embeddings, labels)
    assert table[0, 0] == 1 and table[1, 0] == 0
    before = np.array(list(sampler)).reshape(-1, 3)  # epoch 0: table not in force yet
    sampler.set_epoch(1)
    picks = []
    for epoch in range(1, 41):
        sampler.set_epoch(epoch)
        triples = np.array(list(sampler)).reshape(-1, 3)
        from_zero = triples[labels[triples[:, 0]] == 0]
        picks.append(labels[from_zero[:, 2]] == 1)
    picks = np.concatenate(picks)
    # Expected share: 0.6 hard + 0.4 * 1/11 random hits on class 1 = 0.636. With
    # ~2000 draws the standard error is ~0.011; allow 5 of them.
    expected = 0.6 + 0.4 / 11
    assert abs(picks.mean() - expected) < 0.055, picks.mean()
    zero_before = before[labels[before[:, 0]] == 0]
    assert (labels[zero_before[:, 2]] == 1).mean() < 0.4  # random before the update


def test_neighbour_table_is_part_of_the_consistency_fingerprint_and_state():
    embeddings, labels = planted_embeddings()
    a = DistributedTripletBatchSampler(labels, 4, num_replicas=2, rank=0, negatives="hard")
    b = DistributedTripletBatchSampler(labels, 4, num_replicas=2, rank=1, negatives="hard")
    mine_into(a, embeddings, labels)
    a.set_epoch(1)
    b.set_epoch(1)
    from pksampler.samplers import consistency_row

    rows = np.stack([consistency_row(a), consistency_row(b)])
    with pytest.raises(SamplerMismatchError, match="plan differs"):
        check_consistent(a, allgather=lambda row: rows)
    fresh = DistributedTripletBatchSampler(labels, 4, num_replicas=2, rank=0, negatives="hard")
    fresh.load_state_dict(a.state_dict())
    assert list(fresh) == list(a)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"triplets_per_batch": 0}, ValueError, r"triplets_per_batch=\) must be >= 1, got 0"),
        ({"labels": np.zeros(50, dtype=int)}, ValueError, r"needs at least 2 classes"),
        ({"negatives": "semi"}, ValueError, r"negatives=\) must be one of \['random', 'hard'\], got 'semi'"),
        ({"hard_fraction": 1.5}, ValueError, r"hard_fraction=\) must be in \[0.0, 1.0\], got 1.5"),
        ({"triplets_per_batch": 40}, ValueError, r"needs triplets_per_step = 80 anchors"),
    ],
)
def test_bad_input(kwargs, error, match):
    args = {"labels": np.arange(60) % 6, "triplets_per_batch": 2, "num_replicas": 2, "rank": 0}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        DistributedTripletSampler(**args)


def test_bad_neighbour_updates():
    embeddings, labels = planted_embeddings()
    sampler = DistributedTripletSampler(labels, 2, num_replicas=1, rank=0, negatives="hard")
    with pytest.raises(ValueError, match=r"labels the sampler does not know, e.g. \[99"):
        mine_into(sampler, embeddings, np.where(labels == 0, 99, labels))
    bad = embeddings.copy()
    bad[5, 3] = np.nan
    with pytest.raises(ValueError, match=r"contains NaN or Inf \(first in row 5\)"):
        mine_into(sampler, bad, labels)
    with pytest.raises(ValueError, match=r"labels=\) must have shape \(240,\)"):
        mine_into(sampler, embeddings, labels[:10])


# --- neighbour tables ------------------------------------------------------------


def test_set_class_neighbours_takes_a_plain_table_from_the_next_epoch():
    labels = np.repeat(np.arange(6), 10)
    sampler = DistributedTripletBatchSampler(labels, 4, num_replicas=1, rank=0, negatives="hard",
                                             hard_classes=1, hard_fraction=1.0)
    table = np.array([[1], [0], [3], [2], [5], [4]])
    sampler.set_class_neighbours(table)
    assert sampler.neighbours(0) is None and np.array_equal(sampler.neighbours(1), table)
    sampler.set_epoch(1)
    triples = np.array(list(sampler)).reshape(-1, 3)
    assert np.array_equal(labels[triples[:, 2]], table[labels[triples[:, 0]], 0])


def _tampered(table: np.ndarray) -> list:
    own, high, low = table.copy(), table.copy(), table.copy()
    own[2, 0], high[0, 1], low[0, 1] = 2, 12, -2
    return [
        (own, ValueError, r"row 2 names its own class 2"),
        (table[:, :1], ValueError, r"shape \(num_classes, hard_classes\) = \(12, 2\), got \(12, 1\)"),
        (table.astype(np.float64), TypeError, r"integer class codes, got dtype float64"),
        (high, ValueError, r"values must lie in \[-1, num_classes=12\), got \[.*12\]"),
        (low, ValueError, r"values must lie in \[-1, num_classes=12\), got \[-2"),
    ]


def test_neighbour_tables_are_validated_on_set_and_on_load():
    embeddings, labels = planted_embeddings()
    sampler = DistributedTripletBatchSampler(labels, 4, num_replicas=1, rank=0, negatives="hard", hard_classes=2)
    table = mine_into(sampler, embeddings, labels)
    for bad, error, match in _tampered(table):
        with pytest.raises(error, match=match):
            sampler.set_class_neighbours(bad)
        state = sampler.state_dict()
        state["neighbour_tables"] = [(1, bad)]
        fresh = DistributedTripletBatchSampler(labels, 4, num_replicas=1, rank=0, negatives="hard", hard_classes=2)
        with pytest.raises(error, match=match):
            fresh.load_state_dict(state)
        assert fresh.neighbours(5) is None, "a refused state was partly loaded"


@pytest.mark.parametrize("hard_classes", [12, 10**9, 2**70])
def test_hard_classes_is_bounded_by_the_number_of_other_classes(hard_classes):
    with pytest.raises(ValueError, match=r"hard_classes=\) must be at most the number of other classes, num_classes - 1 = 11"):
        DistributedTripletSampler(np.arange(120) % 12, 2, num_replicas=1, rank=0, negatives="hard", hard_classes=hard_classes)


def test_mining_is_train_side_numpy_in_numpy_out():
    from pksampler.train.losses.mining import class_neighbours

    embeddings, labels = planted_embeddings()
    table = class_neighbours(embeddings, labels, 12, 3)
    assert table.shape == (12, 3) and table.dtype == np.int64
    assert table[0, 0] == 1 and (table != np.arange(12)[:, None]).all()
    partial = class_neighbours(embeddings[labels < 3], labels[labels < 3], 12, 3)
    assert (partial[3:] == -1).all() and (partial[:3, 2] == -1).all()  # only two other classes have embeddings
    with pytest.raises(ValueError, match=r"codes=\) must lie in \[0, num_classes=12\)"):
        class_neighbours(embeddings, labels + 1, 12, 3)
    with pytest.raises(ValueError, match=r"hard_classes=\) must be an int in \[1, num_classes - 1 = 11\]"):
        class_neighbours(embeddings, labels, 12, 12)

"""Any world size: a global step's G classes (or triplets) split over W ranks as evenly as possible.

Ranks are simulated in one process by looping over ``rank``. The plan never
depends on W, so the ranks' runs, concatenated in rank order, must be the
single process's global steps at every W from 1 to G, including when W does
not divide G; a state saved at one W continues at the next global step on
another.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from sampler_invariants import (
    check_anchor_coverage,
    check_disjoint_across_ranks,
    check_even_split,
    check_rank_batches,
    check_triplet_ranks,
    check_triplets,
    split_configs,
)

from pksampler.samplers import (
    DistributedBalancedBatchSampler,
    DistributedBalancedSampler,
    DistributedTripletBatchSampler,
    DistributedTripletSampler,
    PlanOptions,
    TripletOptions,
    balanced_plan,
    check_consistent,
    group_labels,
    rank_share,
    rank_shares,
    triplet_batches,
)
from pksampler.samplers.triplet_plan import anchor_index


def balanced(cfg: dict, world: int, rank: int, form=DistributedBalancedBatchSampler, **kwargs):
    sampler = form(cfg["labels"], samples_per_class=cfg["K"], classes_per_step=cfg["G"], num_replicas=world,
                   rank=rank, seed=cfg["seed"], **kwargs)
    sampler.set_epoch(cfg["epoch"])
    return sampler


def balanced_ranks(cfg: dict, world: int) -> list[np.ndarray]:
    plans = []
    for rank in range(world):
        sampler = balanced(cfg, world, rank)
        batches = list(sampler)
        assert len(batches) == len(sampler), "__len__ differs from what __iter__ yields"
        plans.append(np.asarray(batches, dtype=np.int64).reshape(len(batches), sampler.batch_size))
    return plans


def triplet(cfg: dict, world: int, rank: int, form=DistributedTripletBatchSampler):
    sampler = form(cfg["labels"], triplets_per_step=cfg["G"], num_replicas=world, rank=rank, seed=cfg["seed"])
    sampler.set_epoch(cfg["epoch"])
    return sampler


def triplet_ranks(cfg: dict, world: int) -> list[np.ndarray]:
    plans = []
    for rank in range(world):
        sampler = triplet(cfg, world, rank)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        plans.append(np.asarray(batches, dtype=np.int64).reshape(len(batches), sampler.batch_size))
    return plans


def enough_anchors(cfg: dict) -> bool:
    sizes = np.bincount(cfg["labels"])
    return int(sizes[sizes >= 2].sum()) >= cfg["G"] and np.count_nonzero(sizes) >= 2


# --- the split itself ------------------------------------------------------------


@given(st.integers(1, 300), st.data())
def test_rank_shares_are_the_even_contiguous_split(total, data):
    world = data.draw(st.integers(1, total))
    shares = rank_shares(total, world)
    assert sum(shares) == total and max(shares) - min(shares) <= 1 and shares == sorted(shares, reverse=True)
    runs = [rank_share(total, world, rank) for rank in range(world)]
    assert [count for _, count in runs] == shares
    assert [first for first, _ in runs] == np.cumsum([0, *shares[:-1]]).tolist()
    assert list(map(list, np.array_split(np.arange(total), world))) == [list(range(f, f + c)) for f, c in runs]


# --- balanced ----------------------------------------------------------------------


@given(split_configs())
def test_balanced_uneven_split_keeps_every_guarantee(cfg):
    labels, world = cfg["labels"], cfg["world"]
    plans = balanced_ranks(cfg, world)
    for rank, batches in enumerate(plans):
        check_rank_batches(batches, labels, rank_share(cfg["G"], world, rank)[1], cfg["K"])
    check_disjoint_across_ranks(plans, labels)
    check_even_split(plans, balanced_ranks(cfg, 1)[0], cfg["K"])


@given(split_configs(max_world=8), st.data())
def test_balanced_global_steps_are_the_same_at_every_world_size(cfg, data):
    other = data.draw(st.integers(1, cfg["G"]))
    check_even_split(balanced_ranks(cfg, other), np.concatenate(balanced_ranks(cfg, cfg["world"]), axis=1), cfg["K"])


@given(split_configs(max_world=8), st.data())
def test_balanced_resume_on_any_world_size_continues_with_the_next_global_step(cfg, data):
    new_world = data.draw(st.integers(1, cfg["G"]))
    single = balanced_ranks(cfg, 1)[0]
    consumed = data.draw(st.integers(0, single.shape[0]))
    states = [balanced(cfg, cfg["world"], rank).state_dict(batches_consumed=consumed) for rank in range(cfg["world"])]
    assert all(state == states[0] for state in states[1:]), "ranks must save the same state"
    after = []
    for rank in range(new_world):
        sampler = DistributedBalancedBatchSampler(cfg["labels"], samples_per_class=cfg["K"], classes_per_step=cfg["G"],
                                                  num_replicas=new_world, rank=rank, seed=12345)
        sampler.load_state_dict(states[rank % cfg["world"]])
        after.append(np.asarray(list(sampler), dtype=np.int64).reshape(-1, sampler.batch_size))
    check_even_split(after, single[consumed:], cfg["K"])


def test_resume_from_two_ranks_on_three_takes_the_next_global_step():
    cfg = {"labels": np.arange(400) % 40, "G": 16, "K": 2, "seed": 5, "epoch": 1}
    single = balanced_ranks(cfg, 1)[0]
    two = [balanced(cfg, 2, rank) for rank in range(2)]
    iterators = [iter(sampler) for sampler in two]
    for _ in range(3):
        for iterator in iterators:
            next(iterator)
    state = two[0].state_dict()
    assert state["step"] == 3 and state == two[1].state_dict()
    three = [DistributedBalancedBatchSampler(cfg["labels"], samples_per_class=2, classes_per_step=16, num_replicas=3,
                                             rank=rank) for rank in range(3)]
    for sampler in three:
        sampler.load_state_dict(state)
    assert [s.batch_size for s in three] == [12, 10, 10] and three[0].rank_batch_sizes == (12, 10, 10)
    assert all(s.global_batch_size == 32 for s in three)
    first = np.concatenate([np.asarray(next(iter(s))) for s in three])
    np.testing.assert_array_equal(first, single[3])


def test_flat_and_batch_forms_agree_on_an_uneven_split():
    cfg = {"labels": np.arange(300) % 30, "G": 7, "K": 3, "seed": 2, "epoch": 0}
    for rank in range(3):
        flat = balanced(cfg, 3, rank, form=DistributedBalancedSampler)
        batch = balanced(cfg, 3, rank)
        stream = list(flat)
        assert flat.batch_size == (9 if rank == 0 else 6)
        assert len(stream) == len(flat) == len(batch) * flat.batch_size
        assert stream == [i for b in batch for i in b]


def test_pure_plan_splits_like_the_sampler():
    labels = np.arange(500) % 50
    for rank in range(4):
        sampler = DistributedBalancedBatchSampler(labels, samples_per_class=2, classes_per_step=10, num_replicas=4,
                                                  rank=rank, seed=3)
        plan = balanced_plan(group_labels(labels), None, 2, 4, rank, PlanOptions(seed=3), classes_per_step=10)
        np.testing.assert_array_equal(plan, np.asarray(list(sampler)))


def test_old_per_rank_form_is_the_even_case_of_the_global_form():
    labels = np.arange(300) % 30
    for rank in range(4):
        old = DistributedBalancedBatchSampler(labels, 3, 2, num_replicas=4, rank=rank, seed=1)
        new = DistributedBalancedBatchSampler(labels, samples_per_class=2, classes_per_step=12, num_replicas=4,
                                              rank=rank, seed=1)
        assert old.plan_identity() == new.plan_identity() and old.batch_size == new.batch_size == 6
        assert list(old) == list(new)


def test_ranks_of_an_uneven_split_pass_the_consistency_check():
    labels = np.arange(300) % 30
    samplers = [DistributedBalancedBatchSampler(labels, samples_per_class=2, classes_per_step=8, num_replicas=3,
                                                rank=rank) for rank in range(3)]
    from pksampler.samplers import consistency_row

    table = np.stack([consistency_row(s) for s in samplers])
    for sampler in samplers:
        check_consistent(sampler, allgather=lambda row: table)  # batch sizes differ, the fingerprint does not


@pytest.mark.parametrize("form", [DistributedBalancedSampler, DistributedBalancedBatchSampler])
def test_more_ranks_than_classes_per_step_is_refused_naming_the_argument(form):
    with pytest.raises(ValueError, match=r"\(num_replicas=\) must be at most classes_per_step=4: every rank takes at "
                                         r"least one of them per step, got num_replicas=5"):
        form(np.arange(100) % 10, samples_per_class=2, classes_per_step=4, num_replicas=5, rank=0)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"classes_per_batch": 2, "classes_per_step": 4}, TypeError, r"exactly one of classes_per_batch= .* got both"),
    ({}, TypeError, r"exactly one of classes_per_batch= .* got neither"),
    ({"classes_per_step": 0}, ValueError, r"classes_per_step=\) must be >= 1, got 0"),
    ({"classes_per_step": True}, TypeError, r"classes_per_step=\) expects an int, got True"),
])
def test_the_step_size_is_given_once(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedBalancedBatchSampler(np.arange(100) % 10, samples_per_class=2, num_replicas=2, rank=0, **kwargs)


def test_resume_with_another_step_size_names_the_one_to_use():
    labels = np.arange(300) % 30
    state = DistributedBalancedBatchSampler(labels, samples_per_class=2, classes_per_step=6, num_replicas=2,
                                            rank=0).state_dict()
    with pytest.raises(ValueError, match=r"used 6 classes per global step .* construct it with classes_per_step=6"):
        DistributedBalancedBatchSampler(labels, samples_per_class=2, classes_per_step=8, num_replicas=4,
                                        rank=0).load_state_dict(state)


# --- triplets ------------------------------------------------------------------------


@given(split_configs())
def test_triplet_uneven_split_keeps_every_guarantee(cfg):
    assume(enough_anchors(cfg))
    plans = triplet_ranks(cfg, cfg["world"])
    for plan in plans:
        check_triplets(plan.reshape(plan.shape[0], -1, 3), cfg["labels"])
    check_triplet_ranks([p.reshape(p.shape[0], -1, 3) for p in plans])
    check_anchor_coverage([p.reshape(p.shape[0], -1, 3) for p in plans], cfg["labels"], cfg["G"])
    check_even_split(plans, triplet_ranks(cfg, 1)[0], 3)


@given(split_configs(max_world=8), st.data())
def test_triplet_resume_on_any_world_size_continues_with_the_next_global_step(cfg, data):
    assume(enough_anchors(cfg))
    new_world = data.draw(st.integers(1, cfg["G"]))
    single = triplet_ranks(cfg, 1)[0]
    consumed = data.draw(st.integers(0, single.shape[0]))
    state = triplet(cfg, cfg["world"], cfg["world"] - 1).state_dict(batches_consumed=consumed)
    after = []
    for rank in range(new_world):
        sampler = DistributedTripletBatchSampler(cfg["labels"], triplets_per_step=cfg["G"], num_replicas=new_world,
                                                 rank=rank)
        sampler.load_state_dict(state)
        after.append(np.asarray(list(sampler), dtype=np.int64).reshape(-1, sampler.batch_size))
    check_even_split(after, single[consumed:], 3)


def test_triplet_forms_and_pure_plan_agree_on_an_uneven_split():
    labels = np.arange(200) % 20
    index = group_labels(labels)
    for rank in range(3):
        flat = DistributedTripletSampler(labels, triplets_per_step=8, num_replicas=3, rank=rank, seed=4)
        batch = DistributedTripletBatchSampler(labels, triplets_per_step=8, num_replicas=3, rank=rank, seed=4)
        assert flat.batch_size == batch.batch_size == 3 * (3 if rank < 2 else 2)
        assert batch.rank_batch_sizes == (9, 9, 6) and batch.global_batch_size == 24
        assert list(flat) == [i for b in batch for i in b] and len(flat) == len(batch) * flat.batch_size
        plan = triplet_batches(index, anchor_index(index), None, 3, rank, TripletOptions(seed=4, epoch=0), triplets_per_step=8)
        np.testing.assert_array_equal(plan.reshape(plan.shape[0], -1), np.asarray(list(batch)))


def test_more_ranks_than_triplets_per_step_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"DistributedTripletSampler\(num_replicas=\) must be at most "
                                         r"triplets_per_step=3.*got num_replicas=4"):
        DistributedTripletSampler(np.arange(100) % 10, triplets_per_step=3, num_replicas=4, rank=0)


@pytest.mark.parametrize("build", [
    lambda labels, world, rank: DistributedBalancedBatchSampler(labels, samples_per_class=2, classes_per_step=8,
                                                                num_replicas=world, rank=rank, seed=6),
    lambda labels, world, rank: DistributedTripletBatchSampler(labels, triplets_per_step=8, num_replicas=world,
                                                               rank=rank, seed=6),
])
def test_set_world_moves_a_running_sampler_to_another_world_size(build):
    labels = np.arange(240) % 24
    moved = build(labels, 2, 1)
    moved.set_epoch(1)
    state = moved.state_dict(batches_consumed=2)
    moved.set_world(3, 2)
    moved.load_state_dict(state)
    fresh = build(labels, 3, 2)
    fresh.load_state_dict(state)
    assert moved.batch_size == fresh.batch_size and moved.rank_batch_sizes == fresh.rank_batch_sizes
    assert list(moved) == list(fresh) and len(list(fresh)) == fresh.num_batches - 2
    with pytest.raises(ValueError, match=r"set_world\(num_replicas=\) must be at most .*=8.*got num_replicas=9"):
        moved.set_world(9, 0)
    with pytest.raises(ValueError, match=r"set_world\(rank=\) must be in the interval \[0, 2\]"):
        moved.set_world(3, 3)


def test_set_world_with_a_world_and_a_rank_is_refused_naming_the_rule():
    """``set_world(world)`` or ``set_world(num_replicas, rank)``: a World with a rank beside it is ambiguous."""
    from pksampler.world import World

    sampler = DistributedBalancedBatchSampler(np.arange(240) % 24, samples_per_class=2, classes_per_step=8,
                                              num_replicas=2, rank=0, seed=6)
    with pytest.raises(TypeError, match=r"DistributedBalancedBatchSampler\.set_world\(rank=\) must be None when "
                                        r"num_replicas is a World.*got rank=0"):
        sampler.set_world(World(rank=1, size=4), 0)
    assert (sampler.num_replicas, sampler.rank) == (2, 0)  # unchanged
    sampler.set_world(World(rank=1, size=4))
    assert (sampler.num_replicas, sampler.rank) == (4, 1)

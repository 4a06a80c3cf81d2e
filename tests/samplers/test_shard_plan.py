"""The shard-local plan (locality="shard") keeps every guarantee of the default plan.

Ranks are simulated in one process by looping over ``rank``. Samples are
stored class by class (as the packer writes them) and cut into shards of a
drawn size; the guarantees are the ones of tests/samplers/test_uneven_split.py
plus the plan's own: the same chunk counts per class as the default plan,
and every shard read by a contiguous run of lanes only.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sampler_invariants import check_disjoint_across_ranks, check_even_split, check_rank_batches, split_configs

from pksampler.samplers import DistributedBalancedBatchSampler, group_labels
from pksampler.samplers.pk_plan import epoch_layout, step_classes
from pksampler.samplers.shard_plan import class_shards, shard_layout, visits_of


def _stored(cfg: dict, shard_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels stored class by class and whole classes per shard (``shard_len`` classes), as the packer writes them."""
    labels = np.sort(cfg["labels"], kind="stable")
    return labels, labels // shard_len


def _sampler(cfg: dict, labels: np.ndarray, shards: np.ndarray, world: int, rank: int, window: int):
    sampler = DistributedBalancedBatchSampler(
        labels, samples_per_class=cfg["K"], classes_per_step=cfg["G"], num_replicas=world, rank=rank,
        seed=cfg["seed"], locality="shard", shard_ids=shards, window=window,
    )
    sampler.set_epoch(cfg["epoch"])
    return sampler


@settings(max_examples=25, deadline=None)
@given(cfg=split_configs(), shard_len=st.integers(1, 8), window=st.integers(1, 12))
def test_shard_plan_keeps_the_contract(cfg: dict, shard_len: int, window: int) -> None:
    labels, shards = _stored(cfg, shard_len)
    single = np.array(list(_sampler(cfg, labels, shards, 1, 0, window)))
    world = cfg["world"]
    samplers = [_sampler(cfg, labels, shards, world, rank, window) for rank in range(world)]
    assert all(len(s) == len(samplers[0]) for s in samplers)
    per_rank = [np.array(list(s)).reshape(len(s), -1) for s in samplers]
    assert [b.shape[0] for b in per_rank] == [len(s) for s in samplers], "__len__ differs from the batches yielded"
    check_even_split(per_rank, single, cfg["K"])
    check_disjoint_across_ranks(per_rank, labels)
    for sampler, batches in zip(samplers, per_rank):
        check_rank_batches(batches, labels, sampler.classes_per_batch, cfg["K"])


@settings(max_examples=20, deadline=None)
@given(cfg=split_configs(), shard_len=st.integers(1, 8), window=st.integers(1, 12))
def test_chunk_counts_equal_the_default_plan(cfg: dict, shard_len: int, window: int) -> None:
    labels, shards = _stored(cfg, shard_len)
    index = group_labels(labels)
    common = {"seed": cfg["seed"], "epoch": cfg["epoch"]}
    default = step_classes(epoch_layout(index, cfg["G"], cfg["K"], **common))
    local = step_classes(shard_layout(index, cfg["G"], cfg["K"], class_shards(index, shards), window=window, **common))
    assert default.shape == local.shape
    np.testing.assert_array_equal(np.bincount(default.ravel(), minlength=index.num_classes),
                                  np.bincount(local.ravel(), minlength=index.num_classes))


@settings(max_examples=20, deadline=None)
@given(cfg=split_configs(), shard_len=st.integers(1, 8), window=st.integers(1, 12))
def test_a_shard_is_read_by_a_contiguous_run_of_lanes(cfg: dict, shard_len: int, window: int) -> None:
    """One stream per lane: a shard with m chunks this epoch is read by at most ceil(m / S) + 1 adjacent lanes."""
    labels, shards = _stored(cfg, shard_len)
    single = np.array(list(_sampler(cfg, labels, shards, 1, 0, window)))
    steps = single.shape[0]
    lane_shard = shards[single.reshape(steps, cfg["G"], cfg["K"])[:, :, 0]]
    for shard in np.unique(lane_shard):
        lanes = np.unique(np.nonzero(lane_shard == shard)[1])
        chunks = int((lane_shard == shard).sum())
        assert lanes.size <= -(-chunks // steps) + 1, f"shard {shard}: {chunks} chunks read by lanes {lanes.tolist()}"
        assert np.array_equal(lanes, np.arange(lanes[0], lanes[-1] + 1)), f"shard {shard}: lanes {lanes.tolist()}"


@settings(max_examples=15, deadline=None)
@given(cfg=split_configs(), shard_len=st.integers(1, 8), cut=st.floats(0, 1), other=st.integers(1, 12))
# the epoch consumed whole (cut 1.0): every rank resumes with nothing left, which reshape(0, -1) cannot express
@example(cfg={"labels": np.array([0, 0]), "world": 1, "G": 1, "K": 1, "seed": 0, "epoch": 0, "kind": "uniform"},
         shard_len=1, cut=1.0, other=1)
def test_resume_on_another_world_size(cfg: dict, shard_len: int, cut: float, other: int) -> None:
    labels, shards = _stored(cfg, shard_len)
    other = min(other, cfg["G"])
    single = np.array(list(_sampler(cfg, labels, shards, 1, 0, 4)))
    consumed = int(cut * single.shape[0])
    remaining = single.shape[0] - consumed
    state = _sampler(cfg, labels, shards, cfg["world"], 0, 4).state_dict(batches_consumed=consumed)
    resumed = []
    for rank in range(other):
        sampler = _sampler(cfg, labels, shards, other, rank, 4)
        sampler.load_state_dict(state)
        batches = list(sampler)
        assert len(batches) == remaining, (rank, len(batches), remaining)
        if remaining:
            resumed.append(np.array(batches).reshape(remaining, -1))
    if remaining:  # with nothing left, every rank yielding no batch (asserted above) is the whole check
        np.testing.assert_array_equal(np.concatenate(resumed, axis=1), single[consumed:])


def test_visits_group_a_lane_by_shard() -> None:
    labels = np.repeat(np.arange(400), 12)
    shards = np.arange(labels.size) // 600
    sampler = DistributedBalancedBatchSampler(labels, samples_per_class=4, classes_per_step=8, num_replicas=1, rank=0,
                                              locality="shard", shard_ids=shards, window=16)
    batches = np.array(list(sampler)).reshape(len(sampler), 8, 4)
    visits = visits_of(batches[:, 3], shards)
    assert sum(chunks for _, chunks in visits) == len(sampler)
    assert len(visits) <= 3, f"lane 3 reads {len(visits)} shards in one epoch"
    assert min(chunks for _, chunks in visits) >= 1


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"locality": "shard"}, "needs shard_ids="),
    ({"locality": "near"}, "locality"),
    ({"shard_ids": np.zeros(48, int)}, "only with locality='shard'"),
    ({"locality": "shard", "shard_ids": np.zeros(47, int)}, "one integer shard id per sample (48)"),
    ({"locality": "shard", "shard_ids": -np.ones(48, int)}, "non-negative, got -1"),
    ({"locality": "shard", "shard_ids": np.zeros(48, int), "window": 0}, "window"),
])
def test_bad_shard_arguments_are_named(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=None) as error:
        DistributedBalancedBatchSampler(np.repeat(np.arange(12), 4), samples_per_class=2, classes_per_step=4,
                                        num_replicas=1, rank=0, **kwargs)
    assert words in str(error.value)

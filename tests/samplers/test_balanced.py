"""DistributedBalancedSampler: batch-level and epoch-level invariants.

Ranks are simulated in one process by looping over ``rank``; the real
multi-process runs are in tests/distributed/.
"""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from sampler_invariants import (
    check_disjoint_across_ranks,
    check_rank_batches,
    check_within_class_balance,
    check_world_invariance,
    make_labels,
    sampler_configs,
)

from pksampler import DistributedBalancedSampler
from pksampler.samplers import DistributedBalancedBatchSampler, PlanOptions, balanced_plan, group_labels
from pksampler.samplers.pk_plan import cap_counts, chunk_counts, eligible_classes


def all_ranks(cfg: dict, *, world: int | None = None, per_rank: int | None = None, **kwargs) -> list[np.ndarray]:
    world = cfg["world"] if world is None else world
    per_rank = cfg["P"] if per_rank is None else per_rank
    plans = []
    for rank in range(world):
        sampler = DistributedBalancedBatchSampler(
            cfg["labels"], per_rank, cfg["K"], num_replicas=world, rank=rank, seed=cfg["seed"], **kwargs
        )
        sampler.set_epoch(cfg["epoch"])
        batches = list(sampler)
        assert len(batches) == len(sampler), "__len__ differs from what __iter__ yields"
        plans.append(np.asarray(batches, dtype=np.int64).reshape(len(batches), per_rank * cfg["K"]))
    return plans


# --- batch level -----------------------------------------------------------------


@given(sampler_configs(), st.sampled_from(["repeat", "drop"]), st.sampled_from([1.0, 0.0, 0.5]))
def test_every_rank_batch_is_p_by_k_and_ranks_are_disjoint(cfg, small_classes, weighting):
    labels = cfg["labels"]
    sizes = np.bincount(labels)
    assume(small_classes == "repeat" or (sizes >= cfg["K"]).sum() >= cfg["world"] * cfg["P"])
    plans = all_ranks(cfg, small_classes=small_classes, class_weighting=weighting)
    for batches in plans:
        check_rank_batches(batches, labels, cfg["P"], cfg["K"])
        if small_classes == "drop" and batches.size:
            assert sizes[labels[batches]].min() >= cfg["K"], "a class smaller than K was used under 'drop'"
    check_disjoint_across_ranks(plans, labels)


@given(sampler_configs())
def test_flat_stream_equals_batch_form_and_len_is_exact(cfg):
    rank = cfg["world"] - 1
    flat = DistributedBalancedSampler(cfg["labels"], cfg["P"], cfg["K"], num_replicas=cfg["world"], rank=rank, seed=cfg["seed"])
    batch = DistributedBalancedBatchSampler(cfg["labels"], cfg["P"], cfg["K"], num_replicas=cfg["world"], rank=rank, seed=cfg["seed"])
    flat.set_epoch(cfg["epoch"])
    batch.set_epoch(cfg["epoch"])
    stream = list(flat)
    assert len(stream) == len(flat) == len(batch) * flat.batch_size
    assert stream == [i for b in batch for i in b]
    assert flat.num_batches == batch.num_batches == len(batch)


# --- epoch level -----------------------------------------------------------------


@given(sampler_configs())
def test_world_size_invariance(cfg):
    plans = all_ranks(cfg)
    single = all_ranks(cfg, world=1, per_rank=cfg["world"] * cfg["P"])[0]
    check_world_invariance(plans, single)


@given(sampler_configs(max_world=8))
def test_one_pass_per_epoch(cfg):
    labels, K = cfg["labels"], cfg["K"]
    G = cfg["world"] * cfg["P"]
    index = group_labels(labels)
    counts = chunk_counts(index.sizes, K, 1.0, 0.0)
    capped, steps = cap_counts(counts, G)
    plans = all_ranks(cfg)
    used = np.concatenate([p.reshape(-1) for p in plans])
    assert plans[0].shape[0] == steps
    check_within_class_balance(used, labels)
    if np.array_equal(capped, counts):  # no class larger than the epoch can hold
        dropped_chunks = int(counts.sum()) - steps * G
        assert 0 <= dropped_chunks < G
        missing = np.setdiff1d(np.arange(labels.size), used).size
        assert missing <= dropped_chunks * K, f"{missing} indices unused, more than the {dropped_chunks} dropped chunks hold"
    else:
        assert capped.max() <= steps


def test_huge_class_is_capped_with_a_new_subset_each_epoch():
    labels = np.concatenate([np.zeros(1000, dtype=np.int64), np.repeat(np.arange(1, 9), 4)])
    sampler = DistributedBalancedBatchSampler(labels, 4, 4, num_replicas=2, rank=0, seed=0)
    seen = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        other = DistributedBalancedBatchSampler(labels, 4, 4, num_replicas=2, rank=1, seed=0)
        other.set_epoch(epoch)
        batches = np.array(list(sampler) + list(other))
        uses = batches[np.isin(batches, np.flatnonzero(labels == 0))]
        assert 0 < uses.size < 1000 and np.unique(uses).size == uses.size
        seen.append(set(uses.tolist()))
    assert seen[0] != seen[1]


def test_class_weighting_zero_makes_classes_equally_frequent():
    labels = make_labels("zipf", 60, 3000, seed=1)
    sampler = DistributedBalancedBatchSampler(labels, 5, 2, num_replicas=2, rank=0, class_weighting=0.0)
    other = DistributedBalancedBatchSampler(labels, 5, 2, num_replicas=2, rank=1, class_weighting=0.0)
    chunks = np.array(list(sampler) + list(other))[:, ::2]
    per_class = np.bincount(labels[chunks].reshape(-1), minlength=60)
    assert per_class.max() - per_class.min() <= 2, per_class
    proportional = DistributedBalancedBatchSampler(labels, 5, 2, num_replicas=1, rank=0)
    skew = np.bincount(labels[np.array(list(proportional))[:, ::2]].reshape(-1), minlength=60)
    assert skew.max() - skew.min() > 10  # the default follows the long tail


def test_repeat_fills_small_classes_and_drop_excludes_them():
    labels = np.array([0] * 10 + [1] * 10 + [2] * 1 + [3] * 2 + [4] * 10)
    repeat = np.array(list(DistributedBalancedBatchSampler(labels, 5, 4, num_replicas=1, rank=0)))
    check_rank_batches(repeat, labels, 5, 4)
    assert {2, 3} <= set(labels[repeat].reshape(-1).tolist())
    drop = np.array(list(DistributedBalancedBatchSampler(labels, 3, 4, num_replicas=1, rank=0, small_classes="drop")))
    assert not ({2, 3} & set(labels[drop].reshape(-1).tolist()))
    assert eligible_classes(np.bincount(labels), 4, "drop").tolist() == [0, 1, 4]


# --- determinism -----------------------------------------------------------------


def _stream(labels, epoch=0, seed=0):
    sampler = DistributedBalancedSampler(labels, 3, 2, num_replicas=2, rank=1, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_global_random_state_changes_nothing():
    labels = make_labels("zipf", 30, 400, seed=0)
    np.random.seed(1)
    random.seed(1)
    torch.manual_seed(1)
    first = _stream(labels, epoch=2)
    np.random.seed(2)
    random.seed(2)
    torch.manual_seed(2)
    np.random.random(100)
    assert _stream(labels, epoch=2) == first


def test_epochs_and_seeds_change_the_order():
    labels = make_labels("uniform", 30, 400, seed=0)
    assert _stream(labels, epoch=0) != _stream(labels, epoch=1)
    assert _stream(labels, seed=0) != _stream(labels, seed=1)
    # keyed by (seed, epoch), not seed + epoch
    assert _stream(labels, epoch=1, seed=0) != _stream(labels, epoch=0, seed=1)


def test_same_stream_in_a_new_process():
    code = (
        "import numpy as np, sys; from pksampler import DistributedBalancedSampler as S;"
        "labels = np.arange(400) % 37; s = S(labels, 3, 2, num_replicas=2, rank=1, seed=5); s.set_epoch(3);"
        "sys.stdout.write(','.join(map(str, s)))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    sampler = DistributedBalancedSampler(np.arange(400) % 37, 3, 2, num_replicas=2, rank=1, seed=5)
    sampler.set_epoch(3)
    assert out == ",".join(map(str, sampler))


# --- resume ----------------------------------------------------------------------


@given(sampler_configs(max_world=8), st.data())
def test_resume_continues_at_the_next_batch(cfg, data):
    kwargs = dict(num_replicas=cfg["world"], rank=0, seed=cfg["seed"])
    sampler = DistributedBalancedBatchSampler(cfg["labels"], cfg["P"], cfg["K"], **kwargs)
    sampler.set_epoch(cfg["epoch"])
    full = list(sampler)
    consumed = data.draw(st.integers(0, len(full)))
    iterator = iter(sampler)
    for _ in range(consumed):
        next(iterator)
    state = sampler.state_dict()
    fresh = DistributedBalancedBatchSampler(cfg["labels"], cfg["P"], cfg["K"], **{**kwargs, "seed": 999})
    fresh.load_state_dict(state)
    assert len(fresh) == len(full)  # the epoch's length, as frameworks expect; the iterator yields the rest
    assert list(fresh) == full[consumed:]
    fresh.set_epoch(cfg["epoch"] + 1)
    assert len(list(fresh)) == fresh.num_batches  # the next epoch starts at its first step


@given(sampler_configs(max_world=8), st.data())
def test_resume_on_another_world_size_continues_the_global_plan(cfg, data):
    G = cfg["world"] * cfg["P"]
    new_world = data.draw(st.sampled_from([w for w in range(1, G + 1) if G % w == 0]))
    before = all_ranks(cfg)
    consumed = data.draw(st.integers(0, before[0].shape[0]))
    state = None
    for rank in range(cfg["world"]):
        s = DistributedBalancedBatchSampler(cfg["labels"], cfg["P"], cfg["K"], num_replicas=cfg["world"], rank=rank, seed=cfg["seed"])
        s.set_epoch(cfg["epoch"])
        state = s.state_dict(batches_consumed=consumed)
    after = []
    for rank in range(new_world):
        s = DistributedBalancedBatchSampler(cfg["labels"], G // new_world, cfg["K"], num_replicas=new_world, rank=rank)
        s.load_state_dict(state)
        after.append(np.asarray(list(s), dtype=np.int64).reshape(-1, (G // new_world) * cfg["K"]))
    remaining = [b[consumed:] for b in before]
    check_world_invariance(after, np.concatenate(remaining, axis=1))


def test_resume_rejects_another_step_size_or_other_labels():
    labels = np.arange(300) % 30
    state = DistributedBalancedBatchSampler(labels, 3, 2, num_replicas=2, rank=0).state_dict()
    with pytest.raises(ValueError, match="used 6 classes per global step but this sampler has 4; construct it with "
                                         "classes_per_step=6"):
        DistributedBalancedBatchSampler(labels, 1, 2, num_replicas=4, rank=0).load_state_dict(state)
    DistributedBalancedBatchSampler(labels, samples_per_class=2, classes_per_step=6, num_replicas=4,
                                    rank=0).load_state_dict(state)  # W = 4 does not divide G = 6: fine
    with pytest.raises(ValueError, match="labels_fingerprint"):
        DistributedBalancedBatchSampler(np.arange(300) % 31, 3, 2, num_replicas=2, rank=0).load_state_dict(state)


# --- inputs ----------------------------------------------------------------------


def test_string_labels_and_datasets_with_targets():
    names = np.array(["mug", "shoe", "lamp", "book"] * 10)

    class Folder:
        targets = list(range(4)) * 10

        def __getitem__(self, i):  # pragma: no cover - must never be called
            raise AssertionError("the sampler loaded a sample")

    for labels in (names, names.tolist(), Folder(), torch.tensor(Folder.targets)):
        sampler = DistributedBalancedBatchSampler(labels, 2, 3, num_replicas=2, rank=0)
        check_rank_batches(np.array(list(sampler)), np.asarray(Folder.targets), 2, 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"classes_per_batch": 0}, ValueError, r"classes_per_batch=\) must be >= 1, got 0"),
        ({"classes_per_batch": True}, TypeError, r"classes_per_batch=\) expects an int, got True"),
        ({"samples_per_class": 2.0}, TypeError, r"samples_per_class=\) expects an int, got 2.0"),
        ({"samples_per_class": -1}, ValueError, r"samples_per_class=\) must be >= 1"),
        ({"rank": 2}, ValueError, r"rank=\) must be in the interval \[0, 1\].*got 2"),
        ({"rank": -1}, ValueError, r"rank=\) must be in the interval"),
        ({"num_replicas": 0}, ValueError, r"num_replicas=\) must be >= 1"),
        ({"small_classes": "pad"}, ValueError, r"small_classes=\) must be one of \['repeat', 'drop'\], got 'pad'"),
        ({"class_weighting": float("nan")}, ValueError, r"class_weighting=\) must be finite"),
        ({"seed": -3}, ValueError, r"seed=\) must be >= 0"),
        ({"classes_per_batch": 6}, ValueError, r"needs classes_per_step = 12 distinct classes, but the labels have 10 eligible"),
        ({"labels": np.zeros((4, 2))}, ValueError, r"labels=\) must be 1-D.*shape \(4, 2\)"),
        ({"labels": []}, ValueError, r"labels=\) is empty"),
        ({"labels": [0.5, 1.0]}, ValueError, r"float label 0.5 at index 0; float labels must be finite whole numbers"),
        ({"classes_per_batch": 6, "small_classes": "drop", "samples_per_class": 11}, ValueError, r"0 eligible"),
    ],
)
def test_bad_input_names_argument_value_and_rule(kwargs, error, match):
    args = {"labels": np.arange(100) % 10, "classes_per_batch": 2, "samples_per_class": 2,
            "num_replicas": 2, "rank": 0}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        DistributedBalancedSampler(**args)


def test_set_epoch_rejects_bad_values():
    sampler = DistributedBalancedSampler(np.arange(100) % 10, 2, 2, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"epoch=\) must be >= 0, got -1"):
        sampler.set_epoch(-1)


def test_pure_plan_matches_sampler():
    labels = make_labels("zipf", 40, 500, seed=3)
    index = group_labels(labels)
    for rank in range(3):
        sampler = DistributedBalancedBatchSampler(labels, 2, 3, num_replicas=3, rank=rank, seed=4)
        sampler.set_epoch(2)
        plan = balanced_plan(index, 2, 3, 3, rank, PlanOptions(seed=4, epoch=2))
        assert np.array_equal(plan, np.array(list(sampler)))


# --- hardened inputs -------------------------------------------------------------


def test_dataset_without_labels_is_refused_without_loading_a_sample():
    class Images:
        def __len__(self):
            return 40

        def __getitem__(self, i):  # pragma: no cover - must never be called
            raise AssertionError("the sampler loaded a sample")

    with pytest.raises(TypeError, match=r"labels=\) got a Images without a .labels or .targets attribute.*pass labels="):
        DistributedBalancedSampler(Images(), 2, 2, num_replicas=1, rank=0)


@pytest.mark.parametrize(
    ("labels", "match"),
    [
        (np.array([0.0, 1.0, 2.0**63, 2.0**64] * 5), r"float label 9.223372036854776e\+18 at index 2.*below 2\*\*63"),
        (np.array([0.0, 1.0, np.inf] * 5), r"float label inf at index 2"),
        (np.array([0.0, np.nan, 1.0] * 5), r"float label nan at index 1"),
        (["mug", float("nan"), "shoe"] * 5, r"missing label \(nan\) at index 1"),
        (["mug", None, "shoe"] * 5, r"missing label \(None\) at index 1"),
        (np.array(["mug", None, "shoe"] * 5, dtype=object), r"missing label \(None\) at index 1"),
    ],
)
def test_labels_that_are_not_exact_classes_are_refused(labels, match):
    with pytest.raises(ValueError, match=match):
        DistributedBalancedSampler(labels, 1, 1, num_replicas=1, rank=0)


def test_unhashable_labels_name_the_argument():
    labels = np.empty(6, dtype=object)
    labels[:] = [[0], [1], {"a": 1}, [0], [1], {"a": 1}]
    with pytest.raises(TypeError, match=r"DistributedBalancedSampler\(labels=\) must hold hashable class labels"):
        DistributedBalancedSampler(labels, 1, 1, num_replicas=1, rank=0)


def test_large_whole_floats_stay_distinct_classes():
    labels = np.array([2.0**62, 2.0**62 + 2**11, 3.0] * 4)
    sampler = DistributedBalancedBatchSampler(labels, 3, 2, num_replicas=1, rank=0)
    assert sampler.index.num_classes == 3
    check_rank_batches(np.array(list(sampler)), labels, 3, 2)


@pytest.mark.parametrize("k", [10**9, 2**70])
def test_samples_per_class_is_bounded_by_the_data(k):
    with pytest.raises(ValueError, match=r"samples_per_class=\) must be at most 16 x the largest class size = 160, got"):
        DistributedBalancedSampler(np.arange(100) % 10, 2, k, num_replicas=1, rank=0)
    DistributedBalancedSampler(np.arange(100) % 10, 2, 160, num_replicas=1, rank=0)  # the bound itself is fine


@pytest.mark.parametrize("value", [2**63, 2**64 + 5])
def test_seeds_and_epochs_outside_int64_are_refused(value):
    with pytest.raises(ValueError, match=r"seed=\) must be in \[0, 2\*\*63\).*got " + str(value)):
        DistributedBalancedSampler(np.arange(100) % 10, 2, 2, num_replicas=1, rank=0, seed=value)
    sampler = DistributedBalancedSampler(np.arange(100) % 10, 2, 2, num_replicas=1, rank=0, seed=2**63 - 1)
    with pytest.raises(ValueError, match=r"epoch=\) must be in \[0, 2\*\*63\)"):
        sampler.set_epoch(value)
    state = sampler.state_dict()
    state["epoch"] = value
    with pytest.raises(ValueError, match=r"state\['epoch'\]=\) must be in \[0, 2\*\*63\)"):
        sampler.load_state_dict(state)


@pytest.mark.parametrize("kind", ["uniform", "zipf", "small"])
def test_grouping_matches_np_unique_and_a_stable_sort(kind):
    labels = make_labels(kind, 70_000, 200_000, seed=2) * 3 - 7  # > 2**16 classes: two radix passes
    index = group_labels(labels)
    values, codes = np.unique(labels, return_inverse=True)
    assert np.array_equal(index.classes, values)
    assert np.array_equal(index.members, np.argsort(codes, kind="stable"))
    assert np.array_equal(index.sizes, np.bincount(codes))
    assert index.members.dtype == index.offsets.dtype == np.int32
    sparse = group_labels(labels.astype(np.int64) * 10**9)  # the np.unique path
    assert np.array_equal(sparse.members, index.members) and sparse.fingerprint != index.fingerprint

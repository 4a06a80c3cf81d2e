"""Batch-mates are as varied as a random deal (balanced plan and triplet negatives).

The statistic and the reference are those of benchmarks/batch_mates.py
(:mod:`pksampler.samplers._mates`). The tolerance comes from the random deal
itself: the plan must reach 0.9 x the mean over several deals, less twice the
deals' standard deviation (the deal's own noise at these small sizes).
"""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st
from sampler_invariants import make_labels

from pksampler.samplers import DistributedTripletBatchSampler, group_labels
from pksampler.samplers._mates import mate_fraction, negative_fraction, random_deal, well_represented
from pksampler.samplers.pk_plan import _split_runs, cap_counts, chunk_counts, epoch_layout, step_classes

DEALS = 8


def deal_bound(figures: list[float]) -> float:
    """What the plan must reach: 0.9 x the deals' mean, less two of their standard deviations."""
    return 0.9 * float(np.mean(figures)) - 2.0 * float(np.std(figures))


@given(
    st.sampled_from(["uniform", "zipf", "dominant", "small"]),
    st.sampled_from([8, 16, 32, 64, 128]),
    st.integers(2, 30),
    st.integers(0, 2**31 - 1),
    st.integers(0, 3),
)
def test_mate_fraction_is_at_least_0_9_of_a_random_deal(kind, classes_per_step, classes_per_g, seed, epoch):
    num_classes = classes_per_step + classes_per_step * classes_per_g // 4
    labels = make_labels(kind, num_classes, 40 * num_classes, seed)
    layout = epoch_layout(group_labels(labels), classes_per_step, 4, seed=seed % 1000, epoch=epoch)
    steps = step_classes(layout)
    sorted_steps = np.sort(steps, axis=1)
    assert (sorted_steps[:, 1:] != sorted_steps[:, :-1]).all(), "a class repeats within a step"
    classes = well_represented(steps, 8, limit=200, seed=seed)
    assume(classes.size >= 5)
    plan = float(mate_fraction(steps, classes).mean())
    rng = np.random.default_rng(seed)
    deals = [float(mate_fraction(random_deal(steps, rng), classes).mean()) for _ in range(DEALS)]
    assert plan >= deal_bound(deals), f"plan {plan:.3f}, deals {np.round(deals, 3).tolist()}"


def test_adjacent_large_classes_are_repaired_without_repeats():
    """Classes of 0.84 S chunks: most column boundaries split one, many columns are tight."""
    classes_per_step = 32
    labels = np.repeat(np.arange(38), 4 * 16)  # 38 classes x 16 chunks over 32 columns of 19
    index = group_labels(labels)
    counts, num_steps = cap_counts(chunk_counts(index.sizes, 4, 1.0, 0.0), classes_per_step)
    for epoch in range(5):
        layout = epoch_layout(index, classes_per_step, 4, seed=3, epoch=epoch)
        tail, head, next_tail = _split_runs(layout.starts, layout.num_steps, classes_per_step)
        assert ((tail > 0) & (tail + head + next_tail > layout.num_steps)).sum() > classes_per_step // 4
        steps = step_classes(layout)
        assert steps.shape == (num_steps, classes_per_step)
        sorted_steps = np.sort(steps, axis=1)
        assert (sorted_steps[:, 1:] != sorted_steps[:, :-1]).all(), f"epoch {epoch}: a class repeats within a step"
        assert np.bincount(steps.reshape(-1), minlength=38).max() <= num_steps


@given(st.sampled_from(["uniform", "zipf"]), st.integers(20, 200), st.integers(0, 2**31 - 1))
def test_triplet_negatives_are_as_varied_as_a_random_deal(kind, num_classes, seed):
    labels = make_labels(kind, num_classes, 30 * num_classes, seed)
    sampler = DistributedTripletBatchSampler(labels, 16, num_replicas=1, rank=0, seed=seed % 1000)
    triples = np.asarray(list(sampler), dtype=np.int64).reshape(-1, 3)
    anchor, negative = labels[triples[:, 0]], labels[triples[:, 2]]
    classes = np.flatnonzero(np.bincount(anchor) >= 8)
    assume(classes.size >= 5)
    plan = float(negative_fraction(anchor, negative, classes).mean())
    rng = np.random.default_rng(seed)
    deals = [float(negative_fraction(anchor, rng.permutation(negative), classes).mean()) for _ in range(DEALS)]
    assert plan >= deal_bound(deals), f"plan {plan:.3f}, deals {np.round(deals, 3).tolist()}"

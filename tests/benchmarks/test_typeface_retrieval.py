"""The sampler comparison's batch counts: what each sampler puts in a global batch of a class-rich set."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from typeface_retrieval import batch_counts, random_batches  # noqa: E402

from pksampler.train.config.schema import SamplerConfig  # noqa: E402

# 600 classes of 7 images, like the typeface set: random batches of 64 rarely pair two images of a class.
LABELS = np.repeat(np.arange(600), 7)
SAMPLER = SamplerConfig(classes_per_step=16, samples_per_class=4, args={"small_classes": "repeat"})


def test_balanced_batches_hold_k_images_of_g_classes_and_random_ones_almost_no_pairs():
    pk = batch_counts("pk", SAMPLER, LABELS, world_size=2, seed=0)
    assert (pk.classes, pk.positive_pairs, pk.images_with_positive) == (16, 16 * 6, 1.0)
    mperclass = batch_counts("mperclass", SAMPLER, LABELS, world_size=2, seed=0)
    assert (mperclass.classes, mperclass.positive_pairs) == (16, 96)
    random = batch_counts("random", SAMPLER, LABELS, world_size=2, seed=0)
    # 64 draws from 4,200 images: about 64 * 63 / 2 * 6 / 4199 = 2.9 pairs expected.
    assert random.positive_pairs < 8 and random.images_with_positive < 0.25 and random.classes > 55


def test_random_batches_take_as_many_steps_as_the_balanced_plan_and_split_the_data_over_ranks():
    ranks = [random_batches(SAMPLER, LABELS, 2, rank, seed=0) for rank in range(2)]
    for sampler in ranks:
        sampler.set_epoch(1)
    batches = [list(sampler) for sampler in ranks]
    assert len(batches[0]) == len(batches[1]) == ranks[0].num_batches > 0
    assert all(len(batch) == 32 for rank in batches for batch in rank)
    first = set(batches[0][0]) & set(batches[1][0])
    assert not first  # DistributedSampler gives the ranks disjoint shares
    ranks[0].load_state_dict(ranks[0].state_dict(batches_consumed=3))
    assert list(ranks[0]) == batches[0][3:]  # resumes mid-epoch

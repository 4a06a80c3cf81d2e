"""Batch-mate variety of the P x K plan and of triplet negatives, against a random deal.

Run: .venv/bin/python benchmarks/batch_mates.py [--epochs 2]

Statistic (pksampler.samplers._mates, also used by the property test): for
every class with at least 8 chunks in an epoch, the distinct other classes it
shares a global step with, divided by chunks x (G - 1). Reference: the same
multiset of chunks dealt to the steps uniformly at random, G per step,
ignoring the distinct-class rule. Reported: the mean over those classes for
the plan, for the deal, and their ratio (target >= 0.9), averaged over
epochs. The plan is built by W=4 real sampler instances (one per rank) and
the ranks' batches are joined into global steps. Where more than 400 classes
qualify, a random 400 of them (the same for plan and deal) are evaluated.

Triplets: for every anchor class with at least 8 triplets, distinct negative
classes over its triplets, against the epoch's negatives dealt to the
triplets at random (random negatives, W=4, T=32).

Labels: long-tail (Zipf-like sizes, exponent 0.8, as in sampler_speed.py)
and uniform, N = 40 C, K = 4.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampler_speed import long_tail_labels  # noqa: E402

from pksampler.samplers import DistributedBalancedBatchSampler, DistributedTripletBatchSampler  # noqa: E402
from pksampler.samplers._mates import (  # noqa: E402
    mate_fraction,
    negative_fraction,
    random_deal,
    well_represented,
)

WORLD, K, TRIPLETS, MIN_CHUNKS, SAMPLE = 4, 4, 32, 8, 400
CLASSES = (2_000, 20_000)
STEP_CLASSES = (8, 32, 128, 1024)


def make_labels(kind: str, num_classes: int) -> np.ndarray:
    """Labels with every class present, N = 40 C."""
    num_samples = 40 * num_classes
    if kind == "long-tail":
        return long_tail_labels(num_samples, num_classes)
    rng = np.random.default_rng(1)
    return rng.permutation(np.concatenate([np.arange(num_classes), rng.integers(0, num_classes, num_samples - num_classes)]))


def global_steps(labels: np.ndarray, classes_per_step: int, epoch: int) -> np.ndarray:
    """``(S, G)`` class labels of an epoch, joined from W rank samplers."""
    per_rank = classes_per_step // WORLD
    parts = []
    for rank in range(WORLD):
        sampler = DistributedBalancedBatchSampler(labels, per_rank, K, num_replicas=WORLD, rank=rank, seed=0)
        sampler.set_epoch(epoch)
        batches = np.asarray(list(sampler), dtype=np.int64).reshape(-1, per_rank, K)
        parts.append(labels[batches[:, :, 0]])
    return np.concatenate(parts, axis=1)


def balanced_case(labels: np.ndarray, classes_per_step: int, epochs: int) -> tuple[float, float, int, int]:
    """Mean mate fraction of plan and deal over epochs; steps; classes evaluated."""
    plan, deal = [], []
    rng = np.random.default_rng(0)
    for epoch in range(epochs):
        steps = global_steps(labels, classes_per_step, epoch)
        classes = well_represented(steps, MIN_CHUNKS, limit=SAMPLE, seed=epoch)
        if not classes.size:
            return float("nan"), float("nan"), steps.shape[0], 0
        plan.append(mate_fraction(steps, classes).mean())
        deal.append(mate_fraction(random_deal(steps, rng), classes).mean())
    return float(np.mean(plan)), float(np.mean(deal)), steps.shape[0], classes.size


def triplet_case(labels: np.ndarray, epochs: int) -> tuple[float, float, int]:
    """Mean negative fraction of the triplet plan and of a random deal of its negatives."""
    plan, deal = [], []
    rng = np.random.default_rng(0)
    for epoch in range(epochs):
        anchors, negatives = [], []
        for rank in range(WORLD):
            sampler = DistributedTripletBatchSampler(labels, TRIPLETS, num_replicas=WORLD, rank=rank, seed=0)
            sampler.set_epoch(epoch)
            triples = np.asarray(list(sampler), dtype=np.int64).reshape(-1, 3)
            anchors.append(labels[triples[:, 0]])
            negatives.append(labels[triples[:, 2]])
        anchor, negative = np.concatenate(anchors), np.concatenate(negatives)
        classes = np.flatnonzero(np.bincount(anchor) >= MIN_CHUNKS)
        plan.append(negative_fraction(anchor, negative, classes).mean())
        deal.append(negative_fraction(anchor, rng.permutation(negative), classes).mean())
    return float(np.mean(plan)), float(np.mean(deal)), classes.size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2, help="epochs averaged per case")
    args = parser.parse_args()
    worst = float("inf")
    print(f"W={WORLD} K={K}, N = 40 C; mate fraction of classes with >= {MIN_CHUNKS} chunks, mean over them (<= {SAMPLE} sampled)")
    print(f"{'labels':10} {'C':>6} {'G':>5} {'S':>6} {'classes':>7} {'plan':>6} {'deal':>6} {'ratio':>6}")
    for kind in ("long-tail", "uniform"):
        for num_classes in CLASSES:
            labels = make_labels(kind, num_classes)
            for classes_per_step in STEP_CLASSES:
                if classes_per_step > num_classes:
                    continue
                plan, deal, steps, evaluated = balanced_case(labels, classes_per_step, args.epochs)
                if not evaluated:
                    print(f"{kind:10} {num_classes:6d} {classes_per_step:5d} {steps:6d}  no class has {MIN_CHUNKS} chunks")
                    continue
                worst = min(worst, plan / deal)
                print(f"{kind:10} {num_classes:6d} {classes_per_step:5d} {steps:6d} {evaluated:7d} "
                      f"{plan:6.3f} {deal:6.3f} {plan / deal:6.3f}")
    print(f"triplet negatives (random), W={WORLD} T={TRIPLETS}: negative fraction of anchor classes with >= {MIN_CHUNKS} triplets")
    for kind in ("long-tail", "uniform"):
        for num_classes in CLASSES:
            plan, deal, evaluated = triplet_case(make_labels(kind, num_classes), args.epochs)
            worst = min(worst, plan / deal)
            print(f"{kind:10} {num_classes:6d} {'':5} {'':6} {evaluated:7d} {plan:6.3f} {deal:6.3f} {plan / deal:6.3f}")
    print(f"worst ratio {worst:.3f} (target >= 0.9)")


if __name__ == "__main__":
    main()

"""Splits that hold as the label set grows: test classes keyed by name, held-out images keyed by name and position."""

from __future__ import annotations

import numpy as np
import pytest

from pksampler.datasets import class_disjoint_split_by_name, image_holdout


def names(first: int, last: int) -> list[str]:
    return [f"shop/item_{c:04d}" for c in range(first, last)]


def test_a_class_keeps_its_side_when_classes_come_and_go():
    small, grown = names(0, 300), names(100, 700)  # 100 left, 400 came: every code moved
    sides = []
    for listed in (small, grown):
        labels = np.repeat(np.arange(len(listed)), 3)
        train, test = class_disjoint_split_by_name(labels, listed, 0.3, seed=5)
        assert np.intersect1d(labels[train], labels[test]).size == 0
        assert np.union1d(train, test).size == labels.size
        sides.append({listed[c]: True for c in np.unique(labels[test])})
    shared = names(100, 300)
    assert [name in sides[0] for name in shared] == [name in sides[1] for name in shared]
    assert 0.2 < len(sides[1]) / 600 < 0.4
    other_seed = class_disjoint_split_by_name(np.repeat(np.arange(300), 3), small, 0.3, seed=6)[1]
    assert set(np.unique(np.repeat(np.arange(300), 3)[other_seed])) != {small.index(n) for n in sides[0]}


def test_the_split_by_name_has_at_least_one_class_on_each_side():
    for fraction in (0.001, 0.999):
        train, test = class_disjoint_split_by_name(np.array([0, 0, 1, 1, 2]), ["a", "b", "c"], fraction)
        assert train.size and test.size
    with pytest.raises(ValueError, match=r"test_fraction=\) must be in \(0, 1\), got 1.0"):
        class_disjoint_split_by_name(np.array([0, 1]), ["a", "b"], 1.0)


def test_held_out_images_are_a_few_per_class_and_stay_when_classes_are_added():
    sizes = [1, 2, 5, 9]
    labels = np.repeat(np.arange(4), sizes)
    kept, held = image_holdout(labels, ["a", "b", "c", "d"], 2, seed=1)
    assert np.bincount(labels[held], minlength=4).tolist() == [0, 1, 2, 2]  # at most all but one
    assert np.union1d(kept, held).size == labels.size and np.intersect1d(kept, held).size == 0
    # the same classes behind two new ones, in another order: the same images of each class are held out
    grown = np.concatenate([np.repeat([5, 4], [4, 3]), labels])
    _, held_grown = image_holdout(grown, ["a", "b", "c", "d", "new1", "new2"], 2, seed=1)
    before = [(int(labels[i]), int(i - np.flatnonzero(labels == labels[i])[0])) for i in held]
    after = [(int(grown[i]), int(i - np.flatnonzero(grown == grown[i])[0])) for i in held_grown if grown[i] < 4]
    assert sorted(before) == sorted(after)
    assert image_holdout(labels, ["a", "b", "c", "d"], 0)[1].size == 0
    with pytest.raises(ValueError, match=r"per_class=\) must be an int >= 0, got -1"):
        image_holdout(labels, ["a", "b", "c", "d"], -1)


def test_a_class_that_gains_images_never_holds_out_one_it_trained_on():
    """Keyed by position, one new photo sorting before the others moved every later image's key: in 195 of 200
    seeds a week-2 query was an image week 1 trained on (the known classes' image-level metrics overstated).
    Keyed by the item's name, a new image can only take a held-out place, never give one to a trained image."""
    week1 = [f"img{i:02d}.jpg" for i in range(0, 20, 2)]
    week2 = sorted([*week1, "img01.jpg", "img07.jpg"])
    for seed in range(40):
        _, held1 = image_holdout(np.zeros(len(week1), int), ["p"], 2, seed=seed, items=week1)
        _, held2 = image_holdout(np.zeros(len(week2), int), ["p"], 2, seed=seed, items=week2)
        trained1 = set(week1) - {week1[i] for i in held1}
        assert not {week2[i] for i in held2} & trained1
    # names from two folders: the same file name in two classes is two items (the class is part of the key)
    labels = np.array([0, 0, 0, 1, 1, 1])
    items = ["a.jpg", "b.jpg", "c.jpg", "a.jpg", "b.jpg", "c.jpg"]
    kept, held = image_holdout(labels, ["x", "y"], 1, seed=0, items=items)
    assert np.bincount(labels[held]).tolist() == [1, 1] and kept.size == 4
    with pytest.raises(ValueError, match=r"items=\) must name every item: 2 names for 6 labels"):
        image_holdout(labels, ["x", "y"], 1, items=items[:2])

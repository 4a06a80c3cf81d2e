"""SplitMix64 is written once (pksampler/hashing.py) and its users' draws did not move when they moved to it.

The pinned values below were computed with the three copies the samplers, the
batch augmentation and the sharded head had before they shared one home: a
change to the hash (or to how a user calls it) changes training batches,
augmentations and negatives, so it has to show here first.
"""

from __future__ import annotations

import re

import numpy as np
from launch import ROOT

from pksampler.datasets.batch_augment import keyed_uniform
from pksampler.hashing import GOLDEN, mix64, splitmix64
from pksampler.samplers import _permute
from pksampler.samplers._permute import keyed_permute
from pksampler.train.evaluation.queries import stratified_queries
from pksampler.train.modeling.sharded_head import sampled

SOURCES = ("pksampler", "samplers", "datasets", "train")


def test_splitmix64_gives_the_reference_generators_first_outputs():
    # SplitMix64 seeded with 0: state k*GOLDEN, outputs e220a8397b1dcdaf, 6e789e6aa1b965f4, 06c45d188009454f
    with np.errstate(over="ignore"):
        states = np.arange(3, dtype=np.uint64) * GOLDEN
    assert [int(v) for v in splitmix64(states)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert int(splitmix64(np.uint64(2**64 - 1))) == 0xE4D971771B652C20  # the add wraps
    assert int(mix64(np.uint64(1))) == 0x5692161D100B05E5


def test_mix64_is_a_bijection_on_a_sample_and_keeps_shape():
    values = np.random.default_rng(0).integers(0, 2**64, size=20_000, dtype=np.uint64)
    assert np.unique(mix64(values)).size == np.unique(values).size
    assert mix64(values.reshape(100, 200)).shape == (100, 200)


def test_the_users_draw_what_they_drew_with_their_own_copies():
    assert _permute.mix64 is mix64
    assert keyed_uniform(7, 3, [0, 5, 10**9], 2).tolist() == [
        [0.20749161671633742, 0.3541378623215824], [0.4721423550867254, 0.9400192089314011],
        [0.8666674762911911, 0.6924222915848093]]
    assert np.flatnonzero(sampled(np.arange(40), seed=3, step=11, rate=0.25)).tolist() == [2, 3, 4, 15, 21, 32, 35]
    assert stratified_queries(np.repeat(np.arange(6), 7), 9, seed=4).tolist() == [3, 5, 13, 19, 25, 26, 30, 33, 37]
    positions = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    assert keyed_permute(positions, np.array([5, 1000]), np.array([1, 2], dtype=np.uint64)).tolist() == [
        [3, 1, 2, 0], [228, 683, 758, 996]]


def test_the_finaliser_constants_are_written_in_one_module():
    homes = sorted(str(path.relative_to(ROOT)) for folder in SOURCES for path in (ROOT / folder).rglob("*.py")
                   if re.search(r"0x(BF58476D1CE4E5B9|94D049BB133111EB)", path.read_text(encoding="utf-8"), re.I))
    assert homes == ["pksampler/hashing.py"]

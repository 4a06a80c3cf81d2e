"""Augmentation ranges: RandomRotation, the train preset's options, and the device augmentation that keeps them."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from pksampler.datasets.transforms import RandomRotation, sample_rng, train_preset


def _image() -> Image.Image:
    array = np.zeros((32, 32, 3), dtype=np.uint8)
    array[:, :16] = (200, 40, 40)   # left half red, right half blue
    array[:, 16:] = (40, 40, 200)
    return Image.fromarray(array)


def test_rotation_is_keyed_by_the_generator_and_keeps_the_size():
    rotate = RandomRotation(30)
    first = np.asarray(rotate(_image(), sample_rng(0, 0, 5)))
    again = np.asarray(rotate(_image(), sample_rng(0, 0, 5)))
    other = np.asarray(rotate(_image(), sample_rng(0, 1, 5)))
    assert first.shape == (32, 32, 3)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_rotation_fills_corners_with_the_mean_colour_not_black():
    rotated = np.asarray(RandomRotation(45)(_image(), np.random.default_rng(1)))
    assert rotated.reshape(-1, 3).sum(axis=1).min() > 100  # no black pixel anywhere


def test_zero_rotation_is_the_identity():
    assert np.array_equal(np.asarray(RandomRotation(0)(_image(), np.random.default_rng(0))), np.asarray(_image()))


def test_rotation_rejects_out_of_range_degrees():
    with pytest.raises(ValueError, match=r"RandomRotation\(degrees=\) must be in \[0, 180\], got 200"):
        RandomRotation(200)


def test_train_preset_adds_rotation_only_when_asked():
    assert not any(isinstance(t, RandomRotation) for t in train_preset(24).transforms)
    preset = train_preset(24, rotation=15, scale=(0.3, 1.0), jitter=0.4)
    assert isinstance(preset.transforms[0], RandomRotation)
    out = preset(_image(), sample_rng(0, 0, 0))
    assert tuple(out.shape) == (3, 24, 24)


def test_the_device_augmentation_keeps_the_train_presets_strengths():
    from pksampler.datasets import BatchAugment
    from pksampler.datasets.transforms import ColorJitter, RandomHorizontalFlip, RandomResizedCrop

    preset = {type(t): t for t in train_preset(24).transforms}
    device = BatchAugment(24)
    crop, flip, jitter = preset[RandomResizedCrop], preset[RandomHorizontalFlip], preset[ColorJitter]
    assert device.scale == crop.scale == (0.6, 1.0)
    assert device.ratio == pytest.approx(crop.ratio) and crop.ratio == pytest.approx((3 / 4, 4 / 3))
    assert device.flip == flip.p == 0.5
    assert device.jitter == jitter.brightness == jitter.contrast == jitter.saturation == 0.3
    assert device.rotation == 0.0 and RandomRotation not in preset
    options = BatchAugment(24, scale=(0.3, 1.0), jitter=0.4, rotation=15)
    assert (options.scale, options.jitter, options.rotation) == ((0.3, 1.0), 0.4, 15.0)


def test_device_rotation_rejects_out_of_range_degrees():
    from pksampler.datasets import BatchAugment

    with pytest.raises(ValueError, match=r"BatchAugment\(rotation=\) must be in \[0, 180\], got 200"):
        BatchAugment(24, rotation=200)

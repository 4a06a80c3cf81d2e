"""Batched device-side augmentation: keyed by (seed, epoch, index), independent of batch, order and rank split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageEnhance

from pksampler.datasets import BatchAugment, CenterView, SyntheticProducts, ToUint8, eval_preset, keyed_uniform
from pksampler.datasets.transforms import IMAGENET_MEAN, IMAGENET_STD

MEAN = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


def _batch(n: int = 12, size: int = 32) -> torch.Tensor:
    dataset = SyntheticProducts(4, 6, image_size=size, transform=ToUint8(size))
    return torch.stack([dataset[i][0] for i in range(n)])


def _unnormalise(x: torch.Tensor) -> torch.Tensor:
    return x * STD + MEAN


def test_keyed_uniform_is_a_pure_function_of_seed_epoch_index_and_draw():
    keys = np.array([5, 0, 17, 3, 10**9])
    table = keyed_uniform(7, 2, keys, 6)
    assert table.shape == (5, 6) and table.min() >= 0.0 and table.max() < 1.0
    shuffled = keyed_uniform(7, 2, keys[::-1], 6)[::-1]
    assert np.array_equal(table, shuffled)
    assert np.array_equal(table[2:3], keyed_uniform(7, 2, [17], 6))
    assert not np.isin(table, keyed_uniform(7, 3, keys, 6)).any()  # another epoch: unrelated numbers
    assert not np.isin(table, keyed_uniform(8, 2, keys, 6)).any()  # another seed too
    many = keyed_uniform(0, 0, np.arange(20000), 2)
    assert abs(many.mean() - 0.5) < 0.01 and abs(np.corrcoef(many[:-1, 0], many[1:, 0])[0, 1]) < 0.03


def test_a_sample_is_augmented_alike_in_any_batch_order_or_rank_split():
    images, keys = _batch(), np.arange(100, 112)
    augment = BatchAugment(24, seed=3)
    whole = augment(images, keys, 4)
    order = np.random.default_rng(0).permutation(12)
    shuffled = augment(images[order], keys[order], 4)
    assert torch.equal(shuffled, whole[order])
    for world in (2, 3, 4):  # rank r takes a contiguous slice of the global batch
        parts = [augment(images[r * 12 // world:(r + 1) * 12 // world], keys[r * 12 // world:(r + 1) * 12 // world], 4)
                 for r in range(world)]
        assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(augment(images[5:6], keys[5:6], 4), whole[5:6])


def test_epochs_and_seeds_give_other_augmentations():
    images, keys = _batch(), np.arange(12)
    first = BatchAugment(24, seed=0)(images, keys, 0)
    assert first.shape == (12, 3, 24, 24) and first.dtype == torch.float32
    assert torch.equal(first, BatchAugment(24, seed=0)(images, keys, 0))
    for other in (BatchAugment(24, seed=0)(images, keys, 1), BatchAugment(24, seed=1)(images, keys, 0)):
        differs = (other - first).abs().flatten(1).amax(dim=1) > 1e-3
        assert differs.all()


def test_parameters_stay_inside_the_configured_ranges():
    augment = BatchAugment(24, seed=0, scale=(0.3, 0.9), ratio=(0.5, 2.0), jitter=0.4, rotation=20)
    params = augment.parameters(np.arange(5000), epoch=1)
    area = params["width"] * params["height"]
    aspect = params["width"] / params["height"]
    assert area.min() >= 0.3 - 1e-9 and area.max() <= 0.9 + 1e-9
    assert aspect.min() >= 0.5 - 1e-9 and aspect.max() <= 2.0 + 1e-9
    assert params["left"].min() >= 0 and (params["left"] + params["width"]).max() <= 1 + 1e-12
    assert params["top"].min() >= 0 and (params["top"] + params["height"]).max() <= 1 + 1e-12
    assert np.abs(params["angle"]).max() <= 20 and np.abs(params["angle"]).max() > 19
    assert params["factors"].min() >= 0.6 and params["factors"].max() <= 1.4
    assert params["factors"].min() < 0.62 and params["factors"].max() > 1.38
    assert 0.47 < params["flip"].mean() < 0.53
    orders = {tuple(o) for o in params["order"]}
    assert len(orders) == 6  # every order of brightness, contrast, saturation occurs
    # Crops that do not fit (area x aspect beyond the image) fall back to the whole image, as torchvision does.
    wide = BatchAugment(24, scale=(1.0, 1.0), ratio=(2.0, 3.0)).parameters(np.arange(50), 0)
    assert np.allclose(wide["width"], 1.0) and np.allclose(wide["height"], 1.0)


def test_the_whole_image_at_its_own_size_comes_back_as_it_is_or_mirrored():
    images = _batch(size=24)
    augment = BatchAugment(24, seed=0, scale=(1.0, 1.0), ratio=(1.0, 1.0), jitter=0.0)
    out = _unnormalise(augment(images, np.arange(12), 0))
    flips = augment.parameters(np.arange(12), 0)["flip"]
    assert 0 < flips.sum() < 12
    source = images.float() / 255
    for i in range(12):
        expected = source[i].flip(-1) if flips[i] else source[i]
        assert torch.allclose(out[i], expected, atol=1e-5), i


@pytest.mark.parametrize("op, enhancer", [(0, ImageEnhance.Brightness), (1, ImageEnhance.Contrast),
                                          (2, ImageEnhance.Color)])
def test_colour_jitter_matches_pillows_image_enhance(op, enhancer):
    image = SyntheticProducts(2, 2, image_size=32).load(1)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)[None]
    for factor in (0.7, 1.3):
        factors = torch.ones(1, 3)
        factors[0, op] = factor
        ours = BatchAugment._colour(pixels, factors, np.array([[0, 1, 2]]))[0].permute(1, 2, 0).numpy() * 255
        theirs = np.asarray(enhancer(image).enhance(factor), dtype=np.float32)
        assert np.abs(ours - theirs).max() <= 2.0, (op, factor)


def test_rotation_fills_corners_with_the_mean_colour_and_zero_rotation_changes_nothing():
    images = torch.zeros(4, 3, 16, 16, dtype=torch.uint8)
    images[:, 0] = 200
    images[:, 2, :, 8:] = 200  # left half red, right half magenta
    rotated = _unnormalise(BatchAugment(16, scale=(1, 1), ratio=(1, 1), jitter=0, flip=0, rotation=45)(
        images, np.arange(4), 0))
    assert rotated.sum(dim=1).min() > 0.5  # no black corner anywhere
    plain = BatchAugment(16, seed=2, rotation=0)(images, np.arange(4), 0)
    assert torch.equal(plain, BatchAugment(16, seed=2)(images, np.arange(4), 0))


def test_center_view_is_the_eval_preset_on_the_shipped_square():
    dataset = SyntheticProducts(2, 3, image_size=48)
    for index in range(6):
        image = dataset.load(index)
        ours = CenterView(40)(ToUint8(46)(image)[None])[0]
        reference = eval_preset(40)(image, None)
        assert torch.allclose(ours, reference, atol=1e-5)


def test_to_uint8_ships_the_centre_square_at_the_given_size():
    array = np.zeros((30, 60, 3), dtype=np.uint8)
    array[:, 15:45] = (10, 200, 30)  # the centre square is green, the sides black
    out = ToUint8(20)(Image.fromarray(array))
    assert out.dtype == torch.uint8 and tuple(out.shape) == (3, 20, 20)
    assert torch.equal(out[:, 2:-2, 2:-2], torch.tensor([10, 200, 30], dtype=torch.uint8).view(3, 1, 1).expand(3, 16, 16))
    gray = ToUint8(8)(Image.fromarray(np.full((8, 8), 77, dtype=np.uint8)))
    assert tuple(gray.shape) == (3, 8, 8) and int(gray.min()) == int(gray.max()) == 77


def test_bad_arguments_name_the_argument_and_the_rule():
    with pytest.raises(ValueError, match=r"BatchAugment\(scale=\) must satisfy 0.0 < low <= high <= 1.0, got \(0.5, 1.2\)"):
        BatchAugment(24, scale=(0.5, 1.2))
    with pytest.raises(ValueError, match=r"BatchAugment\(jitter=\) must be in \[0, 1\), got 1.5"):
        BatchAugment(24, jitter=1.5)
    with pytest.raises(ValueError, match=r"ToUint8\(size=\) must be a positive int, got 0"):
        ToUint8(0)
    with pytest.raises(TypeError, match=r"BatchAugment expects a uint8 batch \(N, 3, H, W\), got torch.float32"):
        BatchAugment(8)(torch.zeros(2, 3, 8, 8), [0, 1], 0)
    with pytest.raises(ValueError, match=r"BatchAugment: 1 indices for a batch of 2 images"):
        BatchAugment(8)(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), [0], 0)

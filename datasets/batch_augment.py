"""Batched augmentation on the rank's device, keyed by (seed, epoch, sample index).

DataLoader workers only decode (see :class:`~pksampler.datasets.transforms.ToUint8`)
and ship uint8 batches ``(N, 3, S, S)`` with each sample's dataset index. This
module turns such a batch into the model's input where the model runs:

1. Every random number of sample ``i`` comes from :func:`keyed_uniform`, a
   counter-based hash (SplitMix64) of ``(seed, epoch, index, draw)``: no
   generator state, so a sample is augmented identically whatever batch, order,
   worker or rank it arrives in, and W ranks train the model of one process.
2. :class:`BatchAugment` (training): a random resized crop (area fraction in
   ``scale``, aspect ratio in ``ratio``, up to 10 tries as torchvision does, then
   the whole image), an optional rotation, a horizontal flip, as one affine map per
   sample (``affine_grid`` + ``grid_sample``, bilinear); then brightness, contrast
   and saturation in a random order per sample (the semantics of Pillow's
   ``ImageEnhance``, clipped after each), and normalisation.
3. :class:`CenterView` (evaluation, hard-negative embedding): a centre crop by
   slicing and normalisation; no randomness.

The defaults are the strengths of :func:`~pksampler.datasets.transforms.train_preset`:
area 0.6-1, aspect 3/4-4/3, flip 0.5, jitter 0.3, no rotation.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from pksampler.hashing import GOLDEN, splitmix64

from .transforms import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["BatchAugment", "CenterView", "keyed_uniform"]

_CROP_TRIES = 10
# Columns of the per-sample uniform table.
_AREA, _ASPECT = 0, _CROP_TRIES  # 10 tries each
_LEFT, _TOP, _FLIP, _ANGLE = 2 * _CROP_TRIES, 2 * _CROP_TRIES + 1, 2 * _CROP_TRIES + 2, 2 * _CROP_TRIES + 3
_JITTER = 2 * _CROP_TRIES + 4  # brightness, contrast, saturation factors
_ORDER = _JITTER + 3  # three keys whose ranks give the jitter order
_DRAWS = _ORDER + 3


def keyed_uniform(seed: int, epoch: int, indices: np.ndarray | torch.Tensor | Sequence[int], draws: int) -> np.ndarray:
    """``(len(indices), draws)`` float64 uniforms in [0, 1), a pure function of (seed, epoch, index, draw).

    A counter-based generator: the same key gives the same numbers in any
    process, batch or order; neighbouring keys give unrelated numbers.
    """
    keys = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices, dtype=np.int64).reshape(-1)
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"keyed_uniform(draws=) must be a positive int, got {draws!r}")
    with np.errstate(over="ignore"):
        state = splitmix64(splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF)) ^ np.uint64(epoch & 0xFFFFFFFFFFFFFFFF))
        state = splitmix64(np.full(keys.shape, state, dtype=np.uint64) ^ keys.astype(np.uint64))
        bits = splitmix64(state[:, None] ^ (np.arange(draws, dtype=np.uint64)[None, :] * GOLDEN))
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _check_range(owner: str, name: str, pair: Sequence[float], low: float, high: float) -> tuple[float, float]:
    a, b = (float(v) for v in pair)
    if not low < a <= b <= high:
        raise ValueError(f"{owner}({name}=) must satisfy {low} < low <= high <= {high}, got {tuple(pair)!r}")
    return a, b


def _normalise(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return (images - mean.to(images.device)) / std.to(images.device)


def _as_float(images: torch.Tensor, owner: str) -> torch.Tensor:
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise TypeError(f"{owner} expects a uint8 batch (N, 3, H, W), got {images.dtype} {tuple(images.shape)}")
    return images.float().div_(255.0)


class CenterView:
    """Evaluation input: the centre ``size`` x ``size`` of a uint8 batch, as normalised float32.

    The slice is exact (no resampling), so with workers shipping the short-side
    square at ``round(size * 8 / 7)`` this is :func:`~pksampler.datasets.transforms.eval_preset`.
    """

    def __init__(self, size: int, *, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"CenterView(size=) must be a positive int, got {size!r}")
        self.size = size
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        height, width = images.shape[-2:]
        if min(height, width) < self.size:
            raise ValueError(f"CenterView(size={self.size}) needs images of at least that side, got {height}x{width}")
        top, left = (height - self.size) // 2, (width - self.size) // 2
        crop = images[..., top:top + self.size, left:left + self.size]
        return _normalise(_as_float(crop, "CenterView"), self.mean, self.std)


class BatchAugment:
    """Training input: keyed random crop, rotation, flip, colour jitter and normalisation of a uint8 batch.

    Args:
        size: output side in pixels.
        seed: the augmentation seed (the run's seed).
        scale: the crop's area range, as a fraction of the image.
        ratio: the crop's aspect-ratio range (width / height).
        flip: probability of a horizontal flip.
        jitter: brightness, contrast and saturation strength: factors in ``[1 - jitter, 1 + jitter]``.
        rotation: largest rotation in degrees (0: none); corners outside the
            image take the image's mean colour.

    ``augment(images, indices, epoch)`` maps uint8 ``(N, 3, H, W)`` on any device
    to float32 ``(N, 3, size, size)`` on the same device; ``indices`` are the
    dataset indices of the samples (the keys).

    Example::

        augment = BatchAugment(224, seed=0)
        for images, labels, indices in loader:              # uint8 from the workers
            inputs = augment(images.to(device), indices, epoch)
    """

    def __init__(self, size: int, *, seed: int = 0, scale: tuple[float, float] = (0.6, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: float = 0.5, jitter: float = 0.3,
                 rotation: float = 0.0, mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"BatchAugment(size=) must be a positive int, got {size!r}")
        self.size, self.seed = size, int(seed)
        self.scale = _check_range("BatchAugment", "scale", scale, 0.0, 1.0)
        self.ratio = _check_range("BatchAugment", "ratio", ratio, 0.0, math.inf)
        if not 0 <= flip <= 1:
            raise ValueError(f"BatchAugment(flip=) must be in [0, 1], got {flip!r}")
        if not 0 <= jitter < 1:
            raise ValueError(f"BatchAugment(jitter=) must be in [0, 1), got {jitter!r}")
        if not 0 <= rotation <= 180:
            raise ValueError(f"BatchAugment(rotation=) must be in [0, 180], got {rotation!r}")
        self.flip, self.jitter, self.rotation = float(flip), float(jitter), float(rotation)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)

    def __repr__(self) -> str:
        return (f"BatchAugment(size={self.size}, seed={self.seed}, scale={self.scale}, ratio={self.ratio}, "
                f"flip={self.flip}, jitter={self.jitter}, rotation={self.rotation})")

    def parameters(self, indices, epoch: int, aspect: float = 1.0) -> dict[str, np.ndarray]:
        """Each sample's crop box (fractions of the image), flip, angle, jitter factors and jitter order.

        ``aspect`` is the input's width / height. Pure numpy; the same for a
        sample in any batch.
        """
        u = keyed_uniform(self.seed, epoch, indices, _DRAWS)
        area = self.scale[0] + (self.scale[1] - self.scale[0]) * u[:, _AREA:_AREA + _CROP_TRIES]
        log_low, log_high = math.log(self.ratio[0]), math.log(self.ratio[1])
        crop_aspect = np.exp(log_low + (log_high - log_low) * u[:, _ASPECT:_ASPECT + _CROP_TRIES])
        # Width and height as fractions of the input's width and height.
        width = np.sqrt(area * crop_aspect / aspect)
        height = np.sqrt(area / crop_aspect * aspect)
        fits = (width <= 1.0) & (height <= 1.0)
        first = np.where(fits.any(axis=1), fits.argmax(axis=1), -1)
        rows = np.arange(u.shape[0])
        width = np.where(first >= 0, width[rows, first], 1.0)
        height = np.where(first >= 0, height[rows, first], 1.0)
        return {
            "left": u[:, _LEFT] * (1.0 - width), "top": u[:, _TOP] * (1.0 - height),
            "width": width, "height": height,
            "flip": u[:, _FLIP] < self.flip,
            "angle": (2.0 * u[:, _ANGLE] - 1.0) * self.rotation,
            "factors": 1.0 + (2.0 * u[:, _JITTER:_JITTER + 3] - 1.0) * self.jitter,
            "order": np.argsort(u[:, _ORDER:_ORDER + 3], axis=1),
        }

    def __call__(self, images: torch.Tensor, indices, epoch: int) -> torch.Tensor:
        pixels = _as_float(images, "BatchAugment")
        if len(indices) != pixels.shape[0]:
            raise ValueError(f"BatchAugment: {len(indices)} indices for a batch of {pixels.shape[0]} images")
        params = self.parameters(indices, epoch, aspect=pixels.shape[-1] / pixels.shape[-2])
        out = self._geometry(pixels, params)
        out = self._colour(out, torch.as_tensor(params["factors"], dtype=torch.float32, device=out.device),
                           params["order"])
        return _normalise(out, self.mean, self.std)

    def _geometry(self, pixels: torch.Tensor, params: dict[str, np.ndarray]) -> torch.Tensor:
        """Crop, rotate and flip as one affine map per sample, resampled bilinearly to ``size``."""
        n, device = pixels.shape[0], pixels.device
        # In grid_sample's [-1, 1] coordinates: the crop's centre and half-extent.
        centre_x = -1.0 + 2.0 * params["left"] + params["width"]
        centre_y = -1.0 + 2.0 * params["top"] + params["height"]
        angle = np.deg2rad(params["angle"])
        cos, sin = np.cos(angle), np.sin(angle)
        sign = np.where(params["flip"], -1.0, 1.0)
        theta = np.zeros((n, 2, 3))
        theta[:, 0, 0], theta[:, 0, 1], theta[:, 0, 2] = sign * params["width"] * cos, -params["width"] * sin, centre_x
        theta[:, 1, 0], theta[:, 1, 1], theta[:, 1, 2] = sign * params["height"] * sin, params["height"] * cos, centre_y
        theta = torch.as_tensor(theta, dtype=torch.float32, device=device)
        grid = F.affine_grid(theta, [n, 3, self.size, self.size], align_corners=False)
        if self.rotation == 0:
            return F.grid_sample(pixels, grid, mode="bilinear", padding_mode="border", align_corners=False)
        # Rotated corners fall outside the image: fill them with the image's mean colour.
        inside = torch.ones_like(pixels[:, :1])
        sampled = F.grid_sample(torch.cat([pixels, inside], dim=1), grid, mode="bilinear", padding_mode="zeros",
                                align_corners=False)
        weight = sampled[:, 3:]
        fill = pixels.mean(dim=(2, 3), keepdim=True)
        return sampled[:, :3] + (1.0 - weight) * fill

    @staticmethod
    def _colour(pixels: torch.Tensor, factors: torch.Tensor, order: np.ndarray) -> torch.Tensor:
        """Brightness, contrast, saturation in each sample's own order (Pillow's ImageEnhance semantics).

        Round r applies, to every sample, the operation at position r of its
        order; the other two operations get factor 1 (the identity) in that round.
        """
        luma = torch.tensor([0.299, 0.587, 0.114], device=pixels.device).view(1, 3, 1, 1)
        order_t = torch.as_tensor(order, device=pixels.device)
        ones = torch.ones_like(factors[:, 0])
        for position in range(3):
            chosen = order_t[:, position]
            for op in range(3):
                factor = torch.where(chosen == op, factors[:, op], ones).view(-1, 1, 1, 1)
                if op == 0:  # brightness: blend with black
                    pixels = pixels * factor
                elif op == 1:  # contrast: blend with the mean grey level
                    grey = (pixels * luma).sum(dim=1, keepdim=True).mean(dim=(2, 3), keepdim=True)
                    pixels = grey + factor * (pixels - grey)
                else:  # saturation: blend with the greyscale image
                    grey = (pixels * luma).sum(dim=1, keepdim=True)
                    pixels = grey + factor * (pixels - grey)
                pixels = pixels.clamp(0.0, 1.0)
        return pixels

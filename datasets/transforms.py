"""Image transforms in plain numpy/Pillow/torch, with per-sample randomness.

A random transform draws from the ``numpy.random.Generator`` it is given; the
datasets key that generator by ``(seed, epoch, sample index)``, so a sample
gets the same augmentation on whichever rank or worker loads it. The trainer
itself runs only :class:`ToUint8` in its workers and augments on the device
with the same keying (:mod:`pksampler.datasets.batch_augment`). Transforms are callables
``t(image, rng)``; any other callable (a torchvision transform, a lambda) is
called with the image alone.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image, ImageEnhance

__all__ = [
    "CenterCrop",
    "ColorJitter",
    "Compose",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Normalize",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "RandomRotation",
    "Resize",
    "ToTensor",
    "ToUint8",
    "apply_transform",
    "eval_preset",
    "sample_rng",
    "train_preset",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one sample's augmentation: keyed by (seed, epoch, index), never global."""
    return np.random.default_rng([seed, epoch, index])


def apply_transform(transform: Callable | None, image: Any, rng: np.random.Generator) -> Any:
    """Call a pksampler transform with ``rng``; call any other callable with the image only."""
    if transform is None:
        return image
    if getattr(transform, "takes_rng", False):
        return transform(image, rng)
    return transform(image)


class _Transform:
    takes_rng = True

    def __call__(self, image: Any, rng: np.random.Generator) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _size_pair(size: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        pair = (size, size)
    elif isinstance(size, (tuple, list)) and len(size) == 2:
        pair = (int(size[0]), int(size[1]))
    else:
        raise ValueError(f"{name}(size=) must be an int or a (height, width) pair, got {size!r}")
    if min(pair) < 1:
        raise ValueError(f"{name}(size=) must be positive, got {size!r}")
    return pair


class Compose(_Transform):
    """Apply transforms in order, passing the same generator to each."""

    def __init__(self, transforms: Sequence[Callable]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Any, rng: np.random.Generator) -> Any:
        for transform in self.transforms:
            image = apply_transform(transform, image, rng)
        return image


class Resize(_Transform):
    """Resize to ``size`` (int: the shorter side; pair: exact height, width)."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = size
        _size_pair(size, "Resize")

    def __call__(self, image: Image.Image, rng: np.random.Generator) -> Image.Image:
        if isinstance(self.size, int):
            w, h = image.size
            scale = self.size / min(w, h)
            target = (max(1, round(w * scale)), max(1, round(h * scale)))
        else:
            target = (self.size[1], self.size[0])
        return image.resize(target, Image.BILINEAR)


class CenterCrop(_Transform):
    """Crop the centre ``size`` region."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = _size_pair(size, "CenterCrop")

    def __call__(self, image: Image.Image, rng: np.random.Generator) -> Image.Image:
        h, w = self.size
        left = max(0, (image.width - w) // 2)
        top = max(0, (image.height - h) // 2)
        return image.crop((left, top, left + w, top + h))


class RandomResizedCrop(_Transform):
    """Crop a random area fraction in ``scale`` with aspect ratio in ``ratio``, resized to ``size``."""

    def __init__(self, size: int | Sequence[int], scale: tuple[float, float] = (0.5, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.size = _size_pair(size, "RandomResizedCrop")
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"RandomResizedCrop(scale=) must satisfy 0 < low <= high <= 1, got {scale!r}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"RandomResizedCrop(ratio=) must satisfy 0 < low <= high, got {ratio!r}")
        self.scale, self.ratio = tuple(scale), tuple(ratio)

    def __call__(self, image: Image.Image, rng: np.random.Generator) -> Image.Image:
        width, height = image.size
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                left = int(rng.integers(0, width - w + 1))
                top = int(rng.integers(0, height - h + 1))
                break
        else:  # fall back to a centre crop of the whole image
            w, h, left, top = width, height, 0, 0
        box = (left, top, left + w, top + h)
        return image.resize((self.size[1], self.size[0]), Image.BILINEAR, box=box)


class RandomHorizontalFlip(_Transform):
    """Mirror left-right with probability ``p``."""

    def __init__(self, p: float = 0.5) -> None:
        if not 0 <= p <= 1:
            raise ValueError(f"RandomHorizontalFlip(p=) must be in [0, 1], got {p!r}")
        self.p = p

    def __call__(self, image: Image.Image, rng: np.random.Generator) -> Image.Image:
        return image.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < self.p else image


class RandomRotation(_Transform):
    """Rotate by an angle drawn uniformly from ``[-degrees, degrees]`` about the centre, same size.

    Corners that leave the image are filled with its mean colour, so the
    network does not learn black corners as a cue. Photographed objects appear
    at any in-plane angle (a phone held askew), which crops and flips do not
    cover.
    """

    def __init__(self, degrees: float) -> None:
        if not 0 <= degrees <= 180:
            raise ValueError(f"RandomRotation(degrees=) must be in [0, 180], got {degrees!r}")
        self.degrees = degrees

    def __call__(self, image: Image.Image, rng: np.random.Generator) -> Image.Image:
        angle = float(rng.uniform(-self.degrees, self.degrees))
        if self.degrees == 0:
            return image
        fill = tuple(int(v) for v in np.asarray(image.convert("RGB")).reshape(-1, 3).mean(axis=0))
        return image.convert("RGB").rotate(angle, resample=Image.BILINEAR, fillcolor=fill)


class ColorJitter(_Transform):
    """Random brightness, contrast and saturation factors in ``[1 - x, 1 + x]``."""

    def __init__(self, brightness: float = 0.3, contrast: float = 0.3, saturation: float = 0.3) -> None:
        for name, value in (("brightness", brightness), ("contrast", contrast), ("saturation", saturation)):
            if not 0 <= value < 1:
                raise ValueError(f"ColorJitter({name}=) must be in [0, 1), got {value!r}")
        self.brightness, self.contrast, self.saturation = brightness, contrast, saturation

    def __call__(self, image: Image.Image, rng: np.random.Generator) -> Image.Image:
        factors = rng.uniform(-1.0, 1.0, size=3) * (self.brightness, self.contrast, self.saturation) + 1.0
        order = rng.permutation(3)
        enhancers = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)
        for which in order:
            image = enhancers[which](image).enhance(float(factors[which]))
        return image


class ToTensor(_Transform):
    """PIL RGB image -> float32 tensor (3, H, W) in [0, 1]."""

    def __call__(self, image: Image.Image, rng: np.random.Generator) -> torch.Tensor:
        array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
        return torch.from_numpy(array.transpose(2, 0, 1).copy())


class Normalize(_Transform):
    """Subtract ``mean`` and divide by ``std`` per channel.

    Computed in numpy on the tensor's memory: a per-sample op this small runs
    in microseconds on one thread, while torch's intra-op thread pool can take
    tens of milliseconds for it on a busy machine (outside DataLoader workers,
    which torch limits to one thread).
    """

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError(f"Normalize expects 3 means and 3 positive stds, got mean={mean!r} std={std!r}")
        self.mean, self.std = tuple(mean), tuple(std)

    def __call__(self, tensor: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        array = tensor.detach().cpu().numpy()
        mean = np.asarray(self.mean, dtype=array.dtype)[:, None, None]
        std = np.asarray(self.std, dtype=array.dtype)[:, None, None]
        return torch.from_numpy((array - mean) / std)


class ToUint8(_Transform):
    """The centre square of the short side, resized once to ``size`` x ``size``: uint8 tensor (3, size, size).

    The worker's whole job in the batched pipeline: one Pillow resize (with
    ``box=``, so the crop costs nothing) of an image the dataset decoded in
    draft mode, shipped as uint8 (a quarter of the bytes of float32). Crops,
    flips, colour jitter and normalisation follow on the rank's device
    (:mod:`pksampler.datasets.batch_augment`). Takes no randomness.
    """

    takes_rng = False

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"ToUint8(size=) must be a positive int, got {size!r}")
        self.size = size

    def __call__(self, image: Image.Image) -> torch.Tensor:
        if image.mode != "RGB":
            image = image.convert("RGB")
        width, height = image.size
        side = min(width, height)
        left, top = (width - side) // 2, (height - side) // 2
        box = (left, top, left + side, top + side)
        if side == self.size and (width, height) == (side, side):
            square = image
        else:
            square = image.resize((self.size, self.size), Image.BILINEAR, box=box)
        # Pillow's bytes in a writable buffer: a third of the CPU time of np.array(square) (torch refuses read-only).
        pixels = torch.frombuffer(bytearray(square.tobytes()), dtype=torch.uint8)
        return pixels.view(self.size, self.size, 3).permute(2, 0, 1)


def train_preset(size: int, *, scale: tuple[float, float] = (0.6, 1.0), jitter: float = 0.3,
                 rotation: float = 0.0) -> Compose:
    """Random rotation (off by default), random resized crop, horizontal flip, colour jitter, to tensor, normalise.

    ``scale`` is the crop's area range, ``jitter`` the brightness, contrast
    and saturation strength, ``rotation`` the largest angle in degrees.
    """
    return Compose([
        *([RandomRotation(rotation)] if rotation else []),
        RandomResizedCrop(size, scale=scale),
        RandomHorizontalFlip(),
        ColorJitter(jitter, jitter, jitter),
        ToTensor(),
        Normalize(),
    ])


def eval_preset(size: int) -> Compose:
    """Resize (shorter side to size * 8/7), centre crop, to tensor, normalise."""
    return Compose([Resize(int(round(size * 8 / 7))), CenterCrop(size), ToTensor(), Normalize()])

"""SyntheticProducts: procedurally rendered "product" images, the built-in default data.

Each class is a distinct object -- outline shape, body and accent colours, a
surface pattern and a printed glyph -- and each image is a new view of it:
position, scale, rotation, aspect, lighting, a background colour and clutter
of other shapes. Everything is drawn with Pillow from generators keyed by
``(seed, class)`` and ``(seed, class, view)``, so the set is identical on every
machine and needs no download.

It is learnable but not trivial: raw-pixel k-NN retrieval on unseen classes
is far from perfect (clutter, pose and lighting move most pixels), while a
small CNN learns the invariances; README.md quotes both numbers.
"""

from __future__ import annotations

import colorsys
import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from pksampler.files import atomic_writer

from ._image import load_rgb
from .base import LabelledDataset

__all__ = ["SyntheticProducts", "render_product"]

SHAPES = ("circle", "square", "triangle", "pentagon", "hexagon", "star", "diamond", "ellipse", "cross", "capsule")
PATTERNS = ("solid", "hstripes", "vstripes", "dots", "checker", "band")
GLYPHS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"


def _rgb(hue: float, saturation: float, value: float) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb(hue % 1.0, saturation, value)
    return int(r * 255), int(g * 255), int(b * 255)


def _class_traits(seed: int, cls: int) -> dict:
    rng = np.random.default_rng([seed, cls, 0xC1A55])
    hue = rng.random()
    return {
        "shape": SHAPES[int(rng.integers(len(SHAPES)))],
        "pattern": PATTERNS[int(rng.integers(len(PATTERNS)))],
        "glyph": GLYPHS[int(rng.integers(len(GLYPHS)))],
        "body": _rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.7, 1.0)),
        "accent": _rgb(hue + rng.uniform(0.25, 0.75), rng.uniform(0.4, 1.0), rng.uniform(0.2, 1.0)),
        "aspect": float(rng.uniform(0.75, 1.3)),
        "stripe": int(rng.integers(3, 7)),
    }


def _outline(shape: str, w: int, h: int) -> list[tuple[float, float]] | None:
    cx, cy, rx, ry = w / 2, h / 2, w / 2 - 1, h / 2 - 1

    def regular(n: int, rotation: float = -math.pi / 2, inner: float | None = None) -> list[tuple[float, float]]:
        points = []
        steps = n * 2 if inner else n
        for i in range(steps):
            radius = (inner if inner and i % 2 else 1.0)
            angle = rotation + 2 * math.pi * i / steps
            points.append((cx + rx * radius * math.cos(angle), cy + ry * radius * math.sin(angle)))
        return points

    if shape == "triangle":
        return regular(3)
    if shape == "pentagon":
        return regular(5)
    if shape == "hexagon":
        return regular(6, 0.0)
    if shape == "star":
        return regular(5, inner=0.55)
    if shape == "diamond":
        return [(cx, cy - ry), (cx + rx * 0.7, cy), (cx, cy + ry), (cx - rx * 0.7, cy)]
    if shape == "cross":
        a, b = 0.33, 1.0
        return [(cx - rx * a, cy - ry * b), (cx + rx * a, cy - ry * b), (cx + rx * a, cy - ry * a), (cx + rx * b, cy - ry * a),
                (cx + rx * b, cy + ry * a), (cx + rx * a, cy + ry * a), (cx + rx * a, cy + ry * b), (cx - rx * a, cy + ry * b),
                (cx - rx * a, cy + ry * a), (cx - rx * b, cy + ry * a), (cx - rx * b, cy - ry * a), (cx - rx * a, cy - ry * a)]
    return None  # drawn with ellipse / rectangle primitives


@lru_cache(maxsize=16)
def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType sizing
        return ImageFont.load_default()


def _object_layer(traits: dict, width: int, height: int) -> Image.Image:
    """The object alone on a transparent RGBA canvas."""
    mask = Image.new("L", (width, height), 0)
    draw_mask = ImageDraw.Draw(mask)
    shape = traits["shape"]
    outline = _outline(shape, width, height)
    if outline is not None:
        draw_mask.polygon(outline, fill=255)
    elif shape in ("circle", "ellipse"):
        draw_mask.ellipse([1, 1, width - 2, height - 2], fill=255)
    elif shape == "capsule":
        draw_mask.rounded_rectangle([1, 1, width - 2, height - 2], radius=min(width, height) // 2, fill=255)
    else:  # square
        draw_mask.rounded_rectangle([1, 1, width - 2, height - 2], radius=min(width, height) // 10, fill=255)

    body = Image.new("RGB", (width, height), traits["body"])
    draw = ImageDraw.Draw(body)
    accent, n = traits["accent"], traits["stripe"]
    pattern = traits["pattern"]
    if pattern == "hstripes":
        for i in range(n):
            y0 = (2 * i) * height / (2 * n)
            draw.rectangle([0, y0, width, y0 + height / (2 * n)], fill=accent)
    elif pattern == "vstripes":
        for i in range(n):
            x0 = (2 * i) * width / (2 * n)
            draw.rectangle([x0, 0, x0 + width / (2 * n), height], fill=accent)
    elif pattern == "dots":
        step = max(width, height) / n
        r = step / 4
        for i in range(n + 1):
            for j in range(n + 1):
                x, y = (i + 0.5) * step, (j + 0.5) * step
                draw.ellipse([x - r, y - r, x + r, y + r], fill=accent)
    elif pattern == "checker":
        step_x, step_y = width / n, height / n
        for i in range(n):
            for j in range(n):
                if (i + j) % 2:
                    draw.rectangle([i * step_x, j * step_y, (i + 1) * step_x, (j + 1) * step_y], fill=accent)
    elif pattern == "band":
        draw.rectangle([0, height * 0.62, width, height * 0.85], fill=accent)
    # The printed glyph: a dark or light label in the middle.
    luminance = sum(traits["body"]) / 3
    ink = (20, 20, 20) if luminance > 140 else (240, 240, 240)
    font = _font(max(8, int(min(width, height) * 0.45)))
    draw.text((width / 2, height / 2), traits["glyph"], fill=ink, font=font, anchor="mm")
    layer = body.convert("RGBA")
    layer.putalpha(mask)
    return layer


def render_product(cls: int, view: int, *, image_size: int = 64, seed: int = 0) -> Image.Image:
    """Render view ``view`` of product class ``cls`` as an RGB image of ``image_size`` pixels."""
    traits = _class_traits(seed, cls)
    rng = np.random.default_rng([seed, cls, view, 0x71E3])
    canvas_size = image_size * 2  # draw at 2x, downsample: anti-aliasing
    background_colour = _rgb(rng.random(), rng.uniform(0.0, 0.35), rng.uniform(0.45, 0.95))
    canvas = Image.new("RGB", (canvas_size, canvas_size), background_colour)
    draw = ImageDraw.Draw(canvas)
    for _ in range(int(rng.integers(3, 9))):  # clutter: other shapes and lines
        colour = _rgb(rng.random(), rng.uniform(0.1, 0.7), rng.uniform(0.3, 1.0))
        x0, y0 = rng.uniform(0, canvas_size, 2)
        size = rng.uniform(0.06, 0.24) * canvas_size
        kind = int(rng.integers(3))
        if kind == 0:
            draw.ellipse([x0, y0, x0 + size, y0 + size * rng.uniform(0.5, 1.5)], fill=colour)
        elif kind == 1:
            draw.rectangle([x0, y0, x0 + size, y0 + size * rng.uniform(0.3, 1.2)], fill=colour)
        else:
            x1, y1 = rng.uniform(0, canvas_size, 2)
            draw.line([x0, y0, x1, y1], fill=colour, width=int(rng.integers(2, 6)))

    scale = rng.uniform(0.5, 0.75) * canvas_size
    aspect = traits["aspect"] * rng.uniform(0.9, 1.1)
    width, height = int(scale * math.sqrt(aspect)), int(scale / math.sqrt(aspect))
    layer = _object_layer(traits, max(width, 8), max(height, 8))
    layer = layer.rotate(float(rng.uniform(-35, 35)), resample=Image.BICUBIC, expand=True)
    free_x, free_y = max(canvas_size - layer.width, 0), max(canvas_size - layer.height, 0)
    position = (int(rng.uniform(0.15, 0.85) * free_x), int(rng.uniform(0.15, 0.85) * free_y))
    canvas.paste(layer, position, layer)

    image = canvas.resize((image_size, image_size), Image.BILINEAR)
    pixels = np.asarray(image, dtype=np.float32)
    light = rng.uniform(0.75, 1.2) * np.linspace(rng.uniform(0.85, 1.0), rng.uniform(0.85, 1.0), image_size)[None, :, None]
    pixels = pixels * light + rng.normal(0.0, 6.0, size=pixels.shape)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


class SyntheticProducts(LabelledDataset):
    """A deterministic set of rendered product images: ``num_classes`` x ``images_per_class``.

    Args:
        num_classes: number of products (classes).
        images_per_class: views per product.
        image_size: side of the square images in pixels.
        seed: selects the products and views; the same seed gives the same images everywhere.
        root: the explicit way to write an image folder: if given, the images are
            written once as PNG files to ``root/<class>/<view>.png`` (each file
            atomically, through :mod:`pksampler.files`) and read from there. By
            default (None) nothing is written: images are rendered in memory on
            the fly (about a millisecond each at 64 px).
        transform: applied to the RGB PIL image (see :mod:`.transforms`).
        augment_seed: seed of the per-sample augmentation generators.

    Sample ``i`` is class ``i // images_per_class``, view ``i % images_per_class``.
    """

    def __init__(self, num_classes: int, images_per_class: int, *, image_size: int = 64, seed: int = 0,
                 root: str | os.PathLike | None = None, transform: Callable | None = None,
                 augment_seed: int = 0) -> None:
        super().__init__(transform, seed=augment_seed)
        for name, value, low in (("num_classes", num_classes, 1), ("images_per_class", images_per_class, 1),
                                 ("image_size", image_size, 8)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"SyntheticProducts({name}=) must be an int >= {low}, got {value!r}")
        self.images_per_class = images_per_class
        self.image_size = image_size
        self.render_seed = seed
        self.labels = np.repeat(np.arange(num_classes, dtype=np.int64), images_per_class)
        self.classes = [f"product_{c:05d}" for c in range(num_classes)]
        self.root = Path(root) if root is not None else None
        if self.root is not None:
            self.write(self.root)

    def path(self, index: int) -> Path:
        """Where sample ``index`` lives under ``root``."""
        assert self.root is not None
        cls, view = divmod(index, self.images_per_class)
        return self.root / self.classes[cls] / f"{view:05d}.png"

    def write(self, root: Path) -> None:
        """Render every image not yet present under ``root`` (atomic per file)."""
        from tqdm import tqdm

        missing = [i for i in range(len(self)) if not self.path(i).is_file()]
        if not missing:
            return
        for name in {self.classes[i // self.images_per_class] for i in missing}:
            (root / name).mkdir(parents=True, exist_ok=True)
        for index in tqdm(missing, desc=f"rendering SyntheticProducts to {root}", unit="img",
                          disable=len(missing) < 2000, mininterval=1.0):
            with atomic_writer(self.path(index)) as stream:
                self.render(index).save(stream, format="PNG")

    def render(self, index: int) -> Image.Image:
        cls, view = divmod(int(index), self.images_per_class)
        return render_product(cls, view, image_size=self.image_size, seed=self.render_seed)

    def load(self, index: int) -> Image.Image:
        if self.root is not None:
            return load_rgb(self.path(index))
        return self.render(index)

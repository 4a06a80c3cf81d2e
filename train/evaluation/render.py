"""The result gallery: queries and their nearest gallery items as one labelled PNG.

Layout, top to bottom: an optional title; a header row naming the columns
("query", "1st", "2nd", ...); one row per query, the query framed grey and
each retrieved image framed green (same class as the query) or red (another
class), its similarity to the query written under it; a caption saying what
the colours and numbers mean, so the picture reads without this docstring.

Drawn with Pillow (a grid of images needs no plotting library); the file is
written atomically through :mod:`pksampler.files`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pksampler.arrays import as_numpy
from pksampler.files import atomic_write_bytes

__all__ = ["render_gallery", "save_gallery_png"]

_GREY, _GREEN, _RED = (128, 128, 128), (0, 170, 0), (210, 0, 0)
_TEXT, _MUTED = (20, 20, 20), (90, 90, 90)
_DARK_GREEN = (0, 120, 0)  # text: the frame green is too light on white
_LONG_NAMES = {"cos": "cosine", "ip": "inner-product"}


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        return ImageFont.load_default()


def _to_pil(image: Any):
    """PIL image, HWC/CHW array or tensor (uint8, or float in [0, 1] or any range) -> RGB PIL image."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = as_numpy(image, name="save_gallery_png(image)", kinds="fiub", contiguous=False)
    if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3):
        array = array.transpose(1, 2, 0)  # CHW -> HWC
    if array.dtype != np.uint8:
        kind = array.dtype.kind
        array = array.astype(np.float64)
        low, high = float(array.min()), float(array.max())
        limit = 1.0 if kind in "fb" else 255.0  # float/bool images are [0, 1]
        if low < 0.0 or high > limit:  # any other range: stretched to the full scale
            array, limit = (array - low) / (high - low + 1e-12), 1.0
        array = (array / limit * 255.0).round().clip(0, 255).astype(np.uint8)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    return Image.fromarray(array).convert("RGB")


def _text(draw: Any, xy: tuple[float, float], text: str, font: Any, fill: tuple[int, int, int],
          centred: bool = True) -> None:
    """Text centred on ``xy`` (or left-aligned, vertically centred); works with bitmap fonts too."""
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    x = xy[0] - (right + left) / 2 if centred else xy[0] - left
    draw.text((x, xy[1] - (bottom + top) / 2), text, fill=fill, font=font)


def _checked(rows: int, neighbour_images: Sequence[Sequence[Any]], correct: Any, similarities: Any):
    """Column count, ``correct`` as bools and ``similarities`` as float64, with shapes checked."""
    if rows == 0:
        raise ValueError("save_gallery_png(query_images=) is empty; pass at least one query image")
    columns = max((len(row) for row in neighbour_images), default=0)
    correct = as_numpy(correct, name="save_gallery_png(correct=)", kinds="biu", contiguous=False).astype(bool)
    if len(neighbour_images) != rows or correct.ndim != 2 or correct.shape[0] != rows or correct.shape[1] < columns:
        raise ValueError(
            f"save_gallery_png: {rows} query images need {rows} neighbour rows and correct of shape "
            f"({rows}, {columns}); got {len(neighbour_images)} rows and correct of shape {correct.shape}"
        )
    if similarities is not None:
        similarities = as_numpy(similarities, name="save_gallery_png(similarities=)", dtype=np.float64, ndim=2)
        if similarities.shape[0] != rows or similarities.shape[1] < columns:
            raise ValueError(f"save_gallery_png(similarities=) must have shape ({rows}, {columns}), "
                             f"got {similarities.shape}")
    return columns, correct, similarities


def render_gallery(
    query_images: Sequence[Any],
    neighbour_images: Sequence[Sequence[Any]],
    correct: Any,
    *,
    similarities: Any = None,
    similarity_name: str = "cos",
    title: str | None = None,
    cell: int = 96,
    border: int = 4,
):
    """Build the gallery as a PIL image (see :func:`save_gallery_png` for the arguments)."""
    from PIL import Image, ImageDraw

    rows = len(query_images)
    columns, correct, similarities = _checked(rows, neighbour_images, correct, similarities)
    font_size = max(11, min(18, cell // 6))
    font, small = _font(font_size), _font(max(10, font_size - 2))
    gap, line = 2 * border, font_size + 6
    pitch = cell + 2 * gap
    row_h = cell + 2 * border + (line if similarities is not None else 0) + gap
    caption = "Frame: green = same class as the query (correct), red = another class (wrong)."
    if similarities is not None:
        caption += f" Number: {_LONG_NAMES.get(similarity_name, similarity_name)} similarity to the query."
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    caption_width = measure.textbbox((0, 0), caption, font=small)[2]
    width = max((1 + columns) * pitch + gap, caption_width + 2 * gap)
    title_h = line + 4 if title else 0
    top = gap + title_h + line
    height = top + rows * row_h + line + gap
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    if title:
        _text(draw, (gap, gap + line // 2), title, _font(font_size + 2), _TEXT, centred=False)
    for c, text in enumerate(["query"] + [_ordinal(c + 1) for c in range(columns)]):
        _text(draw, (gap + c * pitch + pitch // 2, gap + title_h + line // 2), text, font, _TEXT)
    for r in range(rows):
        y0 = top + r * row_h + border
        for c, image in enumerate([query_images[r], *neighbour_images[r]]):
            x0 = gap + c * pitch + gap
            colour = _GREY if c == 0 else (_GREEN if correct[r, c - 1] else _RED)
            draw.rectangle([x0 - border, y0 - border, x0 + cell + border - 1, y0 + cell + border - 1], fill=colour)
            canvas.paste(_to_pil(image).resize((cell, cell)), (x0, y0))
            if c and similarities is not None and np.isfinite(similarities[r, c - 1]):
                label = f"{similarity_name} {similarities[r, c - 1]:.3f}"
                _text(draw, (x0 + cell // 2, y0 + cell + border + line // 2), label, small,
                      _DARK_GREEN if colour == _GREEN else colour)
    _text(draw, (gap, height - gap - line // 2), caption, small, _MUTED, centred=False)
    return canvas


def save_gallery_png(
    path: str | Path,
    query_images: Sequence[Any],
    neighbour_images: Sequence[Sequence[Any]],
    correct: Any,
    *,
    similarities: Any = None,
    similarity_name: str = "cos",
    title: str | None = None,
    cell: int = 96,
    border: int = 4,
) -> Path:
    """Write the result gallery PNG atomically; returns the path.

    Args:
        path: the PNG to write (folders are created).
        query_images: one image per row: PIL images, HWC/CHW uint8 or float arrays, or tensors.
        neighbour_images: per row, the retrieved images, nearest first.
        correct: ``(rows, columns)`` bools, True where the neighbour has the query's class.
        similarities: optional ``(rows, columns)`` scores written under each
            neighbour, e.g. ``RetrievalResult.similarities`` (cosine); NaN is left blank.
        similarity_name: the word before the number (``"cos"``, ``"ip"``, ``"-L2²"``).
        title: optional first line, e.g. ``"epoch 3: held-out classes, Recall@1 0.912"``.
        cell: side of each image in pixels; border: frame width in pixels.

    Example::

        save_gallery_png("galleries/epoch_003.png", queries, neighbours, correct,
                         similarities=result.similarities, title="epoch 3")
    """
    canvas = render_gallery(query_images, neighbour_images, correct, similarities=similarities,
                            similarity_name=similarity_name, title=title, cell=cell, border=border)
    buffer = io.BytesIO()
    canvas.save(buffer, format="PNG")
    return atomic_write_bytes(path, buffer.getvalue())

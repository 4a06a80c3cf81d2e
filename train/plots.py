"""Training curves drawn with Pillow (no plotting library needed)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Sequence

from PIL import Image, ImageDraw

from .checkpoint import atomic_write_bytes

__all__ = ["save_curves_png"]


def _panel(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int], xs: Sequence[float], ys: Sequence[float],
           title: str, colour: tuple[int, int, int]) -> None:
    left, top, right, bottom = box
    draw.rectangle(box, outline=(90, 90, 90))
    draw.text((left + 6, top + 4), title, fill=(0, 0, 0))
    if not xs:
        draw.text((left + 6, top + 20), "no data", fill=(120, 120, 120))
        return
    x_low, x_high = min(xs), max(xs)
    y_low, y_high = min(ys), max(ys)
    if x_high == x_low:
        x_high = x_low + 1
    if y_high == y_low:
        y_high = y_low + 1e-6
    pad = 24

    def point(x: float, y: float) -> tuple[float, float]:
        px = left + pad + (x - x_low) / (x_high - x_low) * (right - left - 2 * pad)
        py = bottom - pad - (y - y_low) / (y_high - y_low) * (bottom - top - 2 * pad)
        return px, py

    points = [point(x, y) for x, y in zip(xs, ys)]
    if len(points) > 1:
        draw.line(points, fill=colour, width=2)
    for p in points if len(points) < 40 else points[-1:]:
        draw.ellipse([p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3], fill=colour)
    draw.text((left + 6, bottom - 16), f"x: {x_low:g}..{x_high:g}   y: {y_low:.4g}..{y_high:.4g}", fill=(60, 60, 60))


def save_curves_png(path: str | Path, loss_steps: Sequence[float], losses: Sequence[float],
                    eval_epochs: Sequence[float], recalls: Sequence[float]) -> Path:
    """Two panels: training loss per step, held-out Recall@1 per evaluation."""
    image = Image.new("RGB", (900, 320), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    _panel(draw, (10, 10, 445, 310), loss_steps, losses, "train loss (per step)", (30, 90, 200))
    _panel(draw, (455, 10, 890, 310), eval_epochs, recalls, "held-out Recall@1 (per epoch)", (20, 150, 40))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return atomic_write_bytes(path, buffer.getvalue())

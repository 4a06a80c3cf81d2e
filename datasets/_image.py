"""Image decoding with errors that name the file."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, UnidentifiedImageError

__all__ = ["IMAGE_EXTENSIONS", "ImageLoadError", "load_rgb", "verify_image"]

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm"})


class ImageLoadError(OSError):
    """An image file is missing, unreadable or corrupt; the message names the path."""


def load_rgb(path: str | Path) -> Image.Image:
    """Decode ``path`` fully into an RGB PIL image."""
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except FileNotFoundError:
        raise ImageLoadError(f"image file not found: {path}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ImageLoadError(f"cannot decode image {path}: {error}") from None


def verify_image(path: str | Path) -> bool:
    """True if ``path`` holds a decodable image (reads the whole file)."""
    try:
        load_rgb(path)
    except ImageLoadError:
        return False
    return True

"""The one image-decoding function: errors that name the source, bomb limit, 16-bit scaling, draft mode.

Every dataset decodes through :func:`load_rgb`, so each input rule holds for
image folders, list files and packed shards alike:

1. Pixel limit. An image whose header declares more than ``max_pixels``
   pixels is refused before its pixels are decoded (a "decompression bomb":
   a few KB of PNG or JPEG that expands to gigabytes). Pillow's own
   ``DecompressionBombError`` is caught too. Both become :class:`ImageLoadError`,
   so ``skip_bad=True`` and the bad-image replacement treat bombs as bad images.
2. 16-bit and 32-bit grayscale (``I;16``, ``I``) is scaled to 8 bits
   (``value / 257`` for the 16-bit range) instead of being clipped, which
   would turn every pixel above 255 white.
3. Regular files only. A path is opened without blocking and refused
   unless it is a regular file: a FIFO would block ``open()`` forever and
   a device such as ``/dev/zero`` never ends (:func:`open_regular`).
4. Draft mode. With ``draft_size`` a JPEG much larger than the training size
   is decoded at 1/2, 1/4 or 1/8 scale by the DCT (``Image.draft``), never
   below ``draft_size`` on either side; decoding time falls roughly with the
   pixel count. Other formats ignore it.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

__all__ = ["IMAGE_EXTENSIONS", "MAX_IMAGE_PIXELS", "ImageLoadError", "load_rgb", "open_regular", "read_regular",
           "verify_image"]

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm"})

#: Images declaring more pixels than this are refused as decompression bombs
#: (64 Mpx: an 8000 x 8000 photo; 3 bytes a pixel is 192 MiB decoded).
MAX_IMAGE_PIXELS = 64_000_000

_GRAY_DEEP_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N", "F"})


class ImageLoadError(OSError):
    """An image file is missing, unreadable, corrupt or too large; the message names the source."""


ImageSource = str | os.PathLike | bytes | bytearray | memoryview


class NotRegularFileError(OSError):
    """A path names a FIFO, a device, a socket or a folder where a regular file is needed."""


def open_regular(path: str | os.PathLike) -> io.BufferedReader:
    """Open ``path`` for reading without blocking, refusing anything but a regular file (links followed).

    ``O_NONBLOCK`` makes opening a FIFO return at once instead of waiting for
    a writer; ``fstat`` on the open descriptor then decides (no race between
    a check and the open).

    Raises:
        FileNotFoundError: no such path. NotRegularFileError: a FIFO, device, socket or folder.
    """
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "a folder" if stat.S_ISDIR(mode) else "special")
            raise NotRegularFileError(f"{os.fspath(path)} is {kind}, not a regular file; refused")
        if hasattr(os, "set_blocking"):
            os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_regular(path: str | os.PathLike) -> bytes:
    """All bytes of the regular file ``path`` (see :func:`open_regular`)."""
    with open_regular(path) as handle:
        return handle.read()


def load_rgb(source: ImageSource, *, name: str | None = None, draft_size: int | None = None,
             max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode ``source`` (a path or the encoded bytes) fully into an RGB PIL image.

    Args:
        source: a file path, or the bytes of an encoded image (e.g. read from a shard).
        name: how errors name the image (default: the path; needed for bytes).
        draft_size: if given, a JPEG is decoded at the smallest DCT scale whose
            width and height both stay >= ``draft_size`` (Pillow's draft mode).
        max_pixels: refuse images whose header declares more pixels than this.

    Raises:
        ImageLoadError: missing file, undecodable data, or more than ``max_pixels`` pixels;
            the message names ``name`` (or the path) and the reason.
    """
    label = name if name is not None else (str(source) if isinstance(source, (str, os.PathLike)) else "<bytes>")
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise ValueError(f"load_rgb(max_pixels=) must be a positive int, got {max_pixels!r}")
    if draft_size is not None and (isinstance(draft_size, bool) or not isinstance(draft_size, int) or draft_size < 1):
        raise ValueError(f"load_rgb(draft_size=) must be a positive int or None, got {draft_size!r}")
    try:
        stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else open_regular(source)
        with stream, Image.open(stream) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ImageLoadError(f"cannot decode image {label}: {width}x{height} = {width * height} pixels "
                                     f"exceeds the limit max_pixels={max_pixels} (decompression bomb?)")
            if draft_size is not None and image.format == "JPEG":
                image.draft("RGB", (draft_size, draft_size))
            image.load()
            return _to_rgb(image)
    except ImageLoadError:
        raise
    except FileNotFoundError:
        raise ImageLoadError(f"image file not found: {label}") from None
    except NotRegularFileError as error:
        raise ImageLoadError(f"cannot decode image {label}: {error}") from None
    except Image.DecompressionBombError as error:
        raise ImageLoadError(f"cannot decode image {label}: {error}") from None
    except UnidentifiedImageError:  # Pillow's message holds the stream's repr (a memory address)
        raise ImageLoadError(f"cannot decode image {label}: not in an image format that Pillow identifies") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as error:
        raise ImageLoadError(f"cannot decode image {label}: {error}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with deep grayscale scaled (not clipped) to 8 bits."""
    if image.mode == "RGB":
        return image  # decoded already (load()); convert() would only copy it
    if image.mode not in _GRAY_DEEP_MODES:
        return image.convert("RGB")
    values = np.asarray(image)
    if image.mode == "F" or values.min() < 0 or values.max() > 65535:
        # Unknown range (float, signed or wider than 16 bits): stretch min..max to 0..255.
        values = values.astype(np.float64)
        low, high = float(values.min()), float(values.max())
        scaled = (values - low) * (255.0 / (high - low)) if high > low else np.zeros_like(values)
    else:
        scaled = values.astype(np.float64) / 257.0  # 65535 -> 255 exactly
    gray = Image.fromarray(np.rint(scaled).astype(np.uint8))
    return gray.convert("RGB")


def verify_image(path: str | Path, *, max_pixels: int = MAX_IMAGE_PIXELS) -> bool:
    """True if ``path`` holds a decodable image within the pixel limit (reads the whole file)."""
    try:
        load_rgb(path, max_pixels=max_pixels)
    except ImageLoadError:
        return False
    return True

"""Write an image-folder retrieval set cut from real photographs bundled with scikit-image.

Run: .venv/bin/python benchmarks/sets/make_real_images.py [OUT_DIR] [--classes 200] [--views 16] [--size 64] [--seed 0]

Why: the synthetic products are easy (the demo reaches R@1 0.97), so they no
longer tell whether a model, resolution or augmentation choice helps on real
images. This set is made of real photographs (people, animals, food,
textures, microscopy, astronomy, scanned text) and needs no download: only
the photos that ship inside the scikit-image wheel are used.

How, in steps:

1. Load every bundled photo (grayscale ones are repeated to RGB).
2. Cut each photo into square regions on a jittered grid (region side about
   a sixth of the shorter photo side) and keep regions with visible
   structure (pixel standard deviation above a threshold); every kept region
   is one class. Classes are taken round-robin over the photos, so each
   photo gives about the same number, up to ``--classes``.
3. Render ``--views`` views per class, each an affine warp of the photo
   around the region centre: scale 0.7-1.4, rotation +-30 degrees, shift
   up to 15 % of the region, then brightness/contrast/saturation factors in
   [0.7, 1.3], a colour cast of up to 8 % per channel, Gaussian blur of radius
   0-1.2 px and JPEG quality 75-95.
4. Write ``OUT_DIR/<photo>_<row>_<col>/<view>.jpg`` atomically, then a
   manifest (``manifest.json``) last, so a half-written set is recognised
   and rebuilt.

Everything is deterministic from ``--seed``: the generator of class c is
``np.random.default_rng([seed, c])``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter

from pksampler.files import atomic_write_bytes, atomic_write_text

__all__ = ["PHOTOS", "MANIFEST", "make_real_images", "set_is_complete"]

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = "manifest.json"
# skimage.data loaders whose files ship inside the scikit-image wheel (no download).
# Drawings (logo, colorwheel, horse, chessboard) are left out: photographs only.
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
          "stereo_motorcycle", "camera", "coins", "moon", "page", "text", "brick", "grass", "gravel", "clock",
          "cell", "microaneurysms")
REGIONS_PER_SIDE = 6.0  # region side = shorter photo side / 6: neighbouring classes share texture and colour
MIN_REGION_STD = 18.0  # on the 0-255 scale: leaves out flat sky, black space and blank paper


@dataclass(frozen=True)
class Region:
    """One class: a square region of a photo, by centre and side in pixels."""

    photo: str
    row: int
    col: int
    cy: float
    cx: float
    side: float


def load_photos(names: tuple[str, ...] = PHOTOS) -> dict[str, np.ndarray]:
    """The bundled photos as uint8 RGB arrays; names whose file is not bundled are left out."""
    import skimage.data

    photos = {}
    for name in names:
        try:
            image = getattr(skimage.data, name)()
            image = np.asarray(image[0] if isinstance(image, tuple) else image)  # stereo pair: left view
        except Exception:  # not bundled in this scikit-image (would need a download)
            continue
        if image.dtype == bool:
            image = image.astype(np.uint8) * 255
        elif image.dtype != np.uint8:
            image = np.clip(image * (255.0 if image.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)
        if image.ndim == 2:
            image = np.repeat(image[:, :, None], 3, axis=2)
        photos[name] = np.ascontiguousarray(image[:, :, :3])
    if not photos:
        raise RuntimeError("scikit-image ships none of the expected photos; install scikit-image >= 0.19")
    return photos


def photo_regions(name: str, image: np.ndarray, rng: np.random.Generator) -> list[Region]:
    """Regions of one photo on a jittered grid, keeping those with visible structure."""
    height, width = image.shape[:2]
    side = min(height, width) / REGIONS_PER_SIDE
    rows, cols = int(height // side), int(width // side)
    gray = image.astype(np.float32).mean(axis=2)
    regions = []
    for row in range(rows):
        for col in range(cols):
            cy = (row + 0.5) * height / rows + rng.uniform(-0.1, 0.1) * side
            cx = (col + 0.5) * width / cols + rng.uniform(-0.1, 0.1) * side
            top, left = int(max(0, cy - side / 2)), int(max(0, cx - side / 2))
            patch = gray[top:int(cy + side / 2), left:int(cx + side / 2)]
            if patch.size and patch.std() >= MIN_REGION_STD:
                regions.append(Region(name, row, col, cy, cx, side))
    return regions


def choose_regions(photos: dict[str, np.ndarray], classes: int, seed: int) -> list[Region]:
    """Up to ``classes`` regions taken round-robin over the photos (the same list for the same seed)."""
    per_photo = [photo_regions(name, photos[name], np.random.default_rng([seed, index]))
                 for index, name in enumerate(sorted(photos))]
    chosen: list[Region] = []
    depth = 0
    while len(chosen) < classes and any(depth < len(r) for r in per_photo):
        chosen.extend(r[depth] for r in per_photo if depth < len(r))
        depth += 1
    if len(chosen) < classes:
        raise ValueError(f"make_real_images(classes=) asks for {classes} classes, "
                         f"but the bundled photos give only {len(chosen)} structured regions")
    return chosen[:classes]


def render_view(photo: Image.Image, region: Region, size: int, rng: np.random.Generator) -> Image.Image:
    """One random view of ``region``: affine warp (scale, rotation, shift), photometric jitter, blur."""
    scale = math.exp(rng.uniform(math.log(0.7), math.log(1.4)))
    angle = math.radians(rng.uniform(-30.0, 30.0))
    shift = rng.uniform(-0.15, 0.15, size=2) * region.side
    # Output pixel (u, v) around the output centre maps to the photo point
    # centre + R(angle) @ (u, v) * (side / (scale * size)): PIL wants that inverse map.
    step = region.side / (scale * size)
    cos, sin = math.cos(angle) * step, math.sin(angle) * step
    cx, cy = region.cx + shift[0], region.cy + shift[1]
    half = size / 2.0
    coefficients = (cos, -sin, cx - cos * half + sin * half, sin, cos, cy - sin * half - cos * half)
    view = photo.transform((size, size), Image.AFFINE, coefficients, resample=Image.BILINEAR,
                           fillcolor=(0, 0, 0))
    for enhancer in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        view = enhancer(view).enhance(float(rng.uniform(0.7, 1.3)))
    cast = np.asarray(view, dtype=np.float32) * rng.uniform(0.92, 1.08, size=3)
    view = Image.fromarray(np.clip(cast, 0, 255).astype(np.uint8))
    radius = float(rng.uniform(0.0, 1.2))
    return view.filter(ImageFilter.GaussianBlur(radius)) if radius > 0.3 else view


def set_is_complete(out_dir: Path, classes: int, views: int, size: int, seed: int) -> bool:
    """Whether ``out_dir`` holds a finished set made with these parameters (its manifest is written last)."""
    manifest = Path(out_dir) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        written = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return written.get("params") == {"classes": classes, "views": views, "size": size, "seed": seed}


def make_real_images(out_dir: str | Path, *, classes: int = 200, views: int = 16, size: int = 64,
                     seed: int = 0) -> Path:
    """Write the set to ``out_dir`` (one folder per class) and return the folder."""
    for name, value, low in (("classes", classes, 2), ("views", views, 2), ("size", size, 16)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"make_real_images({name}=) must be an integer >= {low}, got {value!r}")
    out_dir = Path(out_dir)
    photos = load_photos()
    regions = choose_regions(photos, classes, seed)
    images = {name: Image.fromarray(array) for name, array in photos.items()}
    for code, region in enumerate(regions):
        rng = np.random.default_rng([seed, 1_000_003, code])
        folder = out_dir / f"{region.photo}_{region.row:02d}_{region.col:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for view in range(views):
            buffer = io.BytesIO()
            render_view(images[region.photo], region, size, rng).save(
                buffer, format="JPEG", quality=int(rng.integers(75, 96)))
            atomic_write_bytes(folder / f"{view:02d}.jpg", buffer.getvalue())
    manifest = {"params": {"classes": classes, "views": views, "size": size, "seed": seed},
                "photos": sorted({r.photo for r in regions}),
                "classes_per_photo": {name: sum(r.photo == name for r in regions) for name in sorted(photos)}}
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2))
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", type=Path, default=ROOT / "workspace" / "real_images" / "data")
    parser.add_argument("--classes", type=int, default=200)
    parser.add_argument("--views", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_real_images(args.out_dir, classes=args.classes, views=args.views, size=args.size, seed=args.seed)
    print(f"wrote {args.classes} classes x {args.views} views ({args.size} px) to {args.out_dir}")


if __name__ == "__main__":
    main()

"""Write a class-rich image folder: CJK characters in many typefaces, as phone-camera captures.

Run: .venv/bin/python benchmarks/sets/make_typeface_images.py [OUT_DIR] [--classes 2000] [--size 64] [--seed 0]
     [--views-per-face 1] [--no-install]

Why: the real-photo set has 200 classes and an easy task. Recognising one
character across typefaces is a retrieval task with thousands of classes,
few images per class, fine details and large within-class changes (a brush
script, a serif and a bold sans of the same character look alike only in
their structure). It is made of material none of us drew: the CJK fonts
Debian ships (``fonts-noto-cjk``, ``fonts-arphic-ukai``/``-uming``,
``fonts-wqy-zenhei``/``-microhei``).

How, in steps:

1. Find the fonts (installing the Debian packages with apt-get when they
   are missing and this process is root; otherwise stop and print the exact
   command). The typefaces are the faces of :data:`TYPEFACES`, picked out of
   the ``.ttc`` collections by family and style: Noto Sans CJK SC Regular and
   Bold, Noto Serif CJK SC Regular and Bold, AR PL UKai, AR PL UMing,
   WenQuanYi Zen Hei and WenQuanYi Micro Hei (eight distinct designs).
2. Read every face's character map (fontTools) and keep the CJK Unified
   Ideographs (U+4E00-U+9FFF, Extension A U+3400-U+4DBF) that at least
   ``--min-faces`` (default 6) faces draw: about 20,000 characters. Draw
   ``--classes`` of them at random (seeded), in code-point order.
3. Render every chosen character in every face that has it (``--views-per-face``
   captures each) as a phone photo of printed text: ink of a random dark
   colour on paper of a random light tint, the neighbouring characters of a
   line partly in view (half of the captures), a lighting gradient, a
   perspective warp with rotation (+-15 degrees), an occluding blob (a
   third of the captures), defocus blur, sensor noise, a colour cast and
   JPEG quality 40-90, at ``--size`` pixels.
4. Write ``OUT_DIR/u<code point>/<face>_<view>.jpg`` atomically, then
   ``manifest.json`` last, so a half-written set is recognised and rebuilt.

Deterministic from ``--seed`` (and the installed font files, whose
checksums the manifest records): the generator of a capture is
``np.random.default_rng([seed, code point, face, view])``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing
from pksampler.files import atomic_write_bytes, atomic_write_text  # noqa: E402

__all__ = ["FONT_PACKAGES", "INSTALL_COMMAND", "MANIFEST", "TYPEFACES", "Typeface", "choose_characters",
           "ensure_fonts", "find_typefaces", "make_typeface_images", "render_capture", "set_is_complete"]

MANIFEST = "manifest.json"
FONT_PACKAGES = ("fonts-noto-cjk", "fonts-arphic-ukai", "fonts-arphic-uming", "fonts-wqy-zenhei", "fonts-wqy-microhei")
INSTALL_COMMAND = ("apt-get update && apt-get install -y --no-install-recommends " + " ".join(FONT_PACKAGES))
FONT_DIRS = (Path("/usr/share/fonts"), Path("/usr/local/share/fonts"))
# (key, font file name, family, style): one distinct design each. The .ttc
# collections also hold regional variants (JP/KR/TC) and monospaced faces
# whose ideographs are the same outlines, so only one face per design is used.
TYPEFACE_SPECS = (
    ("noto_sans", "NotoSansCJK-Regular.ttc", "Noto Sans CJK SC", "Regular"),
    ("noto_sans_bold", "NotoSansCJK-Bold.ttc", "Noto Sans CJK SC", "Bold"),
    ("noto_serif", "NotoSerifCJK-Regular.ttc", "Noto Serif CJK SC", "Regular"),
    ("noto_serif_bold", "NotoSerifCJK-Bold.ttc", "Noto Serif CJK SC", "Bold"),
    ("ukai", "ukai.ttc", "AR PL UKai CN", "Book"),
    ("uming", "uming.ttc", "AR PL UMing CN", "Light"),
    ("zenhei", "wqy-zenhei.ttc", "WenQuanYi Zen Hei", "Regular"),
    ("microhei", "wqy-microhei.ttc", "WenQuanYi Micro Hei", "Regular"),
)
TYPEFACES = tuple(spec[0] for spec in TYPEFACE_SPECS)
BLOCKS = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF))  # CJK Unified Ideographs and Extension A


@dataclass(frozen=True)
class Typeface:
    """One face of a font file: ``index`` is its position in a .ttc collection."""

    key: str
    path: Path
    index: int
    family: str
    style: str


def _font_files() -> dict[str, Path]:
    files: dict[str, Path] = {}
    for folder in FONT_DIRS:
        if folder.is_dir():
            for path in sorted(folder.rglob("*.tt[cf]")):
                files.setdefault(path.name, path)
    return files


def _missing_files() -> list[str]:
    present = _font_files()
    return [spec[1] for spec in TYPEFACE_SPECS if spec[1] not in present]


def ensure_fonts(*, install: bool = True) -> None:
    """Install the Debian font packages when a font file is missing; raise with the exact command otherwise."""
    missing = _missing_files()
    if not missing:
        return
    can_install = install and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")
    if can_install:
        print(f"installing the CJK fonts: {INSTALL_COMMAND}", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *FONT_PACKAGES],
                       check=True, env=env)
        missing = _missing_files()
    if missing:
        raise RuntimeError(f"font files {', '.join(missing)} are not installed (looked under "
                           f"{', '.join(map(str, FONT_DIRS))}); install them as root with: {INSTALL_COMMAND}")


def find_typefaces(keys: Sequence[str] = TYPEFACES) -> list[Typeface]:
    """The installed typefaces named by ``keys``, each located by family and style in its font file."""
    unknown = sorted(set(keys) - set(TYPEFACES))
    if unknown:
        raise ValueError(f"typefaces= names unknown faces {unknown}; known: {', '.join(TYPEFACES)}")
    files = _font_files()
    faces = []
    for key, name, family, style in TYPEFACE_SPECS:
        if key not in keys:
            continue
        if name not in files:
            raise RuntimeError(f"font file {name} is not installed; install it as root with: {INSTALL_COMMAND}")
        faces.append(Typeface(key, files[name], _face_index(files[name], family, style), family, style))
    return faces


def _face_index(path: Path, family: str, style: str) -> int:
    index = 0
    while True:
        try:
            name = ImageFont.truetype(str(path), 16, index=index).getname()
        except OSError:
            raise RuntimeError(f"{path} holds no face {family!r} {style!r} (looked at {index} faces)") from None
        if name == (family, style):
            return index
        index += 1


@functools.lru_cache(maxsize=None)
def _coverage(path: Path, index: int) -> frozenset[int]:
    """The ideographs face ``index`` of ``path`` draws (its character map; read once per process)."""
    from fontTools.ttLib import TTFont  # matplotlib's dependency, so always installed with pksampler

    with TTFont(str(path), fontNumber=index, lazy=True) as font:
        cmap = font.getBestCmap()
    return frozenset(code for code in cmap if any(low <= code <= high for low, high in BLOCKS))


def choose_characters(faces: Sequence[Typeface], *, classes: int, min_faces: int, seed: int) -> dict[int, list[int]]:
    """``classes`` code points drawn by at least ``min_faces`` faces -> the indices of those faces."""
    coverage = [_coverage(face.path, face.index) for face in faces]
    counts: dict[int, list[int]] = {}
    for position, codes in enumerate(coverage):
        for code in codes:
            counts.setdefault(code, []).append(position)
    eligible = np.array(sorted(code for code, owners in counts.items() if len(owners) >= min_faces))
    if eligible.size < classes:
        raise ValueError(f"make_typeface_images(classes=) asks for {classes} characters, but only "
                         f"{eligible.size} are drawn by at least {min_faces} of the {len(faces)} typefaces")
    chosen = np.sort(np.random.default_rng([seed, 7]).choice(eligible, size=classes, replace=False))
    return {int(code): sorted(counts[int(code)]) for code in chosen}


def _line_of_text(font: ImageFont.FreeTypeFont, code: int, rng: np.random.Generator, canvas: int,
                  ink: tuple[int, ...], paper: tuple[int, ...]) -> Image.Image:
    """The character centred on paper; half the time with random neighbours of a line of text beside it."""
    image = Image.new("RGB", (canvas * 3, canvas), paper)
    draw = ImageDraw.Draw(image)
    pitch = font.size * float(rng.uniform(1.05, 1.35))
    centre = np.array([1.5 * canvas, 0.5 * canvas])
    neighbours = rng.random() < 0.5
    offsets = (-1, 0, 1) if neighbours else (0,)
    for offset in offsets:
        char = chr(code) if offset == 0 else chr(int(rng.integers(0x4E00, 0x9FA6)))
        draw.text((centre[0] + offset * pitch, centre[1]), char, font=font, fill=ink, anchor="mm")
    return image


def _perspective(image: Image.Image, rng: np.random.Generator, size: int, canvas: int) -> Image.Image:
    """A phone held at an angle: rotation, scale and independent corner shifts, sampled into ``size`` px."""
    angle = np.radians(rng.uniform(-15.0, 15.0))
    scale = float(rng.uniform(0.85, 1.2))
    shift = rng.uniform(-0.08, 0.08, size=2) * canvas
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    half = size / 2.0
    target = np.array([[0, 0], [size, 0], [size, size], [0, size]], dtype=float)
    jitter = rng.uniform(-0.08, 0.08, size=(4, 2)) * size
    centre = np.array([1.5 * canvas, 0.5 * canvas]) + shift
    source = centre + ((target + jitter - half) * (canvas / size / scale)) @ rotation.T
    # PIL wants the coefficients of the map from output to input pixels.
    rows = []
    for (x, y), (u, v) in zip(target, source):
        rows.append([x, y, 1, 0, 0, 0, -u * x, -u * y])
        rows.append([0, 0, 0, x, y, 1, -v * x, -v * y])
    coefficients = np.linalg.solve(np.array(rows), source.reshape(-1))
    fill = tuple(int(c) for c in np.asarray(image)[0, 0])
    return image.transform((size, size), Image.PERSPECTIVE, tuple(coefficients), resample=Image.BICUBIC,
                           fillcolor=fill)


def _photometric(image: Image.Image, rng: np.random.Generator) -> np.ndarray:
    """Lighting gradient, an occluding blob, defocus, noise and a colour cast, as float RGB."""
    size = image.size[0]
    if rng.random() < 1 / 3:  # a finger, a pen or a shadow over part of the character
        draw = ImageDraw.Draw(image)
        cx, cy = rng.uniform(0, size, size=2)
        rx, ry = rng.uniform(0.08, 0.25, size=2) * size
        shade = tuple(int(c) for c in rng.integers(0, 256, size=3))
        draw.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), fill=shade)
    radius = float(rng.uniform(0.0, 1.4))
    if radius > 0.25:
        image = image.filter(ImageFilter.GaussianBlur(radius * size / 64))
    pixels = np.asarray(image, dtype=np.float32)
    ramp = np.linspace(-1.0, 1.0, size, dtype=np.float32)
    direction = rng.normal(size=2)
    direction /= np.linalg.norm(direction) + 1e-9
    light = 1.0 + float(rng.uniform(0.0, 0.35)) * (direction[0] * ramp[None, :] + direction[1] * ramp[:, None])
    pixels = pixels * light[:, :, None] * rng.uniform(0.6, 1.15) * rng.uniform(0.9, 1.1, size=3)
    pixels += rng.normal(0.0, rng.uniform(2.0, 10.0), size=pixels.shape)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def render_capture(font: ImageFont.FreeTypeFont, code: int, size: int, rng: np.random.Generator) -> bytes:
    """One phone-camera capture of character ``code`` in ``font`` as JPEG bytes (``size`` x ``size``)."""
    canvas = font.size * 3 // 2
    ink = tuple(int(c) for c in rng.integers(0, 90, size=3))
    paper = tuple(int(c) for c in rng.integers(175, 256, size=3))
    line = _line_of_text(font, code, rng, canvas, ink, paper)
    view = Image.fromarray(_photometric(_perspective(line, rng, size, canvas), rng))
    buffer = io.BytesIO()
    view.save(buffer, format="JPEG", quality=int(rng.integers(40, 91)))
    return buffer.getvalue()


def _params(classes: int, size: int, seed: int, views_per_face: int, min_faces: int,
            faces: Sequence[Typeface]) -> dict:
    return {"classes": classes, "size": size, "seed": seed, "views_per_face": views_per_face,
            "min_faces": min_faces, "typefaces": [face.key for face in faces]}


def set_is_complete(out_dir: str | Path, params: dict) -> bool:
    """Whether ``out_dir`` holds a finished set made with these parameters (its manifest is written last)."""
    manifest = Path(out_dir) / MANIFEST
    try:
        return json.loads(manifest.read_text(encoding="utf-8")).get("params") == params
    except (OSError, ValueError):
        return False


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"make_typeface_images({name}=) must be an integer >= {low}, got {value!r}")


def make_typeface_images(out_dir: str | Path, *, classes: int = 2000, size: int = 64, seed: int = 0,
                         views_per_face: int = 1, min_faces: int = 6, typefaces: Sequence[str] = TYPEFACES,
                         install: bool = True) -> Path:
    """Write the set to ``out_dir`` (one folder per character) and return the folder."""
    for name, value, low in (("classes", classes, 2), ("size", size, 16), ("views_per_face", views_per_face, 1),
                             ("min_faces", min_faces, 1), ("seed", seed, 0)):
        _check_int(name, value, low)
    if min_faces > len(typefaces):
        raise ValueError(f"make_typeface_images(min_faces={min_faces}) exceeds the {len(typefaces)} typefaces given")
    ensure_fonts(install=install)
    faces = find_typefaces(typefaces)
    params = _params(classes, size, seed, views_per_face, min_faces, faces)
    out_dir = Path(out_dir)
    if set_is_complete(out_dir, params):
        return out_dir
    (out_dir / MANIFEST).unlink(missing_ok=True)  # a set being rewritten is not a finished one
    chosen = choose_characters(faces, classes=classes, min_faces=min_faces, seed=seed)
    fonts = [ImageFont.truetype(str(face.path), size * 2, index=face.index) for face in faces]
    for code, owners in chosen.items():
        folder = out_dir / f"u{code:05x}"
        for position in owners:
            for view in range(views_per_face):
                rng = np.random.default_rng([seed, code, position, view])
                data = render_capture(fonts[position], code, size, rng)
                atomic_write_bytes(folder / f"{faces[position].key}_{view}.jpg", data)
    _remove_stale(out_dir, {f"u{code:05x}/{faces[p].key}_{view}.jpg" for code, owners in chosen.items()
                            for p in owners for view in range(views_per_face)})
    manifest = {"params": params, "characters": len(chosen),
                "images": sum(len(owners) for owners in chosen.values()) * views_per_face,
                "typefaces": [{"key": f.key, "file": str(f.path), "index": f.index, "family": f.family,
                               "style": f.style, "sha256": _sha256(f.path)} for f in faces]}
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2))
    return out_dir


def _remove_stale(out_dir: Path, expected: set[str]) -> None:
    """Delete images an earlier set with other parameters left in ``out_dir`` (only this script's names)."""
    for path in out_dir.glob("u*/*.jpg"):
        if path.relative_to(out_dir).as_posix() not in expected:
            path.unlink()
    for folder in out_dir.glob("u*"):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", type=Path, default=ROOT / "workspace" / "typefaces" / "data")
    parser.add_argument("--classes", type=int, default=2000, help="characters (classes), default 2000")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--views-per-face", type=int, default=1, help="captures of a character per typeface")
    parser.add_argument("--min-faces", type=int, default=6, help="keep characters drawn by this many typefaces")
    parser.add_argument("--no-install", action="store_true", help="never run apt-get; print the command instead")
    args = parser.parse_args()
    try:
        out = make_typeface_images(args.out_dir, classes=args.classes, size=args.size, seed=args.seed,
                                   views_per_face=args.views_per_face, min_faces=args.min_faces,
                                   install=not args.no_install)
    except RuntimeError as error:
        raise SystemExit(f"make_typeface_images: {error}") from None
    manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    print(f"{manifest['characters']} characters, {manifest['images']} images ({args.size} px) in {shlex.quote(str(out))}")


if __name__ == "__main__":
    main()

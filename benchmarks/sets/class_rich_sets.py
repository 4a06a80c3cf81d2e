"""The two class-rich sets the quality benchmarks train on, built once under ``workspace/`` at 64 px.

``typefaces``: ``classes`` CJK characters, one capture per typeface
(:mod:`make_typeface_images`); ``photos``: ``classes`` regions of real
photographs × ``views`` captures (:mod:`make_real_images`).
"""

from __future__ import annotations

from pathlib import Path

from make_real_images import make_real_images
from make_typeface_images import make_typeface_images

#: each set's number of classes when a benchmark names none
DEFAULT_CLASSES = {"typefaces": 1000, "photos": 500}


def class_rich_set(workspace: Path, data: str, *, classes: int, views: int = 32, seed: int = 0) -> Path:
    """The folder of set ``data`` (made unless it is complete already)."""
    if data == "typefaces":
        return make_typeface_images(workspace / "typefaces" / f"c{classes}", classes=classes, size=64, seed=seed)
    return make_real_images(workspace / "real_images" / f"c{classes}v{views}", classes=classes, views=views, size=64,
                            seed=seed)

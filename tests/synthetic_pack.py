"""A packed shard set of synthetic product images, written as real PNG files and packed by the real packer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pksampler.datasets import SyntheticProducts
from pksampler.datasets.pack import pack
from pksampler.datasets.upload import upload


def synthetic_pack(folder: Path, out: Path, *, num_classes: int, images_per_class: int, image_size: int,
                   shard_size: str) -> Path:
    """Render ``num_classes`` x ``images_per_class`` PNGs into ``folder/<class>/``, pack them into ``out``."""
    synthetic = SyntheticProducts(num_classes=num_classes, images_per_class=images_per_class, image_size=image_size)
    for index in range(len(synthetic)):
        cls, view = divmod(index, images_per_class)
        path = folder / synthetic.classes[cls] / f"{view:05d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        synthetic.render(index).save(path, format="PNG")
    pack(folder, out, shard_size=shard_size)
    return out


def uploaded(local: Path, seaweed: Any, url: str) -> str:
    """Upload the packed set ``local`` to ``url`` on the test's SeaweedFS (its credentials into the environment)."""
    os.environ.update(seaweed.environment())
    upload(local, url)
    return url

"""Labelled image datasets, transforms and the synthetic product set.

Every dataset exposes ``labels`` (int64, built without decoding an image), so
``DistributedBalancedSampler(dataset, ...)`` works directly.
"""

from __future__ import annotations

from ._image import MAX_IMAGE_PIXELS, ImageLoadError, load_rgb
from .base import LabelledDataset, LabelledSubset
from .batch_augment import BatchAugment, CenterView, keyed_uniform
from .folder import ImageFolderDataset
from .listfile import ListFileDataset
from .sharded import ShardDamagedError, ShardedDataset
from .split import class_disjoint_split, class_disjoint_split_by_name, image_holdout, name_keys
from .synthetic import SyntheticProducts, render_product
from .transforms import ToUint8, eval_preset, sample_rng, train_preset
from .union import UnionDataset

__all__ = [
    "BatchAugment",
    "CenterView",
    "ImageFolderDataset",
    "ImageLoadError",
    "LabelledDataset",
    "LabelledSubset",
    "ListFileDataset",
    "MAX_IMAGE_PIXELS",
    "ShardDamagedError",
    "ShardedDataset",
    "SyntheticProducts",
    "ToUint8",
    "UnionDataset",
    "class_disjoint_split",
    "class_disjoint_split_by_name",
    "image_holdout",
    "eval_preset",
    "keyed_uniform",
    "load_rgb",
    "name_keys",
    "render_product",
    "sample_rng",
    "train_preset",
]

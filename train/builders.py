"""Builders: the one place the run configuration is read to make the training parts.

Each builder takes the config section it needs (plus the world size where
the global batch is split) and returns a plain object; the loop and its
hooks receive those objects, never the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from pksampler.datasets import (
    BatchAugment,
    CenterView,
    ImageFolderDataset,
    LabelledSubset,
    ListFileDataset,
    ShardedDataset,
    SyntheticProducts,
    ToUint8,
    class_disjoint_split,
    class_disjoint_split_by_name,
    image_holdout,
)
from pksampler.datasets.base import LabelledDataset
from pksampler.locations import is_remote
from pksampler.samplers import (
    DistributedBalancedBatchSampler,
    DistributedBalancedSampler,
    DistributedTripletBatchSampler,
    DistributedTripletSampler,
    rank_share,
)

from pksampler.train.solver.build import build_optimizer, build_schedule, warmup_length
from pksampler.train.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the schema reads this module's registries, so no runtime import back
    from pksampler.train.config.schema import DataConfig, RunConfig, SamplerConfig

__all__ = [
    "DATA_ARGS",
    "DATA_SOURCES",
    "SAMPLERS",
    "SAMPLER_ARGS",
    "DataParts",
    "build_data",
    "build_optimizer",
    "build_sampler",
    "shard_ids_of",
    "build_schedule",
    "eval_size",
    "per_rank_share",
    "warmup_length",
]


@dataclass
class DataParts:
    """The full dataset, its class-disjoint train and test subsets, and their device-side transforms.

    Both subsets ship uint8 squares from the workers: ``train`` at the
    training size, ``test`` at 8/7 of it. ``augment`` (keyed random crop, flip,
    jitter, normalisation) turns a train batch into model input on the device;
    ``view`` (centre crop, normalisation) does it for test-sized batches.
    """

    dataset: LabelledDataset
    train: LabelledSubset
    test: LabelledSubset
    augment: BatchAugment | None = None
    view: CenterView | None = None
    #: dataset indices of the training classes' images kept out of training (``data.heldout_images``): the
    #: image-level evaluation's queries
    heldout: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def _synthetic(data: DataConfig, seed: int) -> LabelledDataset:
    # Rendered in memory: the data location (DATASETS_PATH) is read-only by contract.
    return SyntheticProducts(**data.args, augment_seed=seed)


def _decoding(data: DataConfig, args: dict | None = None) -> dict:
    """``args`` (default ``data.args``) plus a decode size: large JPEGs decode in draft mode to the training size."""
    return {"decode_size": data.image_size, **(data.args if args is None else args)}


def eval_size(image_size: int) -> int:
    """The side of evaluation squares: the centre ``image_size`` crop keeps 7/8 of it, as ``eval_preset``."""
    return int(round(image_size * 8 / 7))


def _folder(data: DataConfig, seed: int) -> LabelledDataset:
    return ImageFolderDataset(_root(data), seed=seed, **_decoding(data))


def _list(data: DataConfig, seed: int) -> LabelledDataset:
    args = dict(data.args)
    if "list_file" not in args:
        raise ConfigError("data.args.list_file: required for data.name='list'")
    list_file = Path(args.pop("list_file"))
    root = Path(data.root) if data.root else None
    if root is not None and not list_file.is_absolute():
        list_file = root / list_file
    return ListFileDataset(list_file, root=root, seed=seed, **_decoding(data, args))


def _shards(data: DataConfig, seed: int) -> LabelledDataset:
    root = data.root if is_remote(data.root) else _root(data)  # an object store, or a folder
    return ShardedDataset(root, seed=seed, **_decoding(data))


def _root(data: DataConfig) -> Path:
    if not data.root:
        raise ConfigError(f"data.root: required for data.name={data.name!r} (or set DATASETS_PATH/DATASETS)")
    if is_remote(data.root):
        raise ConfigError(f"data.root: {data.root!r} is an object store, which only data.name: shards reads "
                          "(pack the images, then upload: docs/object-store.md)")
    return Path(data.root)


#: ``data.name`` -> builder(data config, seed)
DATA_SOURCES: dict[str, Callable[[DataConfig, int], LabelledDataset]] = {
    "synthetic": _synthetic,
    "folder": _folder,
    "list": _list,
    "shards": _shards,
}


#: ``data.name`` -> (the class whose keyword arguments ``data.args`` are, the arguments its builder sets itself):
#: what the configuration reference lists as ``data.args.<key>``
DATA_ARGS = {
    "synthetic": (SyntheticProducts, ("transform", "augment_seed")),
    "folder": (ImageFolderDataset, ("root", "transform", "seed")),
    "list": (ListFileDataset, ("root", "transform", "seed")),
    "shards": (ShardedDataset, ("root", "transform", "seed")),
}


def build_data(config: RunConfig) -> DataParts:
    """Open the dataset and split its classes into train and test parts."""
    data = config.data
    try:
        dataset = DATA_SOURCES[data.name](data, config.seed)
    except TypeError as error:
        raise ConfigError(f"data.args: {error}") from None
    except (OSError, ValueError) as error:  # a missing or empty folder, a damaged shard set, ...
        key = "data.args.list_file" if data.name == "list" else "data.root"
        raise ConfigError(f"{key}: {error}") from None
    train_idx, test_idx, heldout = split_data(dataset, data)
    return DataParts(
        dataset,
        LabelledSubset(dataset, train_idx, transform=ToUint8(data.image_size)),
        LabelledSubset(dataset, test_idx, transform=ToUint8(eval_size(data.image_size))),
        augment=BatchAugment(data.image_size, seed=config.seed, **data.augment),
        view=CenterView(data.image_size),
        heldout=heldout,
    )


def split_data(dataset: LabelledDataset, data: DataConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dataset indices of the training images, the held-out classes' images and the training classes' held-out
    images (``data.split_by``, ``data.test_fraction``, ``data.heldout_images``, keyed by ``data.split_seed``)."""
    if data.split_by == "name":
        train_idx, test_idx = class_disjoint_split_by_name(dataset.labels, dataset.classes, data.test_fraction,
                                                           data.split_seed)
    else:
        train_idx, test_idx = class_disjoint_split(dataset.labels, data.test_fraction, data.split_seed)
    kept, held = image_holdout(np.asarray(dataset.labels)[train_idx], dataset.classes, data.heldout_images,
                               data.split_seed)
    return train_idx[kept], test_idx, train_idx[held]


def per_rank_share(total: int, world_size: int, key: str, rank: int = 0) -> int:
    """Rank ``rank``'s share of ``total``: ``ceil`` or ``floor`` of ``total / world_size`` (an even split).

    Raises a ConfigError naming the key and both numbers when there are more
    ranks than items: every rank needs at least one per step.
    """
    if world_size > total:
        raise ConfigError(
            f"{key}={total} cannot be split over {world_size} ranks: every rank needs at least one per step, "
            f"so the world size must be at most {total}"
        )
    return rank_share(total, world_size, rank)[1]


def shard_ids_of(dataset: LabelledDataset) -> np.ndarray | None:
    """Per-sample shard ids of a sharded dataset (or a subset of one), for ``sampler.args.locality: shard``; None
    for other datasets (:attr:`~pksampler.datasets.base.LabelledDataset.shard_ids`)."""
    return dataset.shard_ids


def _balanced(sampler: SamplerConfig, labels: np.ndarray, world_size: int, rank: int, seed: int,
              shard_ids: np.ndarray | None = None):
    per_rank_share(sampler.classes_per_step, world_size, "sampler.classes_per_step", rank)
    args = dict(sampler.args)
    if args.get("locality") == "shard":
        if "shard_ids" in args:
            raise ConfigError("sampler.args.shard_ids is not a config key: the shard ids come from the dataset")
        if shard_ids is None:
            raise ConfigError(f"sampler.args.locality='shard' needs a packed dataset (data.name: shards), got a "
                              f"dataset without shards: drop the locality key or pack the data with "
                              "python -m pksampler.datasets.pack")
        args["shard_ids"] = shard_ids
    try:
        return DistributedBalancedBatchSampler(labels, samples_per_class=sampler.samples_per_class,
                                               classes_per_step=sampler.classes_per_step, num_replicas=world_size,
                                               rank=rank, seed=seed, **args)
    except ValueError:
        # Counted only when the sampler refuses, so a good start-up never sorts 10^8 labels for it.
        classes = np.unique(labels).size
        if classes < sampler.classes_per_step:
            raise ConfigError(
                f"sampler.classes_per_step={sampler.classes_per_step} needs that many distinct classes in every "
                f"step, but the training split has {classes}: lower sampler.classes_per_step, or use more data "
                "(or a lower data.test_fraction)") from None
        raise


def _triplet(sampler: SamplerConfig, labels: np.ndarray, world_size: int, rank: int, seed: int,
             shard_ids: np.ndarray | None = None):
    per_rank_share(sampler.triplets_per_step, world_size, "sampler.triplets_per_step", rank)
    return DistributedTripletBatchSampler(labels, triplets_per_step=sampler.triplets_per_step,
                                          num_replicas=world_size, rank=rank, seed=seed, **sampler.args)


#: ``sampler.name`` -> builder(sampler config, labels, world size, rank, seed, shard ids)
SAMPLERS = {"balanced": _balanced, "triplet": _triplet}
_SET_BY_BUILDER = ("labels", "num_replicas", "rank", "seed")
#: ``sampler.name`` -> (the sampler whose keyword arguments ``sampler.args`` are, those its builder sets): what the
#: configuration reference lists as ``sampler.args.<key>`` (the batch forms take the flat forms' arguments)
SAMPLER_ARGS = {
    "balanced": (DistributedBalancedSampler, _SET_BY_BUILDER + ("classes_per_batch", "classes_per_step",
                                                                "samples_per_class", "shard_ids")),
    "triplet": (DistributedTripletSampler, _SET_BY_BUILDER + ("triplets_per_batch", "triplets_per_step")),
}


def build_sampler(sampler: SamplerConfig, labels: np.ndarray, world_size: int, rank: int, seed: int, *,
                  shard_ids: np.ndarray | None = None):
    """The batch sampler for this rank: its share of the G classes (or triplets) of a global step.

    The share is ``G / W``, or ``ceil``/``floor`` of it when W does not divide G. ``shard_ids``
    (:func:`shard_ids_of` the training data) feeds ``sampler.args.locality: shard``.
    """
    try:
        return SAMPLERS[sampler.name](sampler, labels, world_size, rank, seed, shard_ids)
    except TypeError as error:
        raise ConfigError(f"sampler.args: {error}") from None
    except ValueError as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"sampler: {error}") from None


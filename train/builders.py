"""Builders: the one place the run configuration is read to make the training parts.

Each builder takes the config section it needs (plus the world size where
the global batch is split) and returns a plain object; the loop and its
hooks receive those objects, never the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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
    UnionDataset,
    class_disjoint_split,
    class_disjoint_split_by_name,
    image_holdout,
)
from pksampler.datasets.base import LabelledDataset
from pksampler.datasets.sharded import MANIFEST as SHARD_MANIFEST
from pksampler.locations import is_remote
from pksampler.samplers import (
    DistributedBalancedBatchSampler,
    DistributedBalancedSampler,
    DistributedTripletBatchSampler,
    DistributedTripletSampler,
    rank_share,
)

from pksampler.train.solver.build import build_optimizer, build_schedule, warmup_length
from pksampler.train.config.rules import dataset_entries
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
    "detect_layout",
    "shard_ids_of",
    "split_gaps",
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


def detect_layout(location: str) -> str:
    """The layout of one dataset: ``shards`` for an object store or a packed folder (its ``manifest.json``),
    ``list`` for a file, ``folder`` for any other folder."""
    if is_remote(location):
        return "shards"
    path = Path(location)
    if path.is_file():
        return "list"
    return "shards" if (path / SHARD_MANIFEST).is_file() else "folder"


def _entry_config(data: DataConfig, name: str, layout: str | None) -> DataConfig:
    """The one-dataset config of entry ``name`` of ``data.datasets``: its location, layout and arguments."""
    location = f"{str(data.root).rstrip('/')}/{name}"
    if not is_remote(location) and not Path(location).exists():
        present = sorted(p.name for p in Path(data.root).iterdir())[:12] if Path(data.root).is_dir() else []
        raise ConfigError(f"data.datasets: {name!r} is not a dataset: {location} does not exist (datasets under "
                          f"data.root={data.root}: {', '.join(present) or 'none'})")
    if is_remote(location) and layout not in (None, "shards"):
        raise ConfigError(f"data.datasets: '{name}:{layout}' is in the object store {location}, which holds only "
                          f"packed shards: write '{name}' or '{name}:shards'")
    layout = layout or detect_layout(location)
    args = {k: v for k, v in data.args.items() if k != "list_file"} if layout == data.name else {}
    if layout == "list":
        list_file = Path(location)
        return replace(data, name=layout, root=str(list_file.parent), args={**args, "list_file": list_file.name})
    return replace(data, name=layout, root=location, args=args)


def _union(data: DataConfig, seed: int) -> UnionDataset:
    """``data.datasets`` under ``data.root``, each opened in its layout, as one dataset of ``<name>/<class>``."""
    if not data.root:
        raise ConfigError("data.root: required with data.datasets (set DATASETS_PATH, or --set data.root=...)")
    parts, places = [], {}
    for name, layout in dataset_entries("data.datasets", data.datasets):
        entry = _entry_config(data, name, layout)
        _check_once(places, name, f"{str(data.root).rstrip('/')}/{name}")
        parts.append((name, _open(entry, seed, entry=name)))
    try:
        return UnionDataset(parts, seed=seed)
    except ValueError as error:
        raise ConfigError(f"data.datasets: {error}") from None


def _check_once(places: dict[str, str], name: str, location: str) -> None:
    """Refuse a dataset listed again under another name (a symbolic link to it): its classes would count twice,
    once per name. ``places`` maps the real paths seen so far to their entries."""
    if is_remote(location):
        return
    place = str(Path(location).resolve())
    if place in places:
        raise ConfigError(f"data.datasets: {name!r} is the dataset {places[place]!r} again (both are {place}); "
                          "list every dataset once (its classes would count twice)")
    places[place] = name


def _open(data: DataConfig, seed: int, *, entry: str | None = None) -> LabelledDataset:
    """One dataset of ``data.name``; its errors as one ConfigError naming the key, or the ``data.datasets`` entry."""
    named = f"data.datasets: {entry!r} ({data.name})" if entry else None
    try:
        return DATA_SOURCES[data.name](data, seed)
    except TypeError as error:
        raise ConfigError(f"data.args{f' ({named})' if named else ''}: {error}") from None
    except (OSError, ValueError) as error:  # a missing or empty folder, a damaged shard set, ...
        if isinstance(error, ConfigError):
            raise
        key = named or ("data.args.list_file" if data.name == "list" else "data.root")
        raise ConfigError(f"{key}: {error}") from None


def _check_combined(config: RunConfig, dataset: UnionDataset) -> None:
    """What the trainer cannot take from a union: a shard-local plan over datasets not packed in shards."""
    if config.sampler.args.get("locality") == "shard" and dataset.unsharded():
        raise ConfigError(f"sampler.args.locality='shard' needs every dataset packed in shards, but data.datasets "
                          f"{dataset.unsharded()} are not: pack them (python -m pksampler.datasets.pack) or drop "
                          "the locality key")


def split_gaps(data: DataParts, config: DataConfig) -> list[str]:
    """One warning per dataset of a union that the class-disjoint split left out of training (every class held
    out: none of its images is trained on) or out of evaluation (no class held out); one for a
    ``data.heldout_images`` that holds out nothing (every training class a single image).

    The split is drawn over the union's classes, so a small dataset can land wholly on one side; the run is still
    valid, but the user asked for that dataset and should hear that it is only evaluated, or never evaluated."""
    warnings = []
    if config.heldout_images and not data.heldout.size:
        warnings.append(f"data.heldout_images={config.heldout_images}: every training class has a single image and "
                        "keeps it, so no image is held out and no image-level evaluation runs")
    union = data.dataset
    if not isinstance(union, UnionDataset):
        return warnings
    split = f"data.test_fraction={config.test_fraction}, data.split_seed={config.split_seed}"
    for part, name in enumerate(union.names):
        low, high = union.class_offsets[part], union.class_offsets[part + 1]
        trained, held = (np.unique(s.labels[(s.labels >= low) & (s.labels < high)]).size for s in (data.train, data.test))
        if not trained:
            warnings.append(f"data.datasets {name!r}: the held-out split ({split}) took all {held} of its classes, "
                            "so none of its images is trained on (it is only evaluated); change data.split_seed "
                            "or give it more classes")
        elif not held:
            warnings.append(f"data.datasets {name!r}: the held-out split ({split}) took none of its {trained} "
                            "classes, so no evaluation covers it")
    return warnings


def heldout_note(data: DataParts, config: DataConfig) -> str:
    """What a sampler's refusal should add when ``data.heldout_images`` took images out of training: the sampler
    counts only the rest, and a class of n images trains on n - q (at least one); empty without held-out images."""
    if not data.heldout.size:
        return ""
    return (f" (data.heldout_images={config.heldout_images} keeps {data.heldout.size} images of the training classes "
            "out of training, and the sampler counts only the rest: lower it, or lower sampler.samples_per_class)")


def build_data(config: RunConfig) -> DataParts:
    """Open the dataset (or the union of ``data.datasets``) and split its classes into train and test parts."""
    data = config.data
    if data.datasets:
        union = _union(data, config.seed)
        _check_combined(config, union)
        dataset: LabelledDataset = union
    else:
        dataset = _open(data, config.seed)
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
    names = dataset.item_names() if data.heldout_images else None  # held images keyed by name, not position
    kept, held = image_holdout(np.asarray(dataset.labels)[train_idx], dataset.classes, data.heldout_images,
                               data.split_seed, items=None if names is None else [names[i] for i in train_idx.tolist()])
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


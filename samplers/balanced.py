"""DistributedBalancedSampler: per-rank P x K batches from one global plan."""

from __future__ import annotations

from typing import Any

import numpy as np
from torch.utils.data import Sampler

from ._base import BatchForm, FlatForm, StepPlanSampler
from ._labels import ClassIndex, group_labels
from ._validate import check_choice, check_int, check_real
from ._world import rank_share, rank_shares, resolve_world, step_total
from .pk_plan import SMALL_CLASS_POLICIES, EpochLayout, count_steps, epoch_layout, rank_batches
from .shard_plan import DEFAULT_WINDOW, class_shards, shard_layout

__all__ = ["DistributedBalancedBatchSampler", "DistributedBalancedSampler"]

#: where a rank's chunks come from: "pk" random shards (default plan), "shard" shard-local lanes
LOCALITIES = ("pk", "shard")

#: samples_per_class may be at most this multiple of the largest class (filled by repetition)
REPEAT_LIMIT = 16


class _BalancedPlan(StepPlanSampler):
    """Configuration and epoch cache shared by the flat and the batch form."""

    _owner = "DistributedBalancedSampler"

    def __init__(
        self,
        labels: Any,
        classes_per_batch: int | None = None,
        samples_per_class: int | None = None,
        *,
        classes_per_step: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        small_classes: str = "repeat",
        class_weighting: float = 1.0,
        locality: str = "pk",
        shard_ids: Any = None,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        owner = self._owner
        if samples_per_class is None:
            raise TypeError(f"{owner}() missing the argument samples_per_class (K, samples of each class in a batch)")
        self.samples_per_class = check_int("samples_per_class", samples_per_class, minimum=1, owner=owner)
        self.small_classes = check_choice("small_classes", small_classes, SMALL_CLASS_POLICIES, owner=owner)
        self.class_weighting = check_real("class_weighting", class_weighting, low=0.0, high=4.0, owner=owner)
        detected = num_replicas is None or rank is None
        num_replicas, rank = resolve_world(num_replicas, rank, owner=owner)
        #: G, classes in one global step (over all ranks)
        self.classes_per_step = step_total(classes_per_batch, classes_per_step, num_replicas, owner=owner,
                                           names=("classes_per_batch", "classes_per_step"))
        #: this rank's slots of every step: [first_slot, first_slot + classes_per_batch)
        self.first_slot, self.classes_per_batch = rank_share(self.classes_per_step, num_replicas, rank)
        super().__init__(num_replicas=num_replicas, rank=rank, seed=seed, detected=detected)
        self.index: ClassIndex = labels if isinstance(labels, ClassIndex) else group_labels(labels, owner=owner)
        limit = REPEAT_LIMIT * int(self.index.sizes.max())
        if self.samples_per_class > limit:
            raise ValueError(
                f"{owner}(samples_per_class=) must be at most {REPEAT_LIMIT} x the largest class size "
                f"= {limit}, got {self.samples_per_class}: beyond that every chunk is mostly repeated samples "
                f"and an epoch would hold more than {REPEAT_LIMIT} passes over the data"
            )
        self.locality = check_choice("locality", locality, LOCALITIES, owner=owner)
        self.window = check_int("window", window, minimum=1, owner=owner)
        self._class_shard = self._shards_of_classes(shard_ids, owner)
        self._layout_cache: tuple[tuple[int, int], EpochLayout] | None = None
        #: epoch-independent chunk counts, kept by the plan functions between epochs
        self._counts_cache: dict = {}
        _ = self.num_batches  # validates "enough classes" now rather than at the first epoch

    def _shards_of_classes(self, shard_ids: Any, owner: str) -> np.ndarray | None:
        """The shard of every class for ``locality="shard"`` (one integer per class); None for the default plan."""
        if self.locality != "shard":
            if shard_ids is not None:
                raise ValueError(f"{owner}(shard_ids=) is used only with locality='shard', got locality={self.locality!r}")
            return None
        if shard_ids is None:
            raise ValueError(f"{owner}(locality='shard') needs shard_ids= (one shard id per sample, "
                             "e.g. ShardedDataset.shard_ids)")
        return class_shards(self.index, shard_ids, owner=owner)

    @property
    def batch_size(self) -> int:
        """P * K indices in this rank's batch (P = this rank's share of G)."""
        return self.classes_per_batch * self.samples_per_class

    @property
    def rank_batch_sizes(self) -> tuple[int, ...]:
        """Every rank's P * K, in rank order: ceil(G/W) * K for the first G % W ranks, floor(G/W) * K after."""
        return tuple(p * self.samples_per_class for p in rank_shares(self.classes_per_step, self.num_replicas))

    def plan_identity(self) -> dict[str, Any]:
        """Labels digest, G, K and the policies: what makes two samplers' global plans equal (see the base class)."""
        return {
            "labels_fingerprint": self.index.fingerprint,
            "classes_per_step": self.classes_per_step,
            "samples_per_class": self.samples_per_class,
            "small_classes": self.small_classes,
            "class_weighting": self.class_weighting,
            **({"locality": "shard", "window": self.window} if self.locality == "shard" else {}),
        }

    def _check_identity(self, state: dict[str, Any], owner: str) -> None:
        saved = state["classes_per_step"]
        if isinstance(saved, int) and saved != self.classes_per_step:
            raise ValueError(
                f"{owner}: the saved run used {saved} classes per global step but this sampler has "
                f"{self.classes_per_step}; construct it with classes_per_step={saved} (any num_replicas up to {saved})"
            )
        super()._check_identity(state, owner)

    def _plan_kwargs(self, epoch: int) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "epoch": epoch,
            "small_classes": self.small_classes,
            "class_weighting": self.class_weighting,
            "cache": self._counts_cache,
        }

    def _count_steps(self, epoch: int) -> int:
        return count_steps(self.index, self.classes_per_step, self.samples_per_class, **self._plan_kwargs(epoch))

    def layout(self, epoch: int | None = None) -> EpochLayout:
        """The global layout of an epoch (cached for the last epoch asked)."""
        epoch = self.epoch if epoch is None else epoch
        key = (epoch, self.seed)
        if self._layout_cache is None or self._layout_cache[0] != key:
            if self._class_shard is None:
                layout = epoch_layout(
                    self.index, self.classes_per_step, self.samples_per_class, **self._plan_kwargs(epoch)
                )
            else:
                layout = shard_layout(self.index, self.classes_per_step, self.samples_per_class, self._class_shard,
                                      window=self.window, **self._plan_kwargs(epoch))
            self._layout_cache = (key, layout)
        return self._layout_cache[1]

    def _rank_steps(self, epoch: int, start: int, stop: int) -> np.ndarray:
        batches = rank_batches(
            self.layout(epoch),
            self.index,
            self.classes_per_batch,
            self.samples_per_class,
            self.rank,
            start_step=start,
            stop_step=stop,
            first_slot=self.first_slot,
        )
        return batches.reshape(batches.shape[0], self.batch_size)


class DistributedBalancedSampler(FlatForm, _BalancedPlan, Sampler[int]):
    """Class-balanced sampler for distributed metric learning: P classes x K samples per rank batch.

    Every global step holds G distinct classes (``classes_per_step=G``, or
    ``num_replicas * classes_per_batch``); rank r takes a contiguous run of
    P_r of them, K samples each, so every rank batch is P_r x K and no class
    is split across ranks within a step. P_r = G / W when W divides G, else
    ``ceil(G/W)`` for the first ``G % W`` ranks and ``floor(G/W)`` for the
    others; every rank takes the same number of steps. The global plan does
    not depend on the world size: any W from 1 to G produces the same global
    batches. See :mod:`pksampler.samplers.pk_plan` for the algorithm.

    This form yields a flat index stream; use it with
    ``DataLoader(dataset, sampler=s, batch_size=s.batch_size)`` (``drop_last``
    is not needed: the stream is a whole number of batches).

    Args:
        labels: one class label per sample (ints, strings, any hashable), or
            a dataset exposing ``labels`` or ``targets``. No sample is loaded.
        classes_per_batch: P, classes in each rank batch (every rank the
            same; G = W * P). Give this or ``classes_per_step``.
        classes_per_step: G, classes in each global step, split over the
            ranks as evenly as possible; at least ``num_replicas``. This is
            the form that resumes on any world size unchanged.
        samples_per_class: K, samples of each class in a batch; at most 16 x
            the largest class size (smaller classes are filled by repetition;
            beyond 16x an epoch would be more than 16 passes over the data).
        num_replicas: world size W; detected (Horovod, torch.distributed,
            launcher environment) when None.
        rank: this rank in ``[0, num_replicas)``; detected when None.
        seed: base seed; the epoch's randomness comes from a private generator
            keyed by ``(seed, epoch)``. Must be the same on every rank.
        small_classes: ``"repeat"`` fills classes smaller than K by repetition,
            ``"drop"`` leaves them out.
        class_weighting: exponent a; a class appears in proportion to
            ``n_c ** a``: 1 = one pass over the data, 0 = every class equally
            often, 0.5 = square-root (long-tail data).
        locality: ``"pk"`` (default plan) or ``"shard"``: the shard-local
            plan of :mod:`pksampler.samplers.shard_plan`, same chunk counts and
            guarantees, but each of the G lanes reads shard by shard (one
            ranged read per visit from an object store).
        shard_ids: with ``locality="shard"``, one shard id per sample
            (``ShardedDataset.shard_ids``); samples of a class must be stored
            contiguously, as the packer writes them.
        window: with ``locality="shard"``, steps per shuffle window of a lane
            (larger: more varied batch-mates, longer-lived reads).

    .. warning::
        Call :meth:`set_epoch` at the start of every epoch, before creating
        the DataLoader iterator; otherwise every epoch has the same order.

    Corner cases:
        * about one pass per epoch: class c gives ``ceil(n_c / K)`` chunks; a
          remainder of fewer than G chunks is dropped each epoch (a different one);
        * a class too large to fit once per step is capped, with a different
          random subset of its samples each epoch;
        * fewer than G eligible classes raises ValueError saying how many exist;
        * more ranks than G (``num_replicas > classes_per_step``) raises ValueError;
        * ranks' batch sizes differ by K when W does not divide G:
          ``rank_batch_sizes`` lists them (an all-gather of the batch needs it).

    Example::

        sampler = DistributedBalancedSampler(dataset, samples_per_class=4, classes_per_step=16,
                                             num_replicas=hvd.size(), rank=hvd.rank(), seed=0)
        loader = DataLoader(dataset, sampler=sampler, batch_size=sampler.batch_size, num_workers=4)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for images, labels in loader:
                ...
    """



class DistributedBalancedBatchSampler(BatchForm, _BalancedPlan, Sampler[list[int]]):
    """The batch form of :class:`DistributedBalancedSampler`: one list of P*K indices per step.

    Same arguments, plan and guarantees; use it as
    ``DataLoader(dataset, batch_sampler=s)``. ``len(s)`` is the number of
    batches in the epoch (a resumed iterator yields those after the saved
    step); ``s.sampler.set_epoch`` reaches ``s.set_epoch``, where Lightning
    and Accelerate look for it.
    """

    _owner = "DistributedBalancedBatchSampler"

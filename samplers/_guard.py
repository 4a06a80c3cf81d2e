"""Refuse, in one line, the two ways frameworks silently break a P x K sampler.

1. **Re-sharding wrappers.** Lightning's default
   (``Trainer(use_distributed_sampler=True)``) wraps any sampler in a
   ``DistributedSamplerWrapper`` that shuffles the rank's stream and keeps
   1/W of it; ``accelerator.prepare(loader)`` deals the rank's batches
   round-robin (``BatchSamplerShard``) or feeds every rank from rank 0
   (``DataLoaderDispatcher``); pytorch-ignite's ``idist.auto_dataloader``
   wraps a ``sampler=`` in ``DistributedProxySampler`` and catalyst's
   ``DistributedSamplerWrapper`` (the source of Lightning's) does the same.
   Each turns P x K batches into something else without an error. The
   sampler already gives every rank its share, so when it finds one of them
   on the call stack that creates its iterator (or that calls ``set_epoch``:
   the dispatcher does so on every rank but iterates on rank 0 only, so every
   rank must refuse there) it raises :class:`SamplerSetupError` naming the
   setting that leaves it alone. Besides the classes it knows by name it
   recognises the behaviour: a ``DistributedSampler`` of more than one
   replica whose ``__iter__`` iterates this sampler and whose length is
   shorter than the sampler's keeps a share of its stream.
2. **A world detected too early.** A sampler built before the process group
   exists (Lightning starts it inside ``fit()``) may have found "rank 0 of 1"
   on a rank of a larger world. When the rank and world size were detected,
   the iterator compares them with the live runtime (or the launcher's
   environment) and raises if they no longer hold.

Only the frames above ``__iter__`` and ``set_epoch`` are read (no import of
any framework), once per call; explicit ``num_replicas``/``rank`` are trusted (the cross-rank
:func:`~pksampler.samplers.check_consistent` checks those).
"""

from __future__ import annotations

import sys

__all__ = ["SamplerSetupError", "check_not_resharded", "check_world_still_holds", "resharding_wrapper"]

#: frames above the sampler's ``__iter__`` searched for a wrapper (DataLoader and fetcher layers included)
_DEPTH = 24

_LIGHTNING_FIX = ("pass Trainer(use_distributed_sampler=False) (Fabric: setup_dataloaders(..., "
                  "use_distributed_sampler=False)); the sampler already gives each rank its share of every step")
_ACCELERATE_FIX = ("leave the DataLoader out of accelerator.prepare(...) (prepare the model and optimizer only) and "
                   "call sampler.set_epoch(epoch) yourself; the sampler already gives each rank its share of every step")

_IGNITE_FIX = ("pass the batch form as idist.auto_dataloader(dataset, batch_sampler=DistributedBalancedBatchSampler(...)) "
               "(it leaves a batch_sampler alone), or build the DataLoader yourself; the sampler already gives each "
               "rank its share of every step")
_UNWRAPPED_FIX = ("pass the sampler to the DataLoader as it is (sampler= with batch_size=P*K, or the batch form as "
                  "batch_sampler=), without a distributed wrapper; the sampler already gives each rank its share of "
                  "every step")

_LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
_LIGHTNING_WRAPPER = "Lightning's DistributedSamplerWrapper (Trainer(use_distributed_sampler=True), the default)"
#: (module prefixes, class name) -> (what the error calls it, the fix it names)
_WRAPPERS = {
    (_LIGHTNING, "_DatasetSamplerWrapper"): (_LIGHTNING_WRAPPER, _LIGHTNING_FIX),
    (_LIGHTNING, "DistributedSamplerWrapper"): (_LIGHTNING_WRAPPER, _LIGHTNING_FIX),
    (("accelerate",), "BatchSamplerShard"): ("Accelerate's BatchSamplerShard (accelerator.prepare(loader))",
                                             _ACCELERATE_FIX),
    (("accelerate",), "DataLoaderDispatcher"): ("Accelerate's DataLoaderDispatcher (dispatch_batches=True)",
                                                _ACCELERATE_FIX),
    (("accelerate",), "IterableDatasetShard"): ("Accelerate's IterableDatasetShard", _ACCELERATE_FIX),
    (("ignite",), "DistributedProxySampler"): ("pytorch-ignite's DistributedProxySampler "
                                               "(idist.auto_dataloader(..., sampler=...))", _IGNITE_FIX),
    (("catalyst",), "DistributedSamplerWrapper"): ("catalyst's DistributedSamplerWrapper", _UNWRAPPED_FIX),
}


class SamplerSetupError(RuntimeError):
    """A sampler used in a way that would silently break its P x K batches; the message names the fix."""


def _wrapper_fix(obj: object, method: str, length: int | None) -> tuple[str, str] | None:
    """``(wrapper's name, fix)`` when ``obj`` (running ``method``) is a known re-sharding wrapper or behaves as one,
    else None."""
    cls = type(obj)
    module = getattr(cls, "__module__", "") or ""
    for (prefixes, name), found in _WRAPPERS.items():
        if cls.__name__ == name and module.split(".")[0] in prefixes:
            return found
    return _resharding_by_behaviour(obj, module, method, length)


def _resharding_by_behaviour(obj: object, module: str, method: str, length: int | None) -> tuple[str, str] | None:
    """A ``DistributedSampler`` of W > 1 replicas whose ``__iter__`` iterates this sampler (of ``length`` items)
    and whose own length is shorter: it keeps a share of the stream.

    Both conditions are what a re-sharding wrapper does (torch's, ignite's,
    catalyst's report ``ceil(length / W)``); a subclass that passes the whole
    stream on (its ``len`` is the sampler's), or user code that merely runs
    inside another method of a ``DistributedSampler``, is left alone.
    """
    from torch.utils.data import DistributedSampler

    replicas = getattr(obj, "num_replicas", None)
    if method != "__iter__" or module.split(".")[0] == "pksampler" or not isinstance(obj, DistributedSampler) \
            or not isinstance(replicas, int) or replicas < 2:
        return None
    try:
        kept = len(obj)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a wrapper without a usable length: judged by its kind alone
        kept = None
    if length is not None and isinstance(kept, int) and kept >= length:
        return None
    name = f"{module}.{type(obj).__qualname__}" if module else type(obj).__qualname__
    return f"{name}, a DistributedSampler of {replicas} replicas iterating it (it keeps one index in {replicas})", \
        _UNWRAPPED_FIX


def resharding_wrapper(skip: int = 1, length: int | None = None) -> tuple[str, str] | None:
    """The re-sharding wrapper found in the calling frames (``(name, fix)``), or None; ``length`` is the
    sampler's own ``len`` (a wrapper at least as long passes the whole stream on)."""
    frame = sys._getframe(skip + 1)
    for _ in range(_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        found = _wrapper_fix(owner, frame.f_code.co_name, length) if owner is not None else None
        if found is not None:
            return found
        frame = frame.f_back
    return None


def check_not_resharded(owner: str, length: int | None = None) -> None:
    """Raise :class:`SamplerSetupError` when a framework's re-sharding wrapper is iterating this sampler
    (``length``: the sampler's ``len``)."""
    found = resharding_wrapper(skip=2, length=length)
    if found is not None:
        wrapper, fix = found
        raise SamplerSetupError(
            f"{owner} is used through {wrapper}, which re-shards its batches across ranks and breaks "
            f"P x K without an error: {fix}"
        )


def check_world_still_holds(num_replicas: int, rank: int, *, owner: str) -> None:
    """Raise when a detected ``(rank, num_replicas)`` disagrees with the live runtime or launcher environment."""
    from pksampler import comm

    live = comm.detect_world()
    if live is None or (live[0], live[1]) == (rank, num_replicas):
        return
    live_rank, live_size, source = live[0], live[1], live[4]
    raise SamplerSetupError(
        f"{owner} detected rank {rank} of num_replicas={num_replicas} when it was built, but {source} now says "
        f"rank {live_rank} of {live_size} (it was built before the process group started): build it after the "
        "process group starts (e.g. in LightningDataModule.setup() or train_dataloader()) or pass "
        "num_replicas= and rank= explicitly"
    )

"""Check that every rank built its sampler from the same inputs.

Ranks that disagree on labels, P, K, seed, epoch or world size would build
different plans and later hang in a collective (one rank waits for an
allreduce that another never starts). :func:`check_consistent` compares a
fingerprint across ranks with one allgather, which every rank takes part in,
and raises the same error on every rank.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import numpy as np

__all__ = ["SamplerMismatchError", "check_consistent", "consistency_row", "sampler_fingerprint"]

#: the fields compared across ranks, in fingerprint order
_FIELDS = ("labels", "plan", "seed", "epoch", "num_replicas")

Allgather = Callable[[np.ndarray], np.ndarray]


class SamplerMismatchError(RuntimeError):
    """Raised on every rank when ranks built their samplers from different inputs."""


def _digest64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def sampler_fingerprint(sampler: Any) -> np.ndarray:
    """An int64 vector summarising what must be equal on every rank.

    Fields: labels digest, plan settings digest (the sampler's public
    ``plan_identity()``: G, K and policies; plus every rank's batch size),
    seed, epoch, world size.
    """
    identity = dict(sampler.plan_identity())
    labels = str(identity.pop("labels_fingerprint", ""))
    identity["rank_batch_sizes"] = list(sampler.rank_batch_sizes)  # equal on every rank, unlike batch_size
    extra = getattr(sampler, "consistency_extra", None)
    if extra is not None:
        identity["extra"] = extra()
    plan = repr(sorted(identity.items()))
    return np.array(
        [_digest64(labels), _digest64(plan), sampler.seed, sampler.epoch, sampler.num_replicas],
        dtype=np.int64,
    )


def consistency_row(sampler: Any) -> np.ndarray:
    """What :func:`check_consistent` gathers from each rank: the fingerprint, then the sampler's ``rank``.

    The fingerprint must be equal on every rank; the rank must equal the
    process's place in the gather (the live process group's rank order).
    """
    return np.append(sampler_fingerprint(sampler), np.int64(sampler.rank))


def check_consistent(sampler: Any, *, allgather: Allgather | None = None) -> None:
    """Raise :class:`SamplerMismatchError` on every rank if the ranks' samplers differ.

    Args:
        sampler: a pksampler sampler (balanced or triplet).
        allgather: maps this rank's 1-D int64 fingerprint to the ``(W, F)``
            array of every rank's; default: :func:`pksampler.comm.all_gather_numpy`
            (Horovod or torch.distributed when initialised, else one process).

    Every rank must call this at the same point (it is a collective).
    Besides the fingerprint it checks each sampler's ``num_replicas`` and
    ``rank`` against the processes that took part: their number, and each
    process's place in the gather (its rank in the live process group).
    """
    mine = consistency_row(sampler)
    if allgather is None:
        from pksampler.comm import all_gather_numpy as allgather
    table = np.asarray(allgather(mine))
    if table.ndim != 2 or table.shape[1] != mine.shape[0]:
        raise SamplerMismatchError(f"allgather returned shape {table.shape}, expected (world_size, {mine.shape[0]})")
    if table.shape[0] != sampler.num_replicas:
        raise SamplerMismatchError(
            f"{table.shape[0]} processes took part in the check but the sampler has num_replicas={sampler.num_replicas}"
        )
    _check_ranks(table[:, -1])
    table = table[:, :-1]
    differing = [name for column, name in enumerate(_FIELDS) if np.unique(table[:, column]).size > 1]
    if differing:
        details = []
        for name in differing:
            column = _FIELDS.index(name)
            values = table[:, column]
            groups = {int(v): np.flatnonzero(values == v).tolist() for v in np.unique(values)}
            shown = "; ".join(
                f"ranks {ranks}: {value if name in ('seed', 'epoch', 'num_replicas') else hex(value & (2**64 - 1))}"
                for value, ranks in groups.items()
            )
            details.append(f"{name} differs ({shown})")
        raise SamplerMismatchError(
            "samplers differ across ranks, which would make ranks build different plans and hang in a "
            "collective: " + ", ".join(details)
        )


def _check_ranks(ranks: np.ndarray) -> None:
    """Each process's sampler must hold the rank of its place in the gather (the live process group's rank)."""
    wrong = np.flatnonzero(ranks != np.arange(ranks.shape[0]))
    if wrong.size:
        shown = "; ".join(f"process {int(p)} has rank={int(ranks[p])}" for p in wrong[:4])
        raise SamplerMismatchError(
            f"sampler ranks do not match the process group ({shown}): ranks would train on the same or missing "
            "batches; pass each process's own rank (or leave rank=None to detect it)"
        )

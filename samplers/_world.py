"""Rank and world size for the samplers: explicit arguments, else :mod:`pksampler.comm`.

The samplers take rank and world size as plain numbers; when the caller
passes ``None`` they are looked up once, through the project's one
communication module, which never imports a runtime itself.

Also here: how a global step's G items (classes or triplets) are split over
W ranks, as evenly as possible, for any W from 1 to G (:func:`rank_share`).
"""

from __future__ import annotations

import os

from ._validate import check_int

__all__ = ["rank_share", "rank_shares", "resolve_world", "step_total", "world_info"]


def world_info() -> tuple[int, int]:
    """``(rank, world_size)`` of this process (see :func:`pksampler.comm.world_info`)."""
    from pksampler import comm

    return comm.world_info()


def _refuse_hidden_world(owner: str) -> None:
    """Raise when one process was detected but ``WORLD_SIZE`` says the job has more.

    Then this process is one rank of a larger job whose launcher did not say
    which (no ``RANK``/``LOCAL_RANK``); a sampler taking "rank 0 of 1" would
    train every rank on identical batches without an error.
    """
    size = os.environ.get("WORLD_SIZE", "")
    if size.strip().isdigit() and int(size) > 1:
        raise ValueError(
            f"{owner}(num_replicas=None) detected one process, but the environment says WORLD_SIZE={size} and "
            "gives no rank: build the sampler after the process group starts or pass num_replicas= and rank="
        )


def resolve_world(num_replicas: int | None, rank: int | None, *, owner: str) -> tuple[int, int]:
    """Fill in ``None`` arguments from :func:`world_info`; explicit arguments win.

    Returns ``(num_replicas, rank)`` after checking ``0 <= rank < num_replicas``.
    """
    if num_replicas is None or rank is None:
        detected_rank, detected_size = world_info()
        if num_replicas is None and detected_size == 1:
            _refuse_hidden_world(owner)
        num_replicas = detected_size if num_replicas is None else num_replicas
        rank = detected_rank if rank is None else rank
    num_replicas = check_int("num_replicas", num_replicas, minimum=1, owner=owner)
    rank = check_int("rank", rank, owner=owner)
    if not 0 <= rank < num_replicas:
        raise ValueError(
            f"{owner}(rank=) must be in the interval [0, {num_replicas - 1}] "
            f"for num_replicas={num_replicas}, got {rank}"
        )
    return num_replicas, rank



def rank_shares(total: int, num_replicas: int) -> list[int]:
    """How many of ``total`` items (classes or triplets of a global step) each rank takes.

    As even as possible: the first ``total % num_replicas`` ranks take
    ``ceil(total / num_replicas)``, the others ``floor(total / num_replicas)``
    (the split of ``numpy.array_split``). Needs ``1 <= num_replicas <= total``.
    """
    base, extra = divmod(total, num_replicas)
    return [base + (rank < extra) for rank in range(num_replicas)]


def rank_share(total: int, num_replicas: int, rank: int) -> tuple[int, int]:
    """``(first, count)``: rank ``rank`` takes items ``[first, first + count)`` of a global step.

    Contiguous runs in rank order, sized as in :func:`rank_shares`; when
    ``num_replicas`` divides ``total`` this is ``(rank * P, P)`` with
    ``P = total / num_replicas``.
    """
    base, extra = divmod(total, num_replicas)
    return rank * base + min(rank, extra), base + (rank < extra)


def step_total(per_rank: int | None, per_step: int | None, num_replicas: int, *, owner: str,
               names: tuple[str, str]) -> int:
    """The items of one global step, from exactly one of the per-rank or the global count.

    ``per_rank`` (the older form, e.g. ``classes_per_batch=P``) gives
    ``num_replicas * per_rank``; ``per_step`` (e.g. ``classes_per_step=G``)
    is split over the ranks by :func:`rank_share` and must be at least
    ``num_replicas``, since every rank takes at least one item per step.
    """
    rank_name, step_name = names
    if (per_rank is None) == (per_step is None):
        given = "both" if per_rank is not None else "neither"
        raise TypeError(f"{owner}() takes exactly one of {rank_name}= (per rank) and {step_name}= (per global step), "
                        f"got {given}")
    if per_rank is not None:
        return num_replicas * check_int(rank_name, per_rank, minimum=1, owner=owner)
    total = check_int(step_name, per_step, minimum=1, owner=owner)
    if num_replicas > total:
        raise ValueError(
            f"{owner}(num_replicas=) must be at most {step_name}={total}: every rank takes at least one of "
            f"them per step, got num_replicas={num_replicas}"
        )
    return total

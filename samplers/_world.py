"""Rank and world size for the samplers: explicit arguments, else :mod:`pksampler.comm`.

The samplers take rank and world size as plain numbers; when the caller
passes ``None`` they are looked up once, through the project's one
communication module, which never imports a runtime itself.
"""

from __future__ import annotations

from ._validate import check_int

__all__ = ["resolve_world", "world_info"]


def world_info() -> tuple[int, int]:
    """``(rank, world_size)`` of this process (see :func:`pksampler.comm.world_info`)."""
    from pksampler import comm

    return comm.world_info()


def resolve_world(num_replicas: int | None, rank: int | None, *, owner: str) -> tuple[int, int]:
    """Fill in ``None`` arguments from :func:`world_info`; explicit arguments win.

    Returns ``(num_replicas, rank)`` after checking ``0 <= rank < num_replicas``.
    """
    if num_replicas is None or rank is None:
        detected_rank, detected_size = world_info()
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


"""Detect this process's rank and the world size without importing a runtime.

The samplers take rank and world size as plain numbers; this helper is the one
place that looks them up when the caller passes ``None``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ._validate import check_int

__all__ = ["initialised_horovod", "initialised_torch_distributed", "resolve_world", "world_info"]

_ENV_PAIRS = (
    ("HOROVOD_RANK", "HOROVOD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("RANK", "WORLD_SIZE"),
)


def initialised_horovod() -> Any | None:
    """``horovod.torch`` if the program imported and initialised it, else None.

    The samplers never import a distributed runtime themselves; they only use
    one the program has already started.
    """
    hvd = sys.modules.get("horovod.torch")
    try:
        return hvd if hvd is not None and hvd.is_initialized() else None
    except (AttributeError, ValueError, RuntimeError):
        return None


def initialised_torch_distributed() -> Any | None:
    """``torch.distributed`` if a process group is initialised, else None."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist if dist is not None and dist.is_available() and dist.is_initialized() else None
    except (AttributeError, RuntimeError, ValueError):
        return None


def _from_horovod() -> tuple[int, int] | None:
    hvd = initialised_horovod()
    return None if hvd is None else (int(hvd.rank()), int(hvd.size()))


def _from_torch_distributed() -> tuple[int, int] | None:
    dist = initialised_torch_distributed()
    return None if dist is None else (int(dist.get_rank()), int(dist.get_world_size()))


def _from_environment() -> tuple[int, int] | None:
    for rank_key, size_key in _ENV_PAIRS:
        rank, size = os.environ.get(rank_key), os.environ.get(size_key)
        if rank is None or size is None:
            continue
        try:
            return int(rank), int(size)
        except ValueError:
            raise ValueError(
                f"environment variables {rank_key}={rank!r} and {size_key}={size!r} must be integers"
            ) from None
    return None


def world_info() -> tuple[int, int]:
    """Return ``(rank, world_size)`` of this process.

    Looks, in order, at an initialised Horovod (``horovod.torch``), an
    initialised ``torch.distributed`` process group, the launcher's environment
    (HOROVOD_RANK/HOROVOD_SIZE, OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE,
    RANK/WORLD_SIZE) and falls back to ``(0, 1)``.
    """
    for probe in (_from_horovod, _from_torch_distributed, _from_environment):
        found = probe()
        if found is not None:
            return found
    return 0, 1


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

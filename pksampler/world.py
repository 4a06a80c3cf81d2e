"""The world a process trains in: one frozen value of rank, size, local rank and ranks per host.

As in mosaicml/streaming's ``World``, a rank and a world size are held in one
value that the parts read, never copied into fields that someone else keeps
up to date. A run reads it once at start (:meth:`World.detect`); when the set
of ranks changes (a Horovod elastic reset) a new value is read and handed to
every part that owns a share of the work: ``part.set_world(world)`` (the
trainer's backend, the sampler, the sharded head's loss). A part never asks
the runtime on its own.

Example::

    world = World.detect()  # Horovod, torch.distributed, the launcher's environment, else rank 0 of 1
    sampler.set_world(world)
    first, count = world.rank, world.size
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pksampler import comm

__all__ = ["World"]


@dataclass(frozen=True)
class World:
    """``rank`` of ``size`` ranks; ``local_rank`` among the ``local_size`` ranks of this host (it selects the GPU;
    the host's memory is shared by ``local_size`` ranks); ``loss_scale``: what the trainer multiplies the loss of
    the gathered global batch by before backward (Horovod, which averages gradients: ``size``; else 1), so a part
    that owns a share of the world divides it out of its own gradient."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    loss_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("rank", "size", "local_rank", "local_size"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"World({name}=) expects an int, got {value!r} ({type(value).__name__})")
            object.__setattr__(self, name, int(value))  # numpy ints (a launcher's arrays) become ints
        if self.size < 1:
            raise ValueError(f"World(size=) expects a positive int, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"World(rank=) must be in [0, {self.size}) for size={self.size}, got {self.rank}")
        if self.local_rank < 0:
            raise ValueError(f"World(local_rank=) expects an int >= 0, got {self.local_rank}")
        if self.local_size < 1:
            raise ValueError(f"World(local_size=) expects a positive int, got {self.local_size}")
        if isinstance(self.loss_scale, bool) or not isinstance(self.loss_scale, (int, float)) or not (
                0 < self.loss_scale < float("inf")):
            raise ValueError(f"World(loss_scale=) expects a finite number > 0, got {self.loss_scale!r}")
        object.__setattr__(self, "loss_scale", float(self.loss_scale))

    @classmethod
    def detect(cls) -> "World":
        """This process's world now: Horovod, torch.distributed, the launcher's environment, else rank 0 of 1."""
        found = comm.detect_world()
        return cls(*found[:4]) if found is not None else cls()

    @classmethod
    def of(cls, collectives: object) -> "World":
        """The world ``collectives`` carries (a trainer's backend: with the loss scale of its gathered batch, which
        is the world size under Horovod), else one of its ``rank`` and ``size`` with scale 1."""
        carried = getattr(collectives, "world", None)
        if isinstance(carried, World):
            return carried
        return cls(rank=collectives.rank, size=collectives.size)  # type: ignore[attr-defined]

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the rank that writes the workspace)."""
        return self.rank == 0

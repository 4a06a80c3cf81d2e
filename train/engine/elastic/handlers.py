"""Horovod elastic's state handlers: what a commit saves, a reset restores and a sync sends, per value.

Horovod picks a handler per value of its ``TorchState`` by type;
:func:`state_handlers` puts pksampler's first:

* pksampler samplers (:class:`SamplerHandler`): save = the sampler's
  position (epoch, seed, next global step), restore = load it, sync =
  rank 0's position broadcast and loaded. The sampler object stays: a reset
  gives it the new world (``set_world``, :meth:`Trainer.set_world`), so the
  loader's reference stays valid and no label is grouped again; the global
  plan does not depend on the world size, so no global step is repeated or
  skipped (Horovod's ``ElasticSampler`` re-splits a shuffled index list and
  repeats samples, horovod#3399).
* :class:`TrainState` (epoch, batches done, global step, best) and the lr schedule: copies,
  restored in place, broadcast from rank 0.
* every part that owns a share of a row-sharded table (each item of
  :attr:`StepParts.shared`, held as a :class:`Shared`; the sharded head's
  loss is one), one :class:`SharedPartHandler` each: save = this rank's range and
  a replica of one rank's on another host, so a host that leaves takes no
  rows with it; after a reset every rank of the new world (joiners too)
  receives its new range from whoever holds it, or, in a job resumed from a
  rank-range checkpoint, reads it from the range files that overlap it.
* optimizers: the state dict is broadcast and loaded; Horovod's own handler
  first takes a zero-gradient step on a rank with an empty state (a
  joiner), which moves weight-decayed parameters after they were synced.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import socket
from dataclasses import fields
from typing import Any, Callable, Sequence

import torch

from pksampler.train.engine.trainer import TrainState

__all__ = ["SamplerHandler", "SharedPartHandler", "Shared", "as_state_handler", "host_key", "state_handlers"]


# --- state handlers -----------------------------------------------------------------


def _broadcast(value: Any, name: str) -> Any:
    from pksampler import comm

    return comm.broadcast_object(value, 0, name=name)


def _base_handler() -> type:
    from horovod.torch.elastic.state import StateHandler

    return StateHandler


class SamplerHandler:
    """Elastic state of a pksampler sampler: its position at the last commit.

    ``position()`` gives the sampler's resumable position (epoch, seed, the
    next global step: the trainer's count, since a DataLoader runs ahead of
    the loop). The sampler's share of each global step follows the world it
    is given (``set_world``), not this handler.
    """

    def __init__(self, sampler: Any, *, position: Callable[[], dict[str, Any]]) -> None:
        self.value = sampler
        self.position = position
        self._saved = copy.deepcopy(position())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.position())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        # Rank 0's committed position; every rank takes its own share of G in the new world from it.
        self._saved = _broadcast(self._saved, "pksampler.elastic.sampler")
        self.restore()

    def on_reset(self) -> None:
        """After every reset, once the sampler has the new world: the committed position again.

        When hosts were only removed Horovod skips the sync (every survivor
        holds the committed state), and the interrupted iterator's count is stale.
        """
        self.restore()

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class _TrainStateHandler:
    """The loop's :class:`TrainState`: a deep copy per commit, restored in place (hooks hold the object)."""

    def __init__(self, value: TrainState) -> None:
        self.value = value
        self.save()

    def _fields(self) -> dict[str, Any]:
        return {f.name: copy.deepcopy(getattr(self.value, f.name)) for f in fields(self.value)}

    def save(self) -> None:
        self._saved = self._fields()

    def restore(self) -> None:
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self.value, name, value)

    def sync(self) -> None:
        for name, value in _broadcast(self._fields(), "pksampler.elastic.train_state").items():
            setattr(self.value, name, value)

    def set_value(self, value: TrainState) -> None:
        self.value = value
        self.save()


class _StateDictHandler:
    """Anything with ``state_dict``/``load_state_dict`` (optimizer, lr schedule): copied, broadcast, loaded."""

    name = "pksampler.elastic.state_dict"

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(_broadcast(self.value.state_dict(), f"{self.name}.{type(self.value).__name__}"))

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class Shared:
    """An item of :attr:`StepParts.shared` as Horovod's ``TorchState`` holds it, so one handler serves them all;
    ``key``: the name it is checkpointed under (:meth:`Trainer.shared_parts`).

    A shared part implements the sharded-state protocol (docs/sharded-head.md): ``num_rows`` (the whole table's
    rows), ``set_world(world)`` (its range and gradient scale in a new world, zero until loaded),
    ``range_state()`` (no collective: ``(dense, RangeCopy)``, the dense state the same on every rank and a host
    copy of its own range), ``load_range(dense, fill)`` (``fill(*tensors)`` writes its new range: a collective)
    and ``load_initial()`` (its initial rows, before any commit).
    """

    def __init__(self, part: Any, key: str = "") -> None:
        self.part, self.key = part, key


class SharedPartHandler:
    """Elastic state of one shared part: own range + one replica, re-assembled in every new world.

    A commit (:meth:`save`, a collective: every rank commits at the same step)
    keeps a host copy of this rank's range and receives a replica of another
    rank's, on another host when there is one
    (:mod:`~pksampler.train.modeling.head_replicas`): 2 × ⌈N/W⌉ rows per rank
    of each of the part's tensors, never the whole table. A new world
    assembles its ranges from whoever holds them (:meth:`assemble`): in the
    sync when Horovod runs one, else (hosts only left: Horovod skips it) at
    the start of the body (:meth:`ensure_current`); at a reset the part takes
    its new (empty) range with ``set_world`` (:meth:`Trainer.set_world`) and
    the reset callback (:meth:`on_reset`) only marks it stale, since joiners
    are not in it. ``resumed``, on the rank that read the checkpoint of a
    resumed job (:meth:`Trainer.resumed_share`): the part's saved state with
    its ``ranges`` (every rank reads its own range from the files that overlap
    it, :func:`~pksampler.train.modeling.range_checkpoint.load_part`: no rank
    holds the whole table), or ``(dense, RangeCopy of every row)`` (an older
    checkpoint with the whole head inside, which that rank holds). ``host()``
    names this rank's host (equal numbers: one host). Nothing here is
    collective at construction: a joiner builds its state before it meets the
    survivors.
    """

    def __init__(self, value: Shared, *, collectives: Any,
                 resumed: dict[str, Any] | tuple[dict[str, Any], Any] | None = None,
                 host: Callable[[], int] = lambda: host_key(), name: str = "pksampler.elastic.shared") -> None:
        self.value, self.collectives, self.host, self.name = value, collectives, host, name
        self._dense: dict[str, Any] | None = None
        self._copies: list[Any] = []
        self._step, self._world = -1, 0
        self._commits = 0  # commits this handler made or received (the commit's number: the same on every rank)
        self.current = False  # this rank's range is the current world's (set by an assembly)
        if isinstance(resumed, dict):
            self._on_disk(resumed)
        elif resumed is not None:
            # rank 0 of a run resumed from an older checkpoint holds its whole table (one copy of [0, N)); the
            # first assembly gives every rank its range of it (each built only its own, only rank 0 read the file)
            self._dense, whole = resumed
            self._copies, self._step, self._world = [whole], 0, 1

    def _on_disk(self, saved: dict[str, Any]) -> None:
        """The committed state is a checkpoint's: ``saved`` (dense state and ``ranges``) names its range files.
        Reported as one copy of every row at step 0 in a world of 0 ranks (:func:`holder_row`), which
        :meth:`assemble` reads as "each rank reads its range from the files"."""
        from pksampler.train.modeling.head_replicas import RangeCopy

        self._dense, self._copies = saved, [RangeCopy(0, self.value.part.num_rows, ())]
        self._step, self._world = 0, 0

    @property
    def copies(self) -> list[Any]:
        """The committed ranges this rank holds (:class:`~pksampler.train.modeling.head_replicas.RangeCopy`)."""
        return list(self._copies)

    def save(self) -> None:
        from pksampler.train.modeling.head_replicas import exchange_replica, replica_shift
        from pksampler.train.modeling.sharded_head import row_range

        part, collectives = self.value.part, self.collectives
        dense, own = part.range_state()
        hosts = collectives.allgather(torch.tensor([self.host()], dtype=torch.int64)).cpu().tolist()
        ranges = [row_range(part.num_rows, collectives.size, r) for r in range(collectives.size)]
        replica = exchange_replica(own, ranges, collectives=collectives, shift=replica_shift(hosts))
        # replaced only now: a commit cut short by a lost rank leaves the previous one whole
        self._dense, self._copies = dense, [own] + ([replica] if replica is not None else [])
        self._step, self._world = self._step + 1 if self._step >= 0 else 1, collectives.size
        self.current = True

    def restore(self) -> None:
        """Nothing yet: the world is gone; the assembly that follows the reset rebuilds the range."""

    def sync(self) -> None:
        self.assemble()

    def on_reset(self) -> None:
        """A reset callback (survivors only, joiners are not here): the range is stale until the next assembly."""
        self.current = False

    def ensure_current(self) -> None:
        """At the start of the body: assemble if no sync did since the last reset (a collective on every rank or
        on none: Horovod skips the sync on every survivor alike, and then there are no joiners)."""
        if not self.current:
            self.assemble()

    def assemble(self) -> None:
        """This rank's range of the committed table for the current world, from whoever holds it (a collective).

        Every rank reports its copies (one small all-gather); the plan is the
        same on every rank, so a range held by no rank raises
        :class:`~pksampler.train.modeling.head_replicas.HeadRowsLost` on
        every rank. No copy anywhere: no step was committed, the initial rows.
        """
        from pksampler.train.modeling import head_replicas
        from pksampler.train.modeling.sharded_head import row_range

        part, collectives = self.value.part, self.collectives
        row = head_replicas.holder_row(self._step, self._world, self._copies)
        table = collectives.allgather(torch.from_numpy(row)[None]).cpu().numpy()
        step, segments = head_replicas.plan_segments(table, part.num_rows)
        if step < 0:
            part.load_initial()
        else:
            root = 0 if table[0, 0] == step else int((table[:, 0] == step).argmax())
            dense = collectives.broadcast_object(self._dense if collectives.rank == root else None, root,
                                                 name=self.name)
            ranges = [row_range(part.num_rows, collectives.size, r) for r in range(collectives.size)]
            if table[root, 1] == 0:  # a checkpoint's rows: each rank reads its range's files, and keeps the names
                self._from_disk(dense, *ranges[collectives.rank])
            else:
                part.load_range(dense, functools.partial(head_replicas.assemble, self._copies, segments, ranges,
                                                         collectives=collectives))
                self._step = step
        self.current = True

    def _from_disk(self, saved: dict[str, Any], lo: int, hi: int) -> None:
        """Rows ``[lo, hi)`` from a checkpoint's range files (``saved``: its state with ``ranges``); a rank that
        cannot read its files fails every rank with its one line (a collective), so none goes on to wait for it."""
        from pksampler.agree import raise_together
        from pksampler.train.modeling.range_checkpoint import RangeFileError, load_part

        error = None
        try:
            load_part(self.value.part, saved, lo, hi, key=self.value.key)
        except RangeFileError as caught:
            error = caught
        raise_together(self.collectives, error, kind=RangeFileError)
        self._on_disk(saved)

    def set_value(self, value: Any) -> None:
        self.value = value


def host_key() -> int:
    """This process's host as a number: Horovod's name for it (``HOROVOD_HOSTNAME``), else the machine's name.

    Horovod's name tells apart the "hosts" of one machine in ``-H
    localhost:2,127.0.0.1:2`` (the tests' two hosts).
    """
    name = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little")


def as_state_handler(cls: type) -> type:
    """``cls`` as a subclass of Horovod's ``StateHandler`` (imported only when Horovod is used)."""
    return type(cls.__name__, (cls, _base_handler()), {})


def state_handlers(sampler_type: type, sampler_handler: Callable[[Any], SamplerHandler],
                   extra: Sequence[tuple[type, Callable[[Any], Any]]] = ()) -> list[tuple[type, Callable[[Any], Any]]]:
    """Horovod's handler registry with pksampler's handlers first (the first matching type wins).

    ``sampler_handler(sampler)`` makes the handler of a pksampler sampler of
    ``sampler_type`` (it needs the trainer's position and a rebuild function);
    ``extra`` come before the rest (the shared parts' :class:`Shared`).
    """
    from horovod.torch.elastic.state import ModelStateHandler

    return [
        (sampler_type, sampler_handler),
        *extra,
        (TrainState, as_state_handler(_TrainStateHandler)),
        (torch.optim.lr_scheduler.LRScheduler, as_state_handler(_StateDictHandler)),
        (torch.optim.Optimizer, as_state_handler(_StateDictHandler)),
        (torch.nn.Module, ModelStateHandler),
    ]

"""The in-memory commit of a row-sharded head under Horovod elastic: each rank's own range and one replica.

A commit must survive a host that leaves, yet no rank may hold the whole
head (10⁷ × 128 rows and momentum are 9.5 GiB). So at a commit

1. rank r copies its own range of rows and momentum (:class:`RangeCopy`);
2. it receives a replica of the range of rank ``(r − s) mod W`` and sends its
   own to rank ``(r + s) mod W`` (:func:`exchange_replica`), where the shift
   ``s`` puts every range's replica on another host (:func:`replica_shift`:
   ``s = L`` for hosts of L ranks each; 1 when every rank is on one host,
   which still covers the loss of one rank). The rows move in blocks of
   about :data:`BLOCK_BYTES` per all-to-all, each rank sending one block to
   one rank.

A rank then holds 2 × ⌈C/W⌉·k·D floats of committed rows and as many of
momentum, never C. After a reset every rank of the new world, whatever it
holds (survivors: their own range and a replica, labelled with the old
world's class ids; joiners: nothing; rank 0 of a resumed job: the
checkpoint's whole head), reports what it holds in one small all-gather;
:func:`plan_segments` picks one holder per old range, and
:func:`assemble` moves each range in blocks, every rank receiving only the
rows of its new range. A range that no rank holds (a range and its replica
on hosts lost at once) is :class:`HeadRowsLost`, raised on every rank from
the same table, so no rank waits for rows that will never come.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pksampler.comm import Collectives
from pksampler.train.errors import ConfigError

__all__ = ["BLOCK_BYTES", "HeadRowsLost", "RangeCopy", "Segment", "assemble", "exchange_replica", "holder_row",
           "plan_segments", "replica_shift"]

#: bytes of rows and momentum one all-to-all moves per rank (a commit's and a reset's transient memory)
BLOCK_BYTES = 64 << 20
#: copies a rank may report: its own range and one replica (a resumed rank 0: the whole head, one copy)
_MAX_COPIES = 2


class HeadRowsLost(ConfigError):
    """No surviving rank holds some committed rows: the job must restart from its last checkpoint."""


@dataclass(frozen=True)
class RangeCopy:
    """Committed rows ``[lo, hi)`` of a row-sharded table, on the host: one or more tensors of ``hi − lo`` rows
    each (the head: its rows and their momentum), of one dtype."""

    lo: int
    hi: int
    tensors: tuple[torch.Tensor, ...]

    def block(self, start: int, stop: int) -> torch.Tensor:
        """Class ids ``[start, stop)`` (inside the range), every tensor's row flattened, side by side: ``(n, w)``."""
        return torch.cat([t[start - self.lo:stop - self.lo].reshape(stop - start, _row_width([t]))
                          for t in self.tensors], dim=1)


def _unpack(block: torch.Tensor, targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:meth:`RangeCopy.block`'s ``(n, w)`` back into one ``(n, ...)`` piece per target's row shape."""
    widths = [int(np.prod(t.shape[1:], dtype=np.int64)) for t in targets]
    return [part.reshape(block.shape[0], *t.shape[1:]) for part, t in zip(block.split(widths, dim=1), targets)]


def _row_width(tensors: Sequence[torch.Tensor]) -> int:
    """Numbers in one row of every tensor together."""
    return sum(int(np.prod(t.shape[1:], dtype=np.int64)) for t in tensors)


@dataclass(frozen=True)
class Segment:
    """Class ids ``[lo, hi)`` that rank ``source`` sends to the new world."""

    source: int
    lo: int
    hi: int


def replica_shift(hosts: Sequence[int]) -> int:
    """The shift s such that rank r keeps the replica of rank ``(r − s) mod W``'s range; 0 when W = 1.

    ``hosts[r]`` names rank r's host. The smallest s that puts every range's
    replica on another host than the range; when no s does (every rank on one
    host, or hosts of very different sizes), the s that does so for the most
    ranks (smallest on ties): one host's loss may then take both copies of
    some range, which :func:`plan_segments` reports.
    """
    world = len(hosts)
    if world < 2:
        return 0
    apart = [sum(hosts[r] != hosts[(r - s) % world] for r in range(world)) for s in range(1, world)]
    return 1 + int(np.argmax(apart))  # argmax: the first of the best


def _rows_per_block(row_numel: int, element_size: int) -> int:
    """Rows per all-to-all: the same on every rank (from the row's shape, never from a range's length)."""
    return max(1, BLOCK_BYTES // max(1, row_numel * element_size))


def exchange_replica(own: RangeCopy, ranges: Sequence[tuple[int, int]], *, collectives: Collectives,
                     shift: int) -> RangeCopy | None:
    """Send ``own`` (this rank's range) to rank ``(r + shift) mod W``; return the range of ``(r − shift) mod W``.

    ``ranges`` are every rank's ``(lo, hi)`` in the current world. A collective:
    every rank calls it with the same ``ranges`` and ``shift``; about
    :data:`BLOCK_BYTES` leave and arrive per rank per all-to-all. None when
    ``shift`` is 0 (one rank: nothing to protect against).
    """
    world, rank = collectives.size, collectives.rank
    if shift % world == 0:
        return None
    dest, src = (rank + shift) % world, (rank - shift) % world
    lo, hi = ranges[src]
    received = [torch.empty((hi - lo, *t.shape[1:]), dtype=t.dtype) for t in own.tensors]
    block = _rows_per_block(_row_width(own.tensors), own.tensors[0].element_size())
    for start in range(0, max(h - l for l, h in ranges), block):
        stop = min(own.lo + start + block, own.hi)
        send = own.block(own.lo + start, stop) if own.lo + start < stop else own.block(own.lo, own.lo)
        splits = [0] * world
        splits[dest] = send.shape[0]
        got = collectives.alltoall(send.contiguous(), splits).cpu()
        expected = max(0, min(block, hi - lo - start))
        if got.shape[0] != expected:
            raise RuntimeError(f"replica exchange: expected {expected} rows from rank {src}, got {got.shape[0]}")
        for target, part in zip(received, _unpack(got, received)):
            target[start:start + expected] = part
    return RangeCopy(lo, hi, tuple(received))


def holder_row(step: int, world: int, copies: Sequence[RangeCopy]) -> np.ndarray:
    """What this rank reports before an assembly: ``[commit step, its world size, (lo, hi) per copy]``.

    ``step`` is -1 for a rank that holds nothing (a joiner); unused slots are -1.
    """
    if len(copies) > _MAX_COPIES:
        raise ValueError(f"a rank holds at most {_MAX_COPIES} committed ranges, got {len(copies)}")
    row = np.full(2 + 2 * _MAX_COPIES, -1, dtype=np.int64)
    if copies:
        row[0], row[1] = step, world
        for index, copy in enumerate(copies):
            row[2 + 2 * index:4 + 2 * index] = (copy.lo, copy.hi)
    return row


def plan_segments(table: np.ndarray, num_classes: int) -> tuple[int, list[Segment]]:
    """From every rank's :func:`holder_row`, the commit to assemble and who sends which class ids.

    The commit is rank 0's (whose dense state Horovod's sync hands to every
    rank), else the newest any rank holds. Its ranges are walked from class 0:
    at each position the range reaching furthest is taken, from the lowest
    rank holding it. Returns ``(step, segments)``; ``(-1, [])`` when no rank
    holds anything (a fresh start: every rank has its initial rows). Raises
    :class:`HeadRowsLost` naming the class ids no rank holds.
    """
    steps = table[:, 0]
    if (steps < 0).all():
        return -1, []
    step = int(steps[0]) if steps[0] >= 0 else int(steps.max())
    held = [(int(row[2 + 2 * i]), int(row[3 + 2 * i]), rank) for rank, row in enumerate(table) if row[0] == step
            for i in range(_MAX_COPIES) if row[2 + 2 * i] >= 0]
    old_world = int(table[steps == step][0, 1])
    segments, lost, position = [], [], 0
    while position < num_classes:
        covering = [(hi, -rank) for lo, hi, rank in held if lo <= position < hi]
        if covering:
            hi, negative_rank = max(covering)
            segments.append(Segment(-negative_rank, position, hi))
            position = hi
            continue
        following = [lo for lo, _, _ in held if lo > position]
        stop = min(following, default=num_classes)
        lost.append((position, stop))
        position = stop
    if lost:
        gone = ", ".join(f"[{lo:,}, {hi:,})" for lo, hi in lost)
        raise HeadRowsLost(
            f"Horovod elastic: the sharded head's committed rows of class ids {gone} (of C={num_classes:,}, "
            f"committed at step {step} by {old_world} ranks) are held by no remaining rank: a range and its replica "
            "were on hosts lost together. Start the job again: it resumes from the last checkpoint "
            "(WORKSPACE/checkpoints/last.pt)")
    return step, segments


def assemble(copies: Sequence[RangeCopy], segments: Sequence[Segment], new_ranges: Sequence[tuple[int, int]],
             *targets: torch.Tensor, collectives: Collectives) -> None:
    """Fill ``targets`` (this rank's new range of each of the table's tensors) from the segments' holders.

    A collective: every rank calls it with the same ``segments`` and
    ``new_ranges``. Per all-to-all the segment's source sends one block of
    about :data:`BLOCK_BYTES`, split by the new world's ranges; each rank
    receives only its part of it.
    """
    world, rank = collectives.size, collectives.rank
    lo, hi = new_ranges[rank]
    block = _rows_per_block(_row_width(targets), targets[0].element_size())
    for segment in segments:
        for start in range(segment.lo, segment.hi, block):
            stop = min(start + block, segment.hi)
            splits = [max(0, min(stop, b) - max(start, a)) for a, b in new_ranges]
            if rank == segment.source:
                source = next(c for c in copies if c.lo <= start and stop <= c.hi)
                send = source.block(start, stop)
            else:
                send, splits = torch.empty((0, _row_width(targets)), dtype=targets[0].dtype), [0] * world
            got = collectives.alltoall(send.contiguous(), splits).cpu()
            first, last = max(start, lo), min(stop, hi)
            if got.shape[0] != max(0, last - first):
                raise RuntimeError(f"assembly: expected {max(0, last - first)} rows of [{start}, {stop}) from "
                                   f"rank {segment.source}, got {got.shape[0]}")
            if got.shape[0]:
                for target, part in zip(targets, _unpack(got, targets)):
                    target[first - lo:last - lo] = part.to(target.device)

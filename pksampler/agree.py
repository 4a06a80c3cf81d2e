"""Ranks that fail, fail together: one collective tells every rank which ranks failed, why, and what each holds.

A rank that meets bad input (a missing file, an argument out of range) and
raises on its own leaves the other ranks waiting in their next collective,
which hangs until a timeout. So every rank first checks what it can on its
own, then calls :func:`gather_outcomes` with its error (or None) and the
values the ranks must agree on (digests of their options); every rank
receives the same :class:`Outcomes` table and raises from it, or goes on.

1. One all-gather of ``[kind, message length, *values]`` per rank;
2. only when some rank failed, a second one of the messages (as UTF-8 bytes
   padded to the longest), so a message is never cut.

One process: no collective; the table holds this rank alone.

Example::

    error = None
    try:
        options = check(arguments)  # this rank's own checks, no collective
    except ValueError as caught:
        error = caught
    raise_together(collectives, error)  # every rank raises, or none does
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["Outcomes", "gather_outcomes", "raise_together"]


@dataclass(frozen=True)
class Outcomes:
    """What every rank reported, the same table on every rank.

    Attributes:
        messages: each rank's error message, None where the rank succeeded.
        kinds: each rank's error kind (one of the ``kinds`` given to :func:`gather_outcomes`), None where it
            succeeded.
        values: ``(W, F)`` int64, each rank's values (meaningful where every rank succeeded).
    """

    messages: tuple[str | None, ...]
    kinds: tuple[type[Exception] | None, ...]
    values: np.ndarray

    @property
    def failed(self) -> list[int]:
        """The ranks that reported an error, in rank order."""
        return [rank for rank, message in enumerate(self.messages) if message is not None]

    def differing(self, names: Sequence[str]) -> list[str]:
        """The ``names`` of the value columns on which the ranks differ (the column order of ``values``)."""
        return [name for column, name in enumerate(names) if (self.values[:, column] != self.values[0, column]).any()]


def _encode(message: str, length: int) -> np.ndarray:
    raw = message.encode("utf-8").ljust(length, b"\0")
    return np.frombuffer(raw, dtype=np.int64)


def _decode(row: np.ndarray, length: int) -> str:
    return np.ascontiguousarray(row, dtype=np.int64).tobytes()[:length].decode("utf-8", errors="replace")


def _kind_code(error: BaseException | None, kinds: Sequence[type[Exception]]) -> int:
    if error is None:
        return 0
    return 1 + next((i for i, kind in enumerate(kinds) if isinstance(error, kind)), len(kinds))


def gather_outcomes(collectives: Any, error: BaseException | None, values: Sequence[int] = (), *,
                    kinds: Sequence[type[Exception]] = (Exception,)) -> Outcomes:
    """Collective: every rank's error (or None) and ``values``, as one :class:`Outcomes` on every rank.

    ``collectives``: a :class:`pksampler.comm.Collectives` (``size`` and
    ``allgather_numpy`` are used). Every rank passes as many ``values``. An
    error that is none of ``kinds`` travels as :class:`Exception`.
    """
    known = (*kinds, Exception)
    message = None if error is None else str(error)
    encoded = b"" if message is None else message.encode("utf-8")
    head = np.array([_kind_code(error, kinds), len(encoded), *values], dtype=np.int64)
    if collectives.size == 1:
        rows = head[None]
    else:
        rows = np.asarray(collectives.allgather_numpy(head)).reshape(collectives.size, head.size)
    if not rows[:, 0].any():
        return Outcomes((None,) * rows.shape[0], (None,) * rows.shape[0], rows[:, 2:])
    lengths = rows[:, 1]
    if collectives.size == 1:
        texts = [message]
    else:
        width = max(8, -(-int(lengths.max()) // 8) * 8)
        table = np.asarray(collectives.allgather_numpy(_encode(message or "", width))).reshape(collectives.size, -1)
        texts = [_decode(table[rank], int(lengths[rank])) for rank in range(collectives.size)]
    return Outcomes(tuple(text if code else None for text, code in zip(texts, rows[:, 0])),
                    tuple(known[int(code) - 1] if code else None for code in rows[:, 0]), rows[:, 2:])


def raise_together(collectives: Any, error: BaseException | None, *, kind: type[Exception] = RuntimeError) -> None:
    """Collective: when any rank's ``error`` is set, every rank raises; else every rank returns.

    The lowest failing rank raises its own ``error``; every other rank raises
    ``kind`` with that rank's message, so the same line is read everywhere.
    """
    outcomes = gather_outcomes(collectives, error)
    failed = outcomes.failed
    if not failed:
        return
    if error is not None and collectives.rank == failed[0]:
        raise error
    raise kind(outcomes.messages[failed[0]])

"""Ranks that fail, fail together: one table of every rank's outcome, the same on every rank (ranks as threads)."""

from __future__ import annotations

import pytest
from thread_ranks import on_ranks

from pksampler.agree import gather_outcomes, raise_together


class _One:
    """One process: no collective may run."""

    rank, size = 0, 1

    def allgather_numpy(self, row):
        pytest.fail("one rank needs no collective")


def test_every_rank_reads_every_ranks_message_whole_and_its_kind_and_values():
    long = "x" * 3000 + " — the end"  # longer than any fixed slot: nothing is cut, non-ASCII survives
    errors = [None, ValueError(long), TypeError("bad type")]
    tables = on_ranks(3, lambda ranks: gather_outcomes(ranks, errors[ranks.rank], [ranks.rank, 7],
                                                       kinds=(ValueError, TypeError)))
    for table in tables:
        assert table.messages == (None, long, "bad type") and table.failed == [1, 2]
        assert table.kinds == (None, ValueError, TypeError)
        assert table.values.tolist() == [[0, 7], [1, 7], [2, 7]] and table.differing(["rank", "seven"]) == ["rank"]
    ok = on_ranks(2, lambda ranks: gather_outcomes(ranks, None, [5]))
    assert all(t.failed == [] and t.differing(["five"]) == [] for t in ok)
    assert gather_outcomes(_One(), KeyError("k"), [1]).kinds == (Exception,)  # not one of kinds: Exception


def test_raise_together_raises_on_every_rank_with_the_lowest_failing_ranks_line():
    mine = LookupError("--data: /d1 is missing")
    errors = [None, mine, LookupError("another line")]
    raised = on_ranks(3, lambda ranks: raise_together(ranks, errors[ranks.rank], kind=RuntimeError))
    assert raised[1] is mine  # the failing rank raises its own error
    assert [type(e) for e in raised] == [RuntimeError, LookupError, RuntimeError]
    assert [str(e) for e in raised] == ["--data: /d1 is missing"] * 3
    assert on_ranks(2, lambda ranks: raise_together(ranks, None)) == [None, None]
    with pytest.raises(LookupError, match="missing"):
        raise_together(_One(), mine)
    raise_together(_One(), None)

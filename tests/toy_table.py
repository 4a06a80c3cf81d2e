"""A second row-sharded table for tests: the sharded-state protocol (docs/sharded-head.md) in 37 rows.

Kept by a hook in the launched elastic runs (tests/distributed/train_with_test_hooks.py) and in the
in-process checkpoint tests (tests/train/engine/test_shared_checkpoint.py).
"""

from __future__ import annotations

import torch

from pksampler.train.modeling.head_replicas import RangeCopy
from pksampler.train.modeling.sharded_head import row_range


class ToyTable:
    """A row-sharded table of ``ROWS`` float64 rows beside the head, owned by a hook (the sharded-state protocol).

    Row i starts at i; each global step adds the step's number to every row, so after step s every row
    holds i + s(s + 1)/2 exactly, whatever world each step ran in, if its state followed every reset.
    """

    ROWS = 37

    def __init__(self, world) -> None:
        self.set_world(world)
        self.load_initial()

    @property
    def num_rows(self) -> int:
        return self.ROWS

    def set_world(self, world) -> None:
        self.lo, self.hi = row_range(self.ROWS, world.size, world.rank)
        self.rows = torch.zeros(self.hi - self.lo, 2, dtype=torch.float64)  # (value, class id)

    def load_initial(self) -> None:
        ids = torch.arange(self.lo, self.hi, dtype=torch.float64)
        self.rows = torch.stack([ids, ids], dim=1)

    def range_state(self, *, copy: bool = True):
        return {"toy": True}, RangeCopy(self.lo, self.hi, (self.rows.clone(),))

    def load_range(self, dense, fill) -> None:
        assert dense == {"toy": True}, dense
        fill(self.rows)

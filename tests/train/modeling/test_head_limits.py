"""The sharded head's limits, refused in one line before anything is allocated or trained: a head larger than the
host's memory, and a softmax scale whose fp64 sum underflows."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pksampler.train.config.load import load_config
from pksampler.train.errors import ConfigError
from pksampler.train.modeling.head_memory import available_host_bytes, check_head_memory, head_memory
from pksampler.train.modeling.sharded_head import ShardedMarginHead


class OneRank:
    """The collectives of a world of one."""

    rank, size = 0, 1

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def test_a_head_larger_than_the_hosts_memory_is_one_line_naming_head_and_c():
    # C = 10^9 used to die in the allocator (a raw traceback), near the limit in a later OOM kill.
    available = available_host_bytes()
    assert available is not None and available > 0
    with pytest.raises(ConfigError, match=r"^head\.name: a sharded head of C=1,000,000,000 classes × "
                                          r"head\.subcentres=1 × model\.embedding_dim=128 needs about \d+\.\d+ GiB on "
                                          r"this host .* but \d+\.\d+ GiB are available") as caught:
        check_head_memory(10**9, 128, 1, world=1)  # planned before the head is built (run_setup)
    assert "\n" not in str(caught.value)
    check_head_memory(1000, 16, 1, world=1)
    small = ShardedMarginHead(1000, 16, OneRank())  # a head that fits is built
    assert small.rows.shape == (1000, 1, 16)
    assert head_memory(10**7, 128, 1, 16)["rows"] == -(-10**7 // 16) * 128 * 4


def test_a_scale_whose_softmax_underflows_is_refused_and_the_bound_trains_finite():
    # head.scale: 2000 gave a loss of -inf at step 1, blamed on optim.lr.
    with pytest.raises(ConfigError, match=r"^head\.scale: must be in \(0, 300\], got 2000"):
        load_config(None, ["head.name=arcface", "head.scale=2000"], environ={})
    with pytest.raises(ValueError, match=r"^head\.scale: must be in \(0, 300\], got 2000"):
        ShardedMarginHead(40, 8, OneRank(), scale=2000.0)
    # at the bound, the worst row (every cosine -1, the logits all at -scale) keeps a finite loss and gradient
    for name in ("arcface", "cosface", "softmax"):
        head = ShardedMarginHead(40, 8, OneRank(), name=name, scale=300.0, negatives=1000, seed=1)
        direction = F.normalize(torch.ones(8), dim=0)
        head.rows.copy_(direction.expand(40, 1, 8))
        embeddings = (-direction).expand(6, 8).clone().requires_grad_(True)
        loss = head(embeddings, torch.arange(6))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(embeddings.grad).all(), name


def test_a_checkpoint_gathers_the_head_to_rank_0_alone_in_blocks(monkeypatch):
    # SparseRowSGD.state_dict all-gathered rows and momentum to every rank, though only rank 0 writes: a 0.95 GiB
    # head took each rank of W = 2 from 1.27 to 3.20 GiB at every checkpoint.
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_sharded_head import C, D, TRACE_SPEC, Member, ThreadGroup, head_steps, run_ranks

    from pksampler.train.modeling import sharded_head
    from pksampler.train.solver.sparse_rows import SparseRowSGD

    row_bytes = D * 4
    monkeypatch.setattr(sharded_head, "GATHER_BLOCK_BYTES", 3 * 5 * row_bytes)  # 5 rows a rank per collective
    tracked: list[int] = []

    class Counting(Member):
        track = False

        def allgather(self, tensor):
            gathered = super().allgather(tensor)
            if self.track:
                tracked.append(gathered.numel() * gathered.element_size())
            return gathered

    def work(group):
        counting = Counting(group.group, group.rank)
        head = ShardedMarginHead(C, D, counting, **TRACE_SPEC, seed=1)
        rows = SparseRowSGD(head, momentum=0.9, weight_decay=0.01)
        head_steps(head, rows, range(3))
        counting.track = True
        saved = head.whole_state()
        counting.track = False
        return saved, head.whole_state(everywhere=True)

    results = run_ranks(3, work)  # 50 classes over 3 ranks: 17, 17, 16 rows
    (root, whole), *others = results
    assert torch.equal(root["rows"], whole["rows"]) and torch.equal(root["momentum"], whole["momentum"])
    assert root["rows"].shape == (C, 1, D)
    assert all(saved["rows"] is None and saved["momentum"] is None for saved, _ in others)
    assert all(torch.equal(whole["rows"], every["rows"]) for _, every in others)
    assert tracked and max(tracked) <= 3 * 5 * row_bytes < C * row_bytes  # a block per collective, never the head


def test_a_host_short_of_memory_for_the_head_stops_every_rank_with_the_same_error():
    # One host short of memory raised on its own rank only; the trainer printed errors from rank 0 alone, so the
    # run showed only "a collective failed because another rank stopped".
    import sys
    import threading

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_sharded_head import ThreadGroup


    need = head_memory(10**6, 128, 1, 3)
    roomy = 100 * (need["checkpoint"] + need["rows"] + need["momentum"] + need["clock"])
    for available in ([roomy, 1, roomy], [roomy, roomy, roomy], [roomy, None, 5]):
        group = ThreadGroup(3)
        errors: list = [None] * 3

        def rank_(rank: int) -> None:
            try:
                check_head_memory(10**6, 128, 1, world=3, available=available[rank], collectives=group.member(rank))
            except ConfigError as error:
                errors[rank] = str(error)

        threads = [threading.Thread(target=rank_, args=(rank,)) for rank in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        short = [rank for rank, free in enumerate(available) if free is not None and free < roomy]
        if not short:
            assert errors == [None] * 3
            continue
        assert errors[0] is not None and errors == [errors[0]] * 3, errors
        assert f"on rank {short[-1]}'s host" in errors[0] and errors[0].startswith("head.name: ")
        assert "\n" not in errors[0]

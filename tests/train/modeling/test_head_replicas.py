"""Horovod elastic's commit of the sharded head: own range + one replica per rank, re-assembled after a reset.

Ranks are threads (:mod:`test_sharded_head`'s ``ThreadGroup``) running the
real handler, planning and block-moving code; tests/distributed/test_elastic.py
runs it under ``horovodrun`` with hosts removed and added.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_sharded_head import C, D, TRACE_SPEC, Member, ThreadGroup, head_steps  # noqa: E402

from pksampler.train.engine.elastic import SharedPartHandler, Shared  # noqa: E402
from pksampler.train.modeling import head_replicas  # noqa: E402
from pksampler.train.modeling import range_checkpoint  # noqa: E402
from pksampler.train.modeling.head_replicas import HeadRowsLost, replica_shift  # noqa: E402
from pksampler.train.modeling.range_checkpoint import located, write_ranges  # noqa: E402
from pksampler.train.modeling.sharded_head import ShardedMarginHead, row_range  # noqa: E402
from pksampler.train.losses.headed import HeadedLoss  # noqa: E402
from pksampler.train.solver.sparse_rows import SparseRowSGD  # noqa: E402
from pksampler.world import World  # noqa: E402


class Rank(Member):
    """A threaded rank with the all-to-all and object broadcast the elastic handler uses."""

    def _objects(self, value):
        self.group.slots[self.rank] = value
        self.group.barrier.wait()
        every = list(self.group.slots)
        self.group.barrier.wait()
        return every

    def alltoall(self, tensor, splits):
        every = self._objects((tensor.detach().clone(), list(splits)))
        parts = []
        for sent, sizes in every:
            offset = sum(sizes[:self.rank])
            parts.append(sent[offset:offset + sizes[self.rank]])
        return torch.cat(parts)

    def broadcast_object(self, value, root=0, *, name=""):
        return self._objects(value)[root]


def run_each(world: int, work) -> list:
    """``work(rank)`` on ``world`` threads; each rank's result or the exception it raised (nothing hangs)."""
    group, results = ThreadGroup(world), [None] * world

    def target(rank: int) -> None:
        try:
            results[rank] = work(Rank(group, rank))
        except BaseException as error:  # noqa: BLE001 - returned to the caller
            results[rank] = error

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a rank hangs"
    return results


def _member(group: Rank, hosts: list[int]):
    """A rank's head, row optimizer and elastic handler (a real HeadedLoss with an empty pair loss)."""
    head = ShardedMarginHead(C, D, group, **TRACE_SPEC, seed=1)
    rows = SparseRowSGD(head, momentum=0.9, weight_decay=0.01)
    loss = HeadedLoss(torch.nn.Identity(), head)
    return head, rows, SharedPartHandler(Shared(loss), collectives=group, host=lambda: hosts[head.collectives.rank])


def test_the_replica_goes_to_another_host():
    assert replica_shift([7]) == 0
    assert replica_shift([0, 0, 0]) == 1  # one host: a neighbour still covers one rank's loss
    assert replica_shift([0, 0, 1, 1]) == 2 and replica_shift([0, 0, 0, 1, 1, 1]) == 3
    assert replica_shift([3, 4, 5, 6]) == 1
    shift = replica_shift([0, 0, 0, 1])  # no shift separates every pair: the most that are
    assert sum(h != [0, 0, 0, 1][(r - shift) % 4] for r, h in enumerate([0, 0, 0, 1])) == 2


def test_a_commit_holds_own_range_and_one_replica_and_resets_train_on_as_one_process(monkeypatch):
    """W = 4 on 2 hosts commits; a host leaves (W = 2, Horovod skips the sync); a host of one joins (W = 3).

    Each rank holds its range and the range of rank (r − 2) mod 4 (the other host), in rows, never C;
    the commits move blocks of 3 rows; the loss trace goes on as one process's."""
    monkeypatch.setattr(head_replicas, "BLOCK_BYTES", 3 * 2 * D * 4)  # 3 rows (and momentum) per all-to-all
    hosts = [0, 0, 1, 1]
    straight = run_each(1, lambda g: head_steps(*_member(g, [0])[:2], range(7)))[0]

    def first(group):
        head, rows, handler = _member(group, hosts)
        handler.sync()  # a fresh start: no copy anywhere, the initial rows
        losses = head_steps(head, rows, range(3))
        handler.save()
        head_steps(head, rows, range(3, 4))  # rolled back by the reset
        return losses, head, rows, handler

    ranks = run_each(4, first)
    for rank, (_, _, _, handler) in enumerate(ranks):
        own, replica = handler.copies
        assert (own.lo, own.hi) == row_range(C, 4, rank)
        assert (replica.lo, replica.hi) == row_range(C, 4, (rank - 2) % 4)  # rank r's replica: the other host
        assert own.tensors[0].shape == own.tensors[1].shape == (own.hi - own.lo, 1, D)  # rows, momentum
        assert replica.tensors[0].shape[0] + own.tensors[0].shape[0] <= 2 * -(-C // 4) < C
    survivors = ranks[:2]  # host 1 left

    def second(group):
        _, head, rows, handler = survivors[group.rank]
        head.collectives = handler.collectives = group  # the backend changes world in place at a reset
        handler.value.part.set_world(World(rank=group.rank, size=group.size))  # the trainer's set_world at a reset
        handler.on_reset()  # the reset callback; the body assembles (no sync: hosts only left)
        handler.ensure_current()
        assert (head.lo, head.hi) == row_range(C, 2, group.rank)
        losses = head_steps(head, rows, range(3, 5))
        handler.save()
        return losses, head, rows, handler

    then = run_each(2, second)
    assert all(not isinstance(r, BaseException) for r in then), then

    def third(group):
        if group.rank == 2:  # a joiner: a fresh head for this world, nothing committed
            head, rows, handler = _member(group, [0, 0, 1])
        else:
            _, head, rows, handler = then[group.rank]
            head.collectives = handler.collectives = group  # the backend changes world in place at a reset
            handler.value.part.set_world(World(rank=group.rank, size=group.size))
            handler.on_reset()
        handler.sync()
        return head_steps(head, rows, range(5, 7))

    last = run_each(3, third)
    assert all(not isinstance(r, BaseException) for r in last), last
    assert last[0] == last[1] == last[2]
    trace = ranks[0][0] + then[0][0] + last[0]
    assert np.allclose(trace, straight, rtol=1e-6, atol=0), (trace, straight)


def test_a_range_held_by_no_rank_raises_on_every_rank():
    """Four hosts of one rank: rank r's replica is on rank r + 1; ranks 1 and 2 leave together, and with them
    both copies of rank 1's range. Both survivors raise the same error, naming the class ids; none waits."""
    hosts = [0, 1, 2, 3]

    def first(group):
        head, rows, handler = _member(group, hosts)
        handler.sync()
        head_steps(head, rows, range(2))
        handler.save()
        return head, handler

    ranks = run_each(4, first)
    survivors = [ranks[0], ranks[3]]

    def second(group):
        head, handler = survivors[group.rank]
        head.collectives = handler.collectives = group  # the backend changes world in place at a reset
        handler.value.part.set_world(World(rank=group.rank, size=group.size))
        handler.on_reset()
        handler.ensure_current()

    errors = run_each(2, second)
    lo, hi = row_range(C, 4, 1)
    assert all(isinstance(e, HeadRowsLost) for e in errors), errors
    assert all(f"class ids [{lo}, {hi})" in str(e) and "last.pt" in str(e) for e in errors)
    assert len({str(e) for e in errors}) == 1


def _resumed_steps(group, resumed) -> list[float]:
    """Steps 2 and 3 on a rank of a resumed job whose rank 0 hands its handler ``resumed(loss)``."""
    head = ShardedMarginHead(C, D, group, **TRACE_SPEC, seed=1)
    rows = SparseRowSGD(head, momentum=0.9, weight_decay=0.01)
    loss = HeadedLoss(torch.nn.Identity(), head)
    handler = SharedPartHandler(Shared(loss, "loss"), collectives=group, host=lambda: group.rank,
                           resumed=resumed(loss) if group.rank == 0 else None)
    handler.sync()
    return head_steps(head, rows, range(2, 4))


def test_a_resumed_rank_0_gives_every_rank_its_range_of_an_older_checkpoints_whole_head():
    straight = run_each(1, lambda g: head_steps(*_member(g, [0])[:2], range(4)))[0]

    def before(group):
        head, rows, _ = _member(group, [0])
        return head_steps(head, rows, range(2)), {"pair": {}, "head": head.whole_state()}

    (losses, saved), = run_each(1, before)
    after = run_each(3, lambda group: _resumed_steps(group, lambda loss: loss.saved_copy(saved)))
    assert np.allclose(losses + after[0], straight, rtol=1e-6, atol=0) and after[0] == after[2]


def test_a_resumed_job_reads_each_ranks_range_from_the_range_files_and_no_rank_the_whole_head(tmp_path,
                                                                                             monkeypatch):
    """Written by 2 ranks, resumed by 3: rank 0 hands out the manifest (``Trainer.resumed_share``), every rank
    opens only the files overlapping its range, and the loss trace goes on as one process's."""
    straight = run_each(1, lambda g: head_steps(*_member(g, [0])[:2], range(4)))[0]
    checkpoint = tmp_path / "last.pt"

    def before(group):
        head, rows, handler = _member(group, [0, 1])
        losses = head_steps(head, rows, range(2))
        dense, own = handler.value.part.range_state(copy=False)
        return losses, {**dense, "ranges": write_ranges(checkpoint, "loss", own, num_rows=C, step=2,
                                                        collectives=group)}

    (losses, saved), _ = run_each(2, before)
    saved, opened, rank = located(saved, checkpoint), [[] for _ in range(3)], threading.local()
    original = range_checkpoint._read_file
    monkeypatch.setattr(range_checkpoint, "_read_file", lambda folder, entry: opened[rank.value].append(
        entry["name"]) or original(folder, entry))

    def resumed(group):
        rank.value = group.rank
        return _resumed_steps(group, lambda loss: saved)

    after = run_each(3, resumed)
    assert np.allclose(losses + after[0], straight, rtol=1e-6, atol=0) and after[0] == after[2]
    assert opened == [["rows-0-25.pt"], ["rows-0-25.pt", "rows-25-50.pt"], ["rows-25-50.pt"]]


def test_the_memory_check_counts_the_committed_copies_under_horovod_elastic():
    from pksampler.train.errors import ConfigError
    from pksampler.train.modeling.head_memory import check_head_memory, head_memory

    need = head_memory(10**6, 128, 1, 4)
    assert need["elastic_commit"] == 8 * need["rows"]  # shares of the range: it shrinks with W, never C
    assert head_memory(10**6, 128, 1, 64)["elastic_commit"] == need["elastic_commit"] // 16
    plain = need["rows"] + need["momentum"] + need["clock"] + need["checkpoint"]
    check_head_memory(10**6, 128, 1, world=4, available=plain)
    with pytest.raises(ConfigError, match=r"rows and momentum and Horovod elastic's committed copies at W=4"):
        check_head_memory(10**6, 128, 1, world=4, available=plain, elastic=True)


def test_alltoall_in_one_process_returns_the_tensor_and_checks_the_splits():
    from pksampler import comm

    rows = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(comm.alltoall(rows, [3]), rows)
    with pytest.raises(ValueError, match=r"alltoall\(splits=\): the splits must add up .* \(3\), got \[2\]"):
        comm.alltoall(rows, [2])

"""The row-sharded margin head: exact against a full softmax, the same at every world size, sparse, resumable.

World sizes are simulated in one process with one thread per rank and a
barrier-backed ``allreduce_sum`` / ``allgather`` (:class:`ThreadGroup`), so a
W = 3 step runs the head's real collectives code; tests/distributed runs it
under horovodrun and torchrun.
"""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from pksampler.train.config.load import load_config
from pksampler.train.errors import ConfigError
from pksampler.train.modeling.sharded_head import ShardedMarginHead, sampled, row_range
from pksampler.train.modeling.bnneck import BNNeck
from pksampler.train.losses.headed import HeadedLoss
from pksampler.train.solver.sparse_rows import SparseRowSGD
from pksampler.world import World

C, D, N = 50, 8, 24


class ThreadGroup:
    """W ranks as threads: collectives meet at a barrier and combine every rank's tensor."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier, self.slots = size, threading.Barrier(size), [None] * size

    def _exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()
        return every

    def member(self, rank: int) -> "Member":
        return Member(self, rank)


class Member:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.group._exchange(self.rank, tensor)).sum(dim=0)

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.group._exchange(self.rank, tensor))

    def allgather_numpy(self, row: np.ndarray) -> np.ndarray:
        return self.allgather(torch.from_numpy(np.ascontiguousarray(row, dtype=np.int64))[None]).numpy()


def run_ranks(world: int, work) -> list:
    """``work(collectives)`` on ``world`` threaded ranks; their results in rank order (an error re-raised)."""
    group, results, errors = ThreadGroup(world), [None] * world, []

    def target(rank: int) -> None:
        try:
            results[rank] = work(group.member(rank))
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            errors.append(error)
            group.barrier.abort()

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (F.normalize(torch.randn(N, D, generator=generator), dim=1),
            torch.randint(0, C, (N,), generator=generator))


def head_step(collectives, spec: dict, embeddings: torch.Tensor, labels: torch.Tensor):
    head = ShardedMarginHead(C, D, collectives, **spec, seed=1)
    leaf = embeddings.clone().requires_grad_(True)
    loss = head(leaf, labels)
    loss.backward()
    return float(loss.detach()), leaf.grad, head


@pytest.mark.parametrize("name", ["softmax", "cosface", "arcface"])
def test_with_every_class_sampled_it_is_the_full_softmax_of_a_linear_head(name):
    spec = dict(name=name, scale=16.0, margin=0.2, negatives=10 * C)
    embeddings, labels = inputs()
    (loss, grad, head), = run_ranks(1, lambda group: head_step(group, spec, embeddings, labels))
    rows_grad = head.pending[1].grad[:, 0]
    # the reference: one nn.Linear holding every class centre, cross-entropy over all classes
    linear = torch.nn.Linear(D, C, bias=False)
    with torch.no_grad():
        linear.weight.copy_(head.rows[:, 0])
    leaf = embeddings.clone().requires_grad_(True)
    weight = F.normalize(linear.weight, dim=1)
    cosine = F.normalize(leaf, dim=1) @ weight.T
    target = cosine.gather(1, labels[:, None]).squeeze(1)
    margin = {"softmax": target, "cosface": target - 0.2,
              "arcface": torch.cos(torch.acos(target.clamp(-1 + 1e-7, 1 - 1e-7)) + 0.2)}[name]
    logits = (16.0 * cosine).scatter(1, labels[:, None], 16.0 * margin[:, None])
    reference = F.cross_entropy(logits, labels)
    reference.backward()
    assert abs(loss - float(reference.detach())) <= 1e-6 * abs(float(reference.detach()))
    # the diagnostic beside it: the same cross-entropy with the target's logit left without the margin
    plain = float(F.cross_entropy(16.0 * cosine.detach(), labels))
    assert abs(float(head.last_softmax_loss) - plain) <= 1e-6 * plain
    assert name == "softmax" or plain < float(reference.detach()) - 0.1  # the margin raises the trained loss
    assert torch.allclose(grad, leaf.grad, rtol=1e-6, atol=1e-7)
    # the rows start small (‖w‖ ≈ 0.03 here), so their gradients are large: fp32 noise scales with them
    assert torch.allclose(rows_grad, linear.weight.grad, rtol=1e-5, atol=1e-6 * float(linear.weight.grad.abs().max()))


def test_the_sampled_negatives_are_the_same_set_at_every_world_size():
    embeddings, labels = inputs()
    spec = dict(negatives=12)
    picked = {}
    for world in (1, 2, 3):
        heads = [ShardedMarginHead(C, D, Member(ThreadGroup(world), rank), **spec) for rank in range(world)]
        for head in heads:
            head.step = 7
        picked[world] = np.concatenate([h.selection(labels).numpy() + h.lo for h in heads])
    assert np.array_equal(picked[1], picked[2]) and np.array_equal(picked[1], picked[3])
    assert set(labels.tolist()) <= set(picked[1].tolist())  # the positives are always in
    others = sampled(np.arange(C), seed=0, step=8, rate=0.24)
    assert not np.array_equal(others, sampled(np.arange(C), seed=0, step=7, rate=0.24))  # another step, another set


def test_loss_and_embedding_gradient_are_the_same_at_one_two_and_three_ranks():
    spec = dict(name="arcface", scale=16.0, margin=0.3, negatives=20, subcentres=2)
    embeddings, labels = inputs(3)
    traces = {world: run_ranks(world, lambda group: head_step(group, spec, embeddings, labels)) for world in (1, 2, 3)}
    loss, grad, head = traces[1][0]
    for world in (2, 3):
        for rank_loss, rank_grad, rank_head in traces[world]:
            assert abs(rank_loss - loss) <= 1e-6 * abs(loss)
            plain = float(head.last_softmax_loss)
            assert abs(float(rank_head.last_softmax_loss) - plain) <= 1e-6 * plain  # every rank, any W
            assert float((rank_grad - grad).norm() / grad.norm()) <= 1e-6  # fp32 sums in another order


TRACE_SPEC = dict(name="cosface", scale=16.0, margin=0.2, negatives=15)


def head_steps(head: ShardedMarginHead, rows: SparseRowSGD, steps: range) -> list[float]:
    """Head-only SGD steps on the inputs of those step numbers; their losses."""
    losses = []
    for step in steps:
        embeddings, labels = inputs(100 + step)
        loss = head(embeddings.clone().requires_grad_(True), labels)
        loss.backward()
        rows.step(lr=0.5)
        losses.append(float(loss.detach()))
    return losses


def train_trace(world: int, steps: range, state: dict | None = None, *, weight_decay: float = 0.01):
    """Losses of a few head-only steps at ``world`` ranks (optionally from a saved state); the state after."""
    def work(group):
        head = ShardedMarginHead(C, D, group, **TRACE_SPEC, seed=1)
        rows = SparseRowSGD(head, momentum=0.9, weight_decay=weight_decay)
        if state is not None:
            head.load_whole(state)
        return head_steps(head, rows, steps), head.whole_state()

    results = run_ranks(world, work)
    return results[0][0], results[0][1]


def test_a_checkpoint_resumes_on_another_world_size_with_the_same_loss_trace():
    straight, _ = train_trace(1, range(8))
    first, saved = train_trace(2, range(4))
    torch.save(saved, "/dev/null")  # plain tensors and numbers
    second, saved = train_trace(3, range(4, 6), saved)
    third, _ = train_trace(1, range(6, 8), saved)
    resumed = first + second + third
    assert np.allclose(resumed, straight, rtol=1e-6, atol=0), (resumed, straight)
    assert len(set(np.round(straight, 4))) > 1  # the head learns: the trace moves


def test_an_elastic_reset_reshards_the_rows_in_place_and_the_trace_goes_on():
    """Horovod elastic, 3 ranks -> 2: the survivors' own head objects take their new ranges from the committed
    whole head (every rank's copy) and train on as one process would."""
    straight, _ = train_trace(1, range(6))

    def before(group):
        head = ShardedMarginHead(C, D, group, **TRACE_SPEC, seed=1)
        rows = SparseRowSGD(head, momentum=0.9, weight_decay=0.01)
        return head_steps(head, rows, range(3)), head, rows, copy.deepcopy(head.whole_state(everywhere=True))

    first = run_ranks(3, before)
    survivors = [first[0], first[2]]  # rank 1's host left; each survivor keeps its own commit

    def after(group):
        _, head, rows, saved = survivors[group.rank]
        head.collectives = group  # the backend's rank and size change in place at a reset
        head.set_world(World(rank=group.rank, size=group.size))
        head.load_whole(saved)
        assert (head.lo, head.hi) == row_range(C, 2, group.rank) and head.momentum.shape == head.rows.shape
        return head_steps(head, rows, range(3, 6))

    then = run_ranks(2, after)
    assert then[0] == then[1]
    assert np.allclose(first[0][0] + then[0], straight, rtol=1e-6, atol=0), (first[0][0] + then[0], straight)


def test_a_reset_before_the_first_step_rebuilds_the_initial_rows_of_the_new_range():
    spec = dict(name="cosface", negatives=15)
    fresh = {rank: ShardedMarginHead(C, D, Member(ThreadGroup(2), rank), **spec, seed=1).rows for rank in range(2)}
    for old_rank in (0, 2):
        head = ShardedMarginHead(C, D, Member(ThreadGroup(3), old_rank), **spec, seed=1)
        rows = SparseRowSGD(head, momentum=0.9)
        head.collectives = Member(ThreadGroup(2), old_rank // 2)
        head.set_world(World(rank=old_rank // 2, size=2))
        head.load_initial()
        assert torch.equal(head.rows, fresh[old_rank // 2]) and head.momentum.shape == head.rows.shape
    rows.step(lr=0.1)  # a step taken (nothing sampled): the initial rows are no longer the state
    with pytest.raises(RuntimeError, match="took 1 steps but has no committed copy"):
        head.load_initial()


def test_a_reset_keeps_the_rows_dtype():
    """A head built in float64 (or any dtype) keeps it through an elastic reset: the new range's rows and momentum
    were float32 whatever the head's, and the assembly's all-to-all then mixed float64 and float32 (Horovod
    refuses that; the elastic float64 test met it)."""
    head = ShardedMarginHead(C, D, Member(ThreadGroup(3), 2), name="cosface", negatives=15, seed=1).double()
    head.collectives = Member(ThreadGroup(2), 1)
    head.set_world(World(rank=1, size=2))
    assert head.rows.dtype == head.momentum.dtype == torch.float64
    assert (head.lo, head.hi) == row_range(C, 2, 1) and head.momentum.shape == head.rows.shape


def test_under_horovod_elastic_the_head_needs_gathered_embeddings_even_from_one_process(monkeypatch):
    """A job started at -np 1 grows later: its rows must then see the global batch."""
    from types import SimpleNamespace

    from pksampler.train.engine.elastic import choose_run_mode

    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    config = load_config(None, ["head.name=arcface", "train.gather_embeddings=false"], environ={})
    backend = SimpleNamespace(name="horovod", size=1, rank=0)
    mode = choose_run_mode(backend, commit_every=config.train.commit_every)
    assert mode.keeps_commits
    with pytest.raises(ConfigError, match="a sharded head needs train.gather_embeddings: true"):
        HeadedLoss.from_config(config, backend, None, num_classes=10, gathered=config.train.gather_embeddings,
                               elastic=mode.keeps_commits)


def test_the_checkpoints_layout_is_kept_so_checkpoints_written_before_load(tmp_path):
    """The head became one module owning its state; the loss's checkpoint keeps the names every earlier
    checkpoint was written with, and such a state (momentum of the weighted rule included) loads."""
    saved, = run_ranks(1, lambda group: HeadedLoss(_CentreDistance(), ShardedMarginHead(C, D, group, seed=1),
                                                   neck=BNNeck(D)).whole_state())
    assert sorted(saved) == ["head", "neck", "pair"] and sorted(saved["pair"]) == ["margin"]
    assert sorted(saved["head"]) == ["dim", "log_decay", "momentum", "momentum_of_own_loss", "num_classes", "rows",
                                     "step", "subcentres"]
    assert sorted(saved["neck"]) == ["norm.bias", "norm.weight"]
    old = {**saved, "head": {k: v for k, v in saved["head"].items() if k != "momentum_of_own_loss"}}
    old["head"]["momentum"] = torch.full((C, 1, D), 0.5)  # written when the rows stepped on weight x their loss
    old["head"]["step"], old["head"]["log_decay"] = 3, torch.tensor([0.0, -0.1, -0.2, -0.3], dtype=torch.float64)
    torch.save(old, tmp_path / "old.pt")

    def load(group):
        loss = HeadedLoss(_CentreDistance(), ShardedMarginHead(C, D, group, seed=1, loss_weight=0.5), neck=BNNeck(D))
        loss.load_state_dict(torch.load(tmp_path / "old.pt", weights_only=True))
        return loss.head

    for rank, head in enumerate(run_ranks(2, load)):
        lo, hi = row_range(C, 2, rank)
        assert torch.equal(head.rows, saved["head"]["rows"][lo:hi]) and head.step == 3 and head.decay.steps == 3
        assert torch.equal(head.momentum, torch.full((hi - lo, 1, D), 1.0))  # divided back by head.weight


def test_state_dict_is_nn_modules_own_this_ranks_state_which_loads_in_its_own_range_only():
    """HeadedLoss inherits ``state_dict``/``load_state_dict``: the pair loss's, the neck's and the head's range
    (its extra state) as flat keys; back into the same range bit for bit, refused in one line in another
    (``whole_state`` and the range files are what any W loads)."""
    assert HeadedLoss.state_dict is torch.nn.Module.state_dict
    assert HeadedLoss.load_state_dict is torch.nn.Module.load_state_dict

    def build(group):
        return HeadedLoss(_CentreDistance(), ShardedMarginHead(C, D, group, seed=1), neck=BNNeck(D))

    def stepped(group):
        loss = build(group)
        head_steps(loss.head, SparseRowSGD(loss.head, momentum=0.9, weight_decay=0.01), range(3))
        with torch.no_grad():
            loss.neck.norm.weight.mul_(2.0)
        return loss.state_dict()

    states = run_ranks(2, stepped)
    assert sorted(states[1]) == ["_extra_state", "head._extra_state", "neck.norm.bias", "neck.norm.weight",
                                 "pair.margin"]
    assert (states[1]["head._extra_state"]["start"], states[1]["head._extra_state"]["stop"]) == row_range(C, 2, 1)

    def load(group):
        loss = build(group)
        loss.load_state_dict(states[group.rank])
        return loss

    for state, loss in zip(states, run_ranks(2, load)):
        extra = state["head._extra_state"]
        assert torch.equal(loss.head.rows, extra["rows"]) and torch.equal(loss.head.momentum, extra["momentum"])
        assert loss.head.step == 3 and torch.equal(loss.head.decay.log, extra["log_decay"])
        assert torch.equal(loss.neck.norm.weight, state["neck.norm.weight"]) and extra["momentum"].abs().sum() > 0
    # every rank of 3 refuses rank 1's state of 2; which rank's error surfaces first is the threads' order
    with pytest.raises(ValueError, match=r"the saved head holds rows 25-50, this rank owns (0-17|17-34|34-50): a "
                                         r"module state loads at its own world size and rank"):
        run_ranks(3, lambda group: build(group).load_state_dict(states[1]))


def test_the_checkpoint_loads_with_weights_only(tmp_path):
    _, saved = train_trace(2, range(2))
    torch.save(saved, tmp_path / "head.pt")
    loaded = torch.load(tmp_path / "head.pt", weights_only=True)
    assert loaded["rows"].shape == (C, 1, D) and loaded["momentum"].shape == (C, 1, D)


def test_only_the_sampled_rows_and_their_momentum_change_and_lazy_decay_is_exact():
    spec = dict(name="softmax", scale=8.0, negatives=5)
    (result,) = run_ranks(1, lambda group: _sparse_steps(group, spec))
    untouched_ok, decayed, eager = result
    assert untouched_ok
    assert torch.allclose(decayed, eager, rtol=1e-6, atol=1e-7)


def _sparse_steps(group, spec):
    head = ShardedMarginHead(C, D, group, **spec, seed=2)
    rows = SparseRowSGD(head, momentum=0.9, weight_decay=0.1)
    eager_rows, eager_momentum = head.rows.clone(), torch.zeros_like(head.rows)
    untouched_ok = True
    for step, lr in enumerate((0.5, 0.3, 0.2, 0.1)):
        embeddings, labels = inputs(step)
        before, momentum_before = head.rows.clone(), head.momentum.clone()
        head(embeddings, labels).backward()
        chosen, grad = head.pending[0], head.pending[1].grad.clone()
        rows.step(lr)
        mask = torch.zeros(C, dtype=torch.bool)
        mask[chosen] = True
        untouched_ok &= bool(torch.equal(head.rows[~mask], before[~mask]))
        untouched_ok &= bool(torch.equal(head.momentum[~mask], momentum_before[~mask]))
        # the eager reference: decoupled decay on every row each step, momentum on the sampled rows
        eager_rows *= 1 - lr * 0.1
        eager_momentum[chosen] = eager_momentum[chosen] * 0.9 + grad
        eager_rows[chosen] -= lr * eager_momentum[chosen]
    head.settle()
    return untouched_ok, head.rows.clone(), eager_rows


def test_per_rank_memory_is_the_rows_share():
    spec = dict(subcentres=2)
    for world in (1, 2, 4):
        heads = [ShardedMarginHead(1003, 16, Member(ThreadGroup(world), rank), **spec) for rank in range(world)]
        assert [h.memory_bytes() for h in heads] == [(row_range(1003, world, r)[1] - row_range(1003, world, r)[0])
                                                     * 2 * 16 * 4 for r in range(world)]
        assert max(h.memory_bytes() for h in heads) == -(-1003 // world) * 2 * 16 * 4
    assert [row_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]


def test_head_config_keys_are_checked():
    config = load_config(None, ["head.name=arcface", "head.negatives=100"], environ={})
    assert config.head.name == "arcface" and config.head.negatives == 100
    assert load_config(None, [], environ={}).head.name is None  # off by default
    with pytest.raises(ConfigError, match=r"head.name: must be one of \['arcface', 'cosface', 'softmax'\], got 'arc'"):
        load_config(None, ["head.name=arc"], environ={})
    with pytest.raises(ConfigError, match=r"head.subcentres: must be an integer in \[1, 16\], got 0"):
        load_config(None, ["head.subcentres=0"], environ={})


# --- BNNeck: the head reads batch-normalised embeddings, the pair loss the embeddings ----------------------------
class _CentreDistance(torch.nn.Module):
    """A pair loss of one learnable number (so the wrapped pair loss has parameters and state of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.margin = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        same = labels[:, None] == labels[None, :]
        distance = torch.cdist(embeddings, embeddings)
        return (distance[same].mean() - distance[~same].mean() + self.margin).relu()


def neck_step(world: int, spec: dict, embeddings: torch.Tensor, labels: torch.Tensor):
    """One trainer-like step per rank: loss × W backward on the gathered batch; loss, embedding and neck gradients."""

    def work(group):
        head = ShardedMarginHead(C, D, group, **spec, seed=1, loss_weight=0.7,
                                 world=World(rank=group.rank, size=world, loss_scale=world))
        loss_fn = HeadedLoss(_CentreDistance(), head, neck=BNNeck(D, grad_divisor=world))
        leaf = embeddings.clone().requires_grad_(True)
        loss = loss_fn(leaf, labels)
        (loss * world).backward()
        neck = loss_fn.neck.norm
        return float(loss.detach()), leaf.grad / world, neck.weight.grad.clone(), neck.bias.grad, loss_fn

    return run_ranks(world, work)


def test_bnneck_the_head_reads_the_normalised_embeddings_and_the_pair_loss_the_embeddings():
    spec = dict(name="arcface", scale=16.0, margin=0.2, negatives=10 * C)
    embeddings, labels = inputs(5)
    (loss, _, _, bias_grad, loss_fn), = neck_step(1, spec, embeddings, labels)
    normalised = (embeddings - embeddings.mean(0)) / torch.sqrt(embeddings.var(0, unbiased=False) + 1e-5)
    head = ShardedMarginHead(C, D, run_ranks(1, lambda group: group)[0], **spec, seed=1)
    with torch.no_grad():
        expected = float(_CentreDistance()(embeddings, labels) + 0.7 * head(normalised, labels))
        without = float(_CentreDistance()(embeddings, labels) + 0.7 * head(embeddings, labels))
    assert abs(loss - expected) <= 1e-6 * abs(expected)
    assert abs(without - expected) > 1e-3  # the neck changes what the head sees
    trained = [p.shape for p in loss_fn.parameters() if p.requires_grad]
    assert bias_grad is None and trained == [(), (D,)]  # bias frozen, scale trained


def test_bnneck_loss_and_gradients_are_the_same_at_one_two_and_three_ranks():
    spec = dict(name="cosface", scale=16.0, margin=0.2, negatives=20, subcentres=2)
    embeddings, labels = inputs(6)
    (loss, grad, neck_grad, _, _), = neck_step(1, spec, embeddings, labels)
    assert float(neck_grad.norm()) > 0
    for world in (2, 3):
        for rank_loss, rank_grad, rank_neck_grad, _, _ in neck_step(world, spec, embeddings, labels):
            assert abs(rank_loss - loss) <= 1e-6 * abs(loss)
            assert float((rank_grad - grad).norm() / grad.norm()) <= 1e-6
            # every rank holds the whole gradient: Horovod's average and torchrun's none leave it as at W = 1
            assert float((rank_neck_grad - neck_grad).norm() / neck_grad.norm()) <= 1e-6


def test_bnneck_state_is_saved_loads_with_weights_only_and_must_match(tmp_path):
    spec = dict(name="softmax", scale=16.0, negatives=20)
    embeddings, labels = inputs(7)

    def save(group):
        (_, _, _, _, loss_fn), = neck_step(1, spec, embeddings, labels)
        with torch.no_grad():
            loss_fn.neck.norm.weight.mul_(3.0)
        return loss_fn.whole_state()

    torch.save(run_ranks(1, save)[0], tmp_path / "loss.pt")
    saved = torch.load(tmp_path / "loss.pt", weights_only=True)

    def load(group, *, neck: bool):
        head = ShardedMarginHead(C, D, group, **spec, seed=1)
        loss_fn = HeadedLoss(_CentreDistance(), head, neck=BNNeck(D) if neck else None)
        loss_fn.load_state_dict(saved)
        return loss_fn

    loaded = run_ranks(3, lambda group: load(group, neck=True))
    assert all(torch.equal(l.neck.norm.weight, torch.full((D,), 3.0)) for l in loaded)
    with pytest.raises(ValueError, match="the checkpoint's head has BNNeck, this run's head.bnneck is False"):
        run_ranks(1, lambda group: load(group, neck=False))


def test_bnneck_config_key_is_checked():
    assert load_config(None, ["head.name=arcface", "head.bnneck=true"], environ={}).head.bnneck is True
    assert load_config(None, [], environ={}).head.bnneck is False
    with pytest.raises(ConfigError, match=r"head.bnneck: expected true or false, got 1"):
        load_config(None, ["head.bnneck=1"], environ={})
    with pytest.raises(ValueError, match="needs at least 2 embeddings, got 1"):
        BNNeck(D)(torch.ones(1, D))


def test_bnneck_training_trace_is_the_same_at_one_two_and_three_ranks():
    """12 steps of pair loss + head through the neck: rows (momentum, lazy decay, a settle at step 6) and the neck's
    scale (torch SGD) trained at W = 1, 2, 3, each rank's loss scaled by W as the trainer does."""
    spec = dict(name="arcface", scale=16.0, margin=0.2, negatives=8, subcentres=2)

    def work(group):
        world = group.size
        head = ShardedMarginHead(C, D, group, **spec, seed=1, world=World(rank=group.rank, size=world,
                                                                          loss_scale=world))
        rows = SparseRowSGD(head, momentum=0.9, weight_decay=0.01)
        loss_fn = HeadedLoss(_CentreDistance(), head, neck=BNNeck(D, grad_divisor=world))
        optimizer = torch.optim.SGD([p for p in loss_fn.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
        trace = []
        for step in range(12):
            embeddings, labels = inputs(200 + step)
            loss = loss_fn(embeddings, labels)
            (loss * world).backward()
            optimizer.step()
            optimizer.zero_grad()
            rows.step(0.5)
            trace.append(float(loss.detach()))
            if step == 5:
                loss_fn.state_dict()  # a checkpoint settles every row's decay
        return np.array(trace), loss_fn.neck.norm.weight.detach().clone()

    (reference, scale), = run_ranks(1, work)
    assert float((scale - 1).abs().max()) > 1e-3  # the neck's scale trains
    for world in (2, 3):
        for trace, rank_scale in run_ranks(world, work):
            assert np.allclose(trace, reference, rtol=1e-6, atol=0), (world, trace, reference)
            # small rows take large steps and the scale moves far from 1 (to 7): fp32 sums in another order leave
            # 1e-5 of it (the losses agree to 1e-6)
            assert torch.allclose(rank_scale, scale, rtol=1e-4, atol=1e-7), float(((rank_scale - scale).abs()
                                                                                   / scale.abs()).max())


# --- loss.weight: the pair loss against the head; 0 trains the head alone ---------------------------------------------
def test_the_pair_weight_mixes_the_losses_and_zero_trains_the_head_alone():
    spec = dict(name="arcface", scale=16.0, margin=0.2, negatives=10 * C)
    embeddings, labels = inputs()

    def step(pair_weight: float):
        def work(group):
            head = ShardedMarginHead(C, D, group, **spec, seed=1, loss_weight=0.7)
            pair = _CentreDistance()
            pair.margin.data.fill_(10.0)  # a pair loss above zero on these inputs
            loss_fn = HeadedLoss(pair, head, pair_weight=pair_weight)
            loss = loss_fn(embeddings.clone().requires_grad_(True), labels)
            loss.backward()
            return (float(loss.detach()), float(loss_fn.last_head_loss), float(pair(embeddings, labels).detach()),
                    pair.margin.grad)

        return run_ranks(1, work)[0]

    total, head, _, grad = step(0.0)
    assert total == pytest.approx(0.7 * head, rel=1e-6) and grad is None  # the pair loss is not even computed
    total, head, pair, grad = step(0.5)
    assert pair > 0 and total == pytest.approx(0.5 * pair + 0.7 * head, rel=1e-6) and grad is not None


def test_the_pair_weight_is_checked(tmp_path):
    from pksampler.train.run_setup import train
    from pksampler.train.runtime.distributed import Backend

    with pytest.raises(ConfigError, match=r"loss.weight: must be a finite number >= 0, got -1"):
        load_config(None, ["loss.weight=-1"], environ={})
    tiny = ["data.args={num_classes: 12, images_per_class: 4, image_size: 16}", "data.image_size=16",
            "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=2", "model.width=8",
            "model.depth=[1]", "model.embedding_dim=8", f"workspace={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"^loss.weight: 0.0 weighs the pair loss against the head's, and there is "
                                          r"no head \(head.name: null\)"):
        train(load_config(None, [*tiny, "loss.weight=0"], environ={}), Backend())
    result = train(load_config(None, [*tiny, "loss.weight=0", "head.name=arcface", "train.max_steps=2"],
                               environ={}), Backend())
    assert result.global_step == 2


def test_the_rows_learn_at_their_own_rate_times_the_schedules_factor():
    spec = dict(name="cosface", scale=16.0, margin=0.2, negatives=10 * C)
    embeddings, labels = inputs()

    def moved(lr: float, factor: float) -> torch.Tensor:
        def work(group):
            head = ShardedMarginHead(C, D, group, **spec, seed=1)
            rows = SparseRowSGD(head, lr=lr, momentum=0.0)
            before = head.rows.clone()
            head(embeddings, labels).backward()
            rows.scheduled_step(factor)
            return head.rows - before

        return run_ranks(1, work)[0]

    one = moved(0.01, 1.0)
    # fp32 cancellation in the differences leaves ~1e-4 relative noise
    assert one.abs().sum() > 0 and torch.allclose(moved(0.03, 1.0), 3 * one, rtol=1e-3, atol=1e-7)
    assert torch.allclose(moved(0.01, 0.5), 0.5 * one, rtol=1e-3, atol=1e-7)
    with pytest.raises(ConfigError, match=r"head.lr: must be a finite number > 0, got 0"):
        load_config(None, ["head.lr=0"], environ={})


@pytest.mark.parametrize("world", [1, 2])
def test_the_margin_free_loss_holds_when_the_margin_raises_a_far_target_above_every_other_logit(world):
    # arcface's cos(θ + m) rises past π: a target opposite its centre (θ = π) gets s·(−cos 1.5), far above the
    # negatives' s·(−0.5) at scale 300; the margin-free sum must not lose them (taken out of the sum, they were)
    rows = torch.tensor([[1.0, 0.0], [0.5, 3 ** 0.5 / 2], [0.5, -(3 ** 0.5) / 2]])
    embeddings, labels = torch.tensor([[-1.0, 0.0]]), torch.tensor([0])

    def work(group):
        head = ShardedMarginHead(3, 2, group, name="arcface", scale=300.0, margin=1.5, negatives=30, seed=1)
        head.rows = rows[head.lo:head.hi, None].clone()
        head(embeddings, labels)
        return float(head.last_softmax_loss)

    plain = float(F.cross_entropy(300.0 * embeddings @ rows.T, labels))  # ≈ 150.7
    for value in run_ranks(world, work):
        assert value == pytest.approx(plain, rel=1e-6)


#: hand edits of a saved head: one momentum row that would broadcast over every row, too few rows, a 2-D decay log
EDITS = {"momentum_broadcasts": lambda rows: {"momentum": torch.ones(1, 1, D)},
         "momentum_short": lambda rows: {"momentum": torch.ones(rows - 1, 1, D)},
         "rows_broadcast": lambda rows: {"rows": torch.ones(1, 1, D)},
         "log_decay_2d": lambda rows: {"log_decay": torch.zeros(1, 1, dtype=torch.float64)}}


@pytest.mark.parametrize("edit", EDITS)
def test_a_hand_edited_checkpoints_head_is_refused_in_one_line_by_both_loaders(edit):
    """A head state whose rows or momentum have not the head's shape (one row that would broadcast over every
    class, or too few rows) or whose decay log is not a 1-D series is refused naming the field, by the checkpoint's
    loader and by the copy a resumed elastic job hands out (:meth:`HeadedLoss.saved_copy`), before any row is
    written."""
    saved, = run_ranks(1, lambda group: HeadedLoss(_CentreDistance(), ShardedMarginHead(C, D, group)).whole_state())
    edited = {**saved, "head": {**saved["head"], **EDITS[edit](C)}}
    field = edit.split("_")[0] if edit != "log_decay_2d" else "log_decay"

    def load(group):
        loss = HeadedLoss(_CentreDistance(), ShardedMarginHead(C, D, group))
        before = loss.head.rows.clone()
        with pytest.raises(ValueError, match=f"the checkpoint's head.*{field}") as refused:
            loss.load_state_dict(edited)
        with pytest.raises(ValueError, match=f"the checkpoint's head.*{field}"):
            loss.saved_copy(edited)
        return str(refused.value), torch.equal(loss.head.rows, before)

    message, untouched = run_ranks(1, load)[0]
    assert "\n" not in message and untouched


@pytest.mark.parametrize("edit", EDITS)
def test_a_hand_edited_module_state_of_the_head_is_refused_in_one_line(edit):
    """nn.Module's layout (``head._extra_state``, this rank's range) edited the same way, at W = 2: refused naming
    the field before any row is written; before, one saved row was broadcast over the whole range without a word
    and a 2-D decay log failed in a shape error after the rows were written."""
    states = run_ranks(2, lambda group: HeadedLoss(_CentreDistance(), ShardedMarginHead(C, D, group)).state_dict())
    field = edit.split("_")[0] if edit != "log_decay_2d" else "log_decay"

    def load(group):
        state = states[group.rank]
        extra = state["head._extra_state"]
        edited = {**state, "head._extra_state": {**extra, **EDITS[edit](extra["stop"] - extra["start"])}}
        loss = HeadedLoss(_CentreDistance(), ShardedMarginHead(C, D, group))
        loss.head.rows.add_(1.0)
        before = loss.head.rows.clone()
        with pytest.raises(ValueError, match=f"^the checkpoint's head has (a )?{field} of shape") as refused:
            loss.load_state_dict(edited)
        return "\n" not in str(refused.value) and torch.equal(loss.head.rows, before)

    assert run_ranks(2, load) == [True, True]


@pytest.mark.parametrize("weight_decay", [10.0, 20.0, -0.1, float("nan"), float("inf"), True])
def test_the_row_optimizer_refuses_a_decay_that_the_lazy_log_cannot_hold(weight_decay):
    """lr·λ >= 1 took log1p(−lr·λ) = −inf or NaN into the decay log: every row read NaN at its next step (the
    config's loader refuses it with the head's numbers; the optimizer built by hand did not)."""
    head, = run_ranks(1, lambda group: ShardedMarginHead(C, D, group))
    with pytest.raises(ValueError, match=r"SparseRowSGD\(weight_decay=\) expects a number >= 0 whose product with "
                                         r"lr=0.1 is below 1, got"):
        SparseRowSGD(head, lr=0.1, weight_decay=weight_decay)
    SparseRowSGD(head, lr=0.1, weight_decay=9.9)  # lr·λ = 0.99: a valid (if fierce) decay

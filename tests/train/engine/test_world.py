"""A change of world is one protocol: a frozen World, set_world on every part that owns a share, a run mode.

In one process: the world is one value the backend holds (rank, size and the
loss scale follow it); :meth:`Trainer.set_world` gives a new one to the
backend, the same sampler object and every shared part, then tells the hooks;
the run mode, chosen once, answers what the application used to branch on.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pksampler.samplers import DistributedBalancedBatchSampler
from pksampler.train.engine.elastic import HorovodElasticMode, SamplerHandler, choose_run_mode
from pksampler.train.engine.mode import RunMode
from pksampler.train.engine.trainer import HookBase, StepParts, Trainer
from pksampler.train.config.load import load_config
from pksampler.train.errors import ConfigError
from pksampler.train.modeling.sharded_head import ShardedMarginHead, row_range
from pksampler.train.runtime.distributed import Backend
from pksampler.train.losses.headed import HeadedLoss
from pksampler.train.modeling.bnneck import BNNeck
from pksampler.world import World

LABELS = np.repeat(np.arange(48), 5)


def _sampler(size: int, rank: int) -> DistributedBalancedBatchSampler:
    return DistributedBalancedBatchSampler(LABELS, samples_per_class=2, classes_per_step=12, num_replicas=size,
                                           rank=rank, seed=3)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rank": 2, "size": 2}, r"World\(rank=\) must be in \[0, 2\) for size=2, got 2"),
    ({"size": 0}, r"World\(size=\) expects a positive int, got 0"),
    ({"local_rank": -1}, r"World\(local_rank=\) expects an int >= 0, got -1"),
    ({"local_size": 0}, r"World\(local_size=\) expects a positive int, got 0"),
    ({"loss_scale": 0.0}, r"World\(loss_scale=\) expects a finite number > 0, got 0.0"),
    ({"loss_scale": True}, r"World\(loss_scale=\) expects a finite number > 0, got True"),
    ({"loss_scale": float("nan")}, r"World\(loss_scale=\) expects a finite number > 0, got nan"),
    ({"loss_scale": -2.0}, r"World\(loss_scale=\) expects a finite number > 0, got -2.0"),
    ({"loss_scale": float("inf")}, r"World\(loss_scale=\) expects a finite number > 0, got inf"),
    ({"loss_scale": "2"}, r"World\(loss_scale=\) expects a finite number > 0, got '2'"),
])
def test_a_bad_world_is_refused_naming_the_argument_the_value_and_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        World(**kwargs)
    with pytest.raises(TypeError, match=r"World\(size=\) expects an int, got True"):
        World(size=True)


def test_numpy_integers_are_taken_as_ints():
    world = World(rank=np.int64(1), size=np.int32(2), local_rank=np.int64(0))
    assert world == World(1, 2, 0) and type(world.rank) is int and type(world.size) is int
    with pytest.raises(TypeError, match=r"World\(rank=\) expects an int, got .*1\.0.*float64"):
        World(rank=np.float64(1.0), size=2)


def test_the_world_is_read_from_the_launcher_and_is_frozen(monkeypatch):
    for names in (("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
                  ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                  ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")):
        for name in names:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    world = World.detect()
    assert world == World(rank=3, size=4, local_rank=1) and not world.is_main and world.local_size == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's ranks per host: the host's memory is shared by them
    assert World.detect() == World(rank=3, size=4, local_rank=1, local_size=2)
    with pytest.raises(AttributeError):
        world.rank = 0  # type: ignore[misc]


def test_the_backend_reads_rank_size_and_loss_scale_from_its_world():
    class Scaling(Backend):
        scales_gathered_loss = True  # Horovod's rule: the gathered loss is multiplied by W

    plain, scaling = Backend("cpu", "fp32"), Scaling("cpu", "fp32")
    for backend in (plain, scaling):
        backend.set_world(World(rank=2, size=3, local_rank=0))
        assert (backend.rank, backend.size, backend.local_rank) == (2, 3, 0)
    assert plain.gathered_loss_scale == 1.0 and scaling.gathered_loss_scale == 3.0
    # the world the backend hands to the shared parts carries its scale (a part divides it out of its gradient)
    assert plain.world.loss_scale == 1.0 and scaling.world == World(rank=2, size=3, loss_scale=3.0)
    with pytest.raises(AttributeError):
        plain.rank = 0  # nothing writes another object's rank
    with pytest.raises(TypeError, match=r"Backend.set_world\(world=\) expects a pksampler.world.World, got tuple"):
        plain.set_world((0, 1))


def test_a_sampler_takes_a_world_as_it_takes_the_two_numbers():
    by_value, by_numbers = _sampler(4, 1), _sampler(4, 1)
    for sampler in (by_value, by_numbers):
        sampler.set_epoch(2)
    by_value.set_world(World(rank=2, size=3))
    by_numbers.set_world(3, 2)
    assert by_value.num_replicas == 3 and [list(b) for b in by_value] == [list(b) for b in by_numbers]


class Share:
    """A part that owns a share of the world (a stand-in for a second sharded table)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def set_world(self, world: World) -> None:
        self.log.append(("share", world))


class Told(HookBase):
    def __init__(self, log: list) -> None:
        self.log = log

    def on_world_change(self) -> None:
        parts = self.trainer.parts
        self.log.append(("hook", parts.backend.size, parts.sampler.num_replicas))


def test_trainer_set_world_moves_every_part_that_owns_a_share_then_tells_the_hooks():
    log: list = []
    backend, sampler = Backend("cpu", "fp32"), _sampler(1, 0)
    parts = StepParts(backend=backend, model=None, train_model=None, optimizer=None, scheduler=None, loss_fn=None,
                      sampler=sampler, train_set=None, epochs=1, global_batch=24, gather=True, shared=(Share(log),))
    trainer = Trainer(parts, [Told(log)])
    assert not parts.gathers  # one rank: nothing to gather
    sampler.set_epoch(1)
    committed = {**sampler.state_dict(batches_consumed=0), "epoch": 1, "step": 2}
    handler = SamplerHandler(sampler, position=lambda: committed)
    world = World(rank=1, size=3)
    trainer.set_world(world)
    handler.on_reset()
    assert log == [("share", world), ("hook", 3, 3)]
    assert parts.sampler is sampler and handler.value is sampler and backend.world == world and parts.gathers
    expected = _sampler(3, 1)
    expected.set_epoch(1)
    expected.load_state_dict(committed)
    assert [list(b) for b in sampler] == [list(b) for b in expected]


def test_the_heads_loss_takes_its_range_in_a_new_world_and_its_initial_rows_before_a_commit():
    classes, dim, spec = 20, 4, {"name": "cosface", "negatives": 8}
    head = ShardedMarginHead(classes, dim, SimpleNamespace(rank=2, size=3), **spec, seed=1)
    loss = HeadedLoss(torch.nn.Identity(), head, neck=BNNeck(dim, grad_divisor=3.0))
    assert head.gradient_scale == 1.0
    loss.set_world(World(rank=1, size=2, loss_scale=2.0))  # the backend's world carries its loss scale
    assert (head.lo, head.hi) == row_range(classes, 2, 1) and not head.rows.any()
    assert head.momentum.shape == head.rows.shape and head.decay.moved_at.shape == (head.hi - head.lo,)
    assert head.gradient_scale == 2.0 and loss.neck.grad_divisor == 2.0  # each part takes it from the world
    loss.load_initial()
    fresh = ShardedMarginHead(classes, dim, SimpleNamespace(rank=1, size=2), **spec, seed=1)
    assert torch.equal(head.rows, fresh.rows)


def test_the_run_mode_is_chosen_once_from_the_launch(monkeypatch):
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    horovod, torch_run = SimpleNamespace(name="horovod", rank=0, size=1), SimpleNamespace(name="torch", rank=0, size=1)
    assert type(choose_run_mode(horovod, commit_every=5)) is HorovodElasticMode
    assert type(choose_run_mode(torch_run, commit_every=5)) is RunMode
    monkeypatch.delenv("HOROVOD_ELASTIC")
    assert type(choose_run_mode(horovod, commit_every=5)) is RunMode


def test_the_static_mode_checks_now_and_the_elastic_mode_in_every_new_world():
    backend = Backend("cpu", "fp32")
    static, elastic = RunMode(backend), HorovodElasticMode(backend, commit_every=5)
    ran: list[str] = []
    static.agree(lambda: ran.append("static"))
    elastic.agree(lambda: ran.append("elastic"))
    assert ran == ["static"]
    error = ConfigError("data.root: missing")
    with pytest.raises(ConfigError, match="data.root"):
        elastic.raise_together(error)  # each rank its own: nothing collective before hvd.elastic.run
    elastic.raise_together(None)
    saved = {"loss": {"head": "rows"}}
    assert static.resume(saved) is saved and elastic.resume(saved) is saved  # one process; elastic: rank 0's
    assert static.is_main() and elastic.is_main()
    backend.set_world(World(rank=1, size=2))
    assert not static.is_main() and not elastic.is_main()  # always asked, never a fixed flag
    assert elastic.keeps_commits and not static.keeps_commits


def test_the_main_rank_hooks_follow_the_mode():
    backend = Backend("cpu", "fp32")
    static, elastic = RunMode(backend), HorovodElasticMode(backend, commit_every=5)
    backend.set_world(World(rank=1, size=2))
    assert static.main_only([HookBase]) == []  # static: other ranks hold none
    (held,) = elastic.main_only([HookBase])  # elastic: held by every rank, built by whichever is rank 0
    assert held.hook is None



@pytest.mark.parametrize("divisor", [0.0, -1.0, float("nan"), float("inf")])
def test_a_neck_refuses_a_gradient_divisor_that_is_not_a_finite_positive_number(divisor):
    """A NaN divisor passed ``<= 0`` and turned the neck's gradient into NaN at the first step."""
    with pytest.raises(ValueError, match=r"BNNeck\(grad_divisor=\) must be a finite number > 0, got"):
        BNNeck(4, grad_divisor=divisor)


def test_a_head_built_without_a_world_takes_the_one_its_backend_carries_with_the_loss_scale():
    """Under Horovod the backend's world scales the gathered loss by W: a head (and its loss's neck) built on that
    backend without a world divided its gradient by 1, W times too large."""
    class Scaling(Backend):
        scales_gathered_loss = True  # Horovod's rule: the gathered loss is multiplied by W

    backend = Scaling("cpu", "fp32")
    backend.set_world(World(rank=1, size=3))
    config = load_config(overrides=["head.name=cosface", "head.bnneck=true", "model.embedding_dim=4"])
    loss = HeadedLoss.from_config(config, backend, torch.nn.Identity(), num_classes=20)
    head = ShardedMarginHead(20, 4, backend)
    assert backend.world.loss_scale == 3.0
    assert head.gradient_scale == loss.head.gradient_scale == loss.neck.grad_divisor == 3.0
    assert (head.lo, head.hi) == row_range(20, 3, 1)
    plain = ShardedMarginHead(20, 4, SimpleNamespace(rank=1, size=3))  # no world carried: its rank and size
    assert plain.gradient_scale == 1.0 and (plain.lo, plain.hi) == (head.lo, head.hi)

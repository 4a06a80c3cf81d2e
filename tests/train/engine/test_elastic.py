"""Horovod elastic state, in one process: the sampler handler re-derives every rank's share for a new world."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pksampler.train.config.load import ConfigError, load_config
from pksampler.train.engine.elastic import SamplerHandler, elastic_launch, rejoin_timeout
from pksampler.train.engine.elastic.handlers import _TrainStateHandler
from pksampler.train.engine.elastic.run import ElasticResetLoop, ResetLoopGuard
from pksampler.train.engine.writers import CommittedJSONWriter, WriterHook
from pksampler.world import World
from pksampler.train.builders import build_sampler
from pksampler.train.engine.events import EventStorage
from pksampler.train.config.schema import SamplerConfig
from pksampler.train.engine.trainer import TrainState
from pksampler.train.runtime.distributed import Backend

LABELS = np.repeat(np.arange(40), 6)
CONFIG = SamplerConfig(classes_per_step=8, samples_per_class=2)


def _sampler(world: int, rank: int):
    return build_sampler(CONFIG, LABELS, world, rank, 3)


def _global_steps(world: int, epoch: int, start: int = 0) -> list[list[int]]:
    """Global steps of ``epoch`` from ``start``: the rank batches of every rank, concatenated and sorted."""
    ranks = []
    for rank in range(world):
        sampler = _sampler(world, rank)
        sampler.set_epoch(epoch)
        sampler.load_state_dict({**sampler.state_dict(), "step": start})
        ranks.append(list(sampler))
    return [sorted(i for batches in step for i in batches) for step in zip(*ranks)]


@pytest.mark.parametrize("old, new", [(4, 2), (2, 4), (4, 1), (1, 8)])
def test_reshard_continues_the_same_global_steps_at_another_world_size(old, new):
    consumed, epoch = 3, 1
    handlers = []
    for rank in range(new):
        sampler = _sampler(old, rank % old)
        sampler.set_epoch(epoch)
        position = {**sampler.state_dict(batches_consumed=0), "step": consumed}
        handler = SamplerHandler(sampler, position=lambda position=position: position)
        sampler.set_world(World(rank=rank, size=new))  # the trainer's set_world at a reset: the same object
        handler.on_reset()
        assert handler.value is sampler
        handlers.append(handler)
    after = [sorted(i for batch in step for i in batch) for step in zip(*(list(h.value) for h in handlers))]
    assert after == _global_steps(1, epoch, consumed)
    assert all(h.value.num_replicas == new for h in handlers)


def test_sampler_handler_restores_the_saved_position():
    sampler = _sampler(2, 0)
    state = {"step": 2}
    handler = SamplerHandler(sampler, position=lambda: {**sampler.state_dict(0), **state})
    state["step"] = 5
    handler.restore()
    assert sampler.state_dict(0)["step"] == 2
    handler.save()
    handler.restore()
    assert sampler.state_dict(0)["step"] == 5


def test_train_state_rolls_back_in_place():
    state = TrainState(global_step=4, consumed=4, final_metrics={"recall_at_1": 0.5})
    handler = _TrainStateHandler(state)
    state.global_step, state.consumed, state.stop = 6, 6, True
    state.final_metrics["recall_at_1"] = 0.7
    handler.restore()
    assert (state.global_step, state.consumed, state.stop, state.final_metrics) == (4, 4, False, {"recall_at_1": 0.5})
    assert handler.value is state


def test_metrics_are_written_once_at_commits_by_the_current_rank_zero(tmp_path):
    path, main = tmp_path / "metrics.jsonl", {"now": True}
    log = CommittedJSONWriter(path, lambda: main["now"])
    hook = WriterHook([log])

    class Loop:
        storage = EventStorage()

    hook.trainer = Loop()
    hook.before_train()
    for step in (1, 2):
        Loop.storage.put_step(global_step=step, loss=0.5)
        hook.after_step()
    Loop.storage.put_record("eval", epoch=1, global_step=2, recall_at_1=0.25)
    hook.flush()  # a commit: the records since the last one, then the lines are final
    log.commit()
    Loop.storage.put_step(global_step=3, loss=0.5)
    hook.after_step()
    Loop.storage.put_record("eval", epoch=2, global_step=3, recall_at_1=0.5)
    hook.on_world_change()  # a reset: step 3 and its epoch's evaluation are rolled back
    hook.before_train()
    main["now"] = False
    Loop.storage.put_step(global_step=3, loss=0.5)
    hook.after_step()
    hook.flush()  # not rank 0: nothing written
    log.commit()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["type"], r["global_step"]) for r in lines] == [("step", 1), ("step", 2), ("eval", 2)]


def test_a_new_rank_0_completes_a_log_its_predecessor_died_writing(tmp_path):
    """The old rank 0 died inside commit 2: step 4's line cut short, and nothing of commit 2 written after it.

    Every rank keeps its last commit's lines; the new rank 0 drops the broken line and appends what is missing.
    """
    path = tmp_path / "metrics.jsonl"
    survivor = CommittedJSONWriter(path, lambda: False)
    hook = WriterHook([survivor])

    class Loop:
        storage = EventStorage()

    hook.trainer = Loop()
    hook.before_train()
    for commit in ((1, 2), (3, 4)):
        for step in commit:
            Loop.storage.put_step(global_step=step, loss=0.5)
            hook.after_step()
        hook.flush()
        survivor.commit()  # not rank 0: writes nothing, keeps the lines
    step = lambda n, img_s: json.dumps({"type": "step", "global_step": n, "loss": 0.5, "img_s": img_s})  # noqa: E731
    path.write_text(f"{step(1, 10.0)}\n{step(2, 11.0)}\n{step(3, 9.0)}\n" + step(4, 9.5)[:17])
    survivor.repair()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["global_step"] for r in lines] == [1, 2, 3, 4]
    assert lines[2]["img_s"] == 9.0  # written lines are kept, not replaced by the survivor's copy
    survivor.repair()  # nothing more to do
    assert len(path.read_text().splitlines()) == 4


def test_elastic_mode_is_read_from_horovodrun_environment(monkeypatch):
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    assert not elastic_launch()
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    assert elastic_launch()


def test_rejoin_timeout_is_five_seconds_under_horovods(monkeypatch):
    monkeypatch.delenv("HOROVOD_ELASTIC_TIMEOUT", raising=False)
    assert rejoin_timeout() == 595
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "30")
    assert rejoin_timeout() == 25
    for bad in ("5", "soon"):
        monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", bad)
        with pytest.raises(ConfigError, match=f"HOROVOD_ELASTIC_TIMEOUT='{bad}'"):
            rejoin_timeout()


def test_commit_every_must_be_positive():
    assert load_config(None, []).train.commit_every == 10
    with pytest.raises(ConfigError, match="train.commit_every"):
        load_config(None, ["train.commit_every=0"])


def test_a_reset_is_not_the_end_of_training_for_the_hooks():
    from types import SimpleNamespace

    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

    from pksampler.train.engine.trainer import HookBase, Trainer

    closed, failure = [], [HostsUpdatedInterrupt(False)]

    class Closing(HookBase):
        def before_epoch(self) -> None:
            raise failure[0]

        def after_train(self) -> None:
            closed.append(True)

    loop = Trainer(SimpleNamespace(epochs=1, shared=()), [Closing()])
    resets = (HorovodInternalError, HostsUpdatedInterrupt)
    with pytest.raises(HostsUpdatedInterrupt):
        loop.train(interrupted_by=resets)  # the loop's way out of a reset
    assert closed == []
    failure[0] = RuntimeError("a real failure")
    with pytest.raises(RuntimeError):
        loop.train(interrupted_by=resets)
    assert closed == [True]


def test_the_saved_position_is_the_loops_not_the_samplers_iterator():
    from types import SimpleNamespace

    from pksampler.train.engine.elastic import loop_position

    sampler = _sampler(2, 1)
    sampler.set_epoch(1)
    next(iter(sampler))  # an interrupted iteration: the sampler ran ahead of the loop
    loop = SimpleNamespace(state=TrainState(epoch=1, consumed=4), parts=SimpleNamespace(sampler=sampler))
    assert (loop_position(loop)["epoch"], loop_position(loop)["step"]) == (1, 4)
    loop.state.epoch, loop.state.consumed = 2, 0  # after an epoch, before the sampler's set_epoch
    rebuilt = _sampler(4, 3)
    rebuilt.load_state_dict(loop_position(loop))
    assert (rebuilt.epoch, rebuilt.state_dict(0)["step"]) == (2, 0)


def test_horovod_elastic_in_the_environment_does_not_make_a_torch_run_elastic(monkeypatch):
    from pksampler.train.engine.elastic import horovod_elastic as _horovod_elastic

    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    backend = Backend("cpu", "fp32")
    backend.name = "torch"
    assert not _horovod_elastic(backend)
    backend.name = "horovod"
    assert _horovod_elastic(backend)


def test_under_horovod_elastic_a_held_step_line_carries_the_heads_numbers(tmp_path):
    from pksampler.train.engine.elastic import HorovodElasticMode
    from pksampler.train.engine.stall import HeadScalarsHook
    from pksampler.train.run_setup import assemble

    tiny = ["data.args={num_classes: 12, images_per_class: 4, image_size: 16}", "data.image_size=16",
            "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=2", "model.width=8",
            "model.depth=[1]", "model.embedding_dim=8", f"workspace={tmp_path / 'run'}", "head.name=arcface",
            "train.max_steps=4", "train.tensorboard=false"]
    backend = Backend()
    run = assemble(load_config(None, tiny, environ={}), backend, mode=HorovodElasticMode(backend, commit_every=1))
    try:
        hooks = run.trainer.hooks
        run.trainer.storage.put_step(epoch=0, step=1, global_step=1, loss=0.5, lr=0.001, images_per_sec=1.0)
        for hook in hooks:  # the step's record in the run's hook order: the writer holds its line when it sees it
            if isinstance(hook, (WriterHook, HeadScalarsHook)):
                hook.after_step()
        (log,) = [w for h in hooks if isinstance(h, WriterHook) for w in h.writers if isinstance(w, CommittedJSONWriter)]
        assert {"head_loss", "head_softmax_loss", "head_margin"} <= json.loads(log.pending[-1]).keys()
    finally:
        run.close()


def test_the_same_collective_failing_three_times_in_the_same_world_and_step_ends_the_job_in_one_line():
    """Horovod resets after every failed collective, silently and forever; a failure that repeats unchanged (ranks
    that disagree on a tensor's dtype: float64 rows sent to float32 receivers did this) cannot be a lost host."""
    guard = ResetLoopGuard()
    mismatch = RuntimeError("Mismatched data types: One rank had type float64, but another rank had type float32.")
    guard.failed(mismatch, step=6, world_size=4)
    guard.failed(mismatch, step=6, world_size=4)
    with pytest.raises(ElasticResetLoop, match=r"failed 3 times in a row at step 6 in a world of 4 ranks each time, "
                       r"so a reset cannot help: Mismatched data types: One rank had type float64"):
        guard.failed(mismatch, step=6, world_size=4)


def test_failures_that_a_reset_can_answer_never_end_the_job():
    guard = ResetLoopGuard()
    lost = RuntimeError("Gloo connection closed by peer")
    for step, size in [(6, 4), (6, 3), (6, 2), (6, 3), (7, 3), (7, 2), (8, 2)]:  # hosts left, joined; steps went on
        guard.failed(lost, step=step, world_size=size)
    guard.failed(RuntimeError("another message"), step=8, world_size=2)
    guard.failed(lost, step=8, world_size=2)  # not three of the same in a row


def test_ranks_lost_again_and_again_at_the_same_step_are_left_to_horovods_driver():
    """Joiners that die in the state sync, each replaced by a spare host of the same size, fail the survivors' sync
    at the committed step in a world of the same size with Horovod's one shut-down message: the driver
    blacklists each and goes on without them, so these never end the job, nor count towards a refused one."""
    from horovod.common.exceptions import HorovodInternalError

    guard = ResetLoopGuard()
    lost = HorovodInternalError(RuntimeError(
        "Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to allreduce, "
        "allgather or broadcast a tensor after one of the ranks finished execution."))
    mismatch = HorovodInternalError(RuntimeError("Mismatched data types: One rank had type float64, but another "
                                                 "rank had type float32."))
    for error in (lost, lost, lost, lost, mismatch, mismatch, lost, mismatch, mismatch):
        guard.failed(error, step=10, world_size=4)
    with pytest.raises(ElasticResetLoop, match="Mismatched data types"):
        guard.failed(mismatch, step=10, world_size=4)


@pytest.mark.parametrize("where", ["sync", "body"])
def test_horovod_elastic_mode_ends_a_refused_collectives_reset_loop_under_horovods_own_run_fn(tmp_path, monkeypatch,
                                                                                              where):
    """The guard as HorovodElasticMode.run wires it, under Horovod's real ``run_fn`` (in one process: the reset
    and the world size stubbed): a collective refused in the state sync (which ``run_fn`` calls after every reset)
    or in the training body ends the run on the third try; a lost rank's failures do not, and training goes on."""
    import horovod.torch as hvd
    from horovod.common.exceptions import HorovodInternalError
    from horovod.torch.elastic import state as hvd_state

    from pksampler.train.engine.elastic import HorovodElasticMode
    from pksampler.train.engine.elastic import run as elastic_run
    from pksampler.train.run_setup import assemble

    monkeypatch.setattr(hvd_state, "_handler_registry", list(hvd_state._handler_registry))
    monkeypatch.setattr(hvd, "size", lambda: 4)
    monkeypatch.setattr(elastic_run, "_rejoin_with_deadline", lambda seconds: None)
    monkeypatch.setattr(hvd_state.TorchState, "check_host_updates", lambda state: None)  # at each commit
    refused = HorovodInternalError(RuntimeError("Mismatched data types: One rank had type float64, but another rank "
                                                "had type float32."))
    lost = HorovodInternalError(RuntimeError("Horovod has been shut down. This was caused by an exception on one of "
                                             "the ranks"))
    tries, errors = [], {"sync": [refused] * 3, "body": [lost] * 4}
    monkeypatch.setattr(hvd_state.TorchState, "sync", lambda state: tries.append("sync") or (
        _raise(errors["sync"].pop(0)) if errors["sync"] else None))
    tiny = ["data.args={num_classes: 12, images_per_class: 4, image_size: 16}", "data.image_size=16",
            "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=2", "model.width=8",
            "model.depth=[1]", "model.embedding_dim=8", f"workspace={tmp_path / 'run'}", "train.max_steps=2",
            "train.tensorboard=false"]
    backend = Backend()
    run = assemble(load_config(None, tiny, environ={}), backend, mode=HorovodElasticMode(backend, commit_every=1))
    train = run.trainer.train

    def failing_train(**kwargs):
        tries.append("body")
        if errors["body"]:
            raise errors["body"].pop(0)
        return train(**kwargs)

    monkeypatch.setattr(run.trainer, "train", failing_train)
    if where == "body":
        errors["sync"], errors["body"] = [], [lost, refused, lost, lost, refused, refused, refused]
    try:
        with pytest.raises(ElasticResetLoop, match=r"failed 3 times in a row at step 0 in a world of 4 ranks each "
                           r"time, so a reset cannot help: Mismatched data types"):
            run.train()
        assert tries == (["sync"] * 3 if where == "sync" else ["sync", "body"] * 7)
        errors["sync"], errors["body"], tries[:] = [], [lost] * 5, []  # a lost rank, again and again: trained on
        state = run.train()
        assert state.global_step == 2 and tries == ["sync", "body"] * 6
    finally:
        run.close()


def _raise(error: BaseException) -> None:
    raise error

"""Each hook alone, registered on a Trainer built from stub parts (detectron2's tests/test_engine.py idea).

The parts: a linear model on 3x4x4 images, a list-based batch sampler that
keeps its position in global steps like the real ones, a tensor dataset and
a one-process backend whose rank, world size and collectives a test sets.
"""

from __future__ import annotations

import copy
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pksampler.world import World
from pksampler.samplers import DistributedBalancedBatchSampler, DistributedTripletBatchSampler
from pksampler.train.runtime.distributed import Backend
from pksampler.train.engine.events import EventStorage
from pksampler.train.engine.hooks import (
    BadImageHook,
    CheckpointHook,
    EvaluationHook,
    FinalArtifactsHook,
    HardNegativeHook,
    HookBase,
    OnMainRank,
)
from pksampler.train.engine.writers import CommittedJSONWriter, JSONWriter, ProgressWriter, TensorBoardEventWriter, WriterHook
from pksampler.train.engine.progress import Progress
from pksampler.train.errors import ConfigError
from pksampler.train.engine.trainer import StepParts, Trainer
from pksampler.train.runtime.workspace import EventLog

CLASSES, PER_CLASS = 4, 6
LABELS = np.repeat(np.arange(CLASSES), PER_CLASS)


class ListSampler:
    """The same fixed batches every epoch; state in global steps, as the library's samplers keep it."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches, self.epoch, self._resume, self._start = batches, 0, 0, 0

    @property
    def batch_size(self) -> int:
        return len(self.batches[0])

    @property
    def num_batches(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._resume = 0
        self.epoch = epoch

    def __iter__(self):
        self._start = self._resume
        return iter(self.batches[self._resume:])

    def __len__(self) -> int:
        return self.num_batches - self._resume

    def state_dict(self, batches_consumed: int = 0) -> dict:
        return {"epoch": self.epoch, "step": self._start + batches_consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._resume, self._start = state["epoch"], state["step"], state["step"]


class Images(torch.utils.data.Dataset):
    """Class-coloured 3x4x4 images with a little noise; records set_epoch."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.labels = LABELS
        self.images = torch.randn(CLASSES, 3, 4, 4, generator=generator)[LABELS] + 0.1 * torch.randn(
            LABELS.size, 3, 4, 4, generator=generator)
        self.epochs: list[int] = []

    def __len__(self) -> int:
        return LABELS.size

    def __getitem__(self, index: int):
        return self.images[index], int(LABELS[index])

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class SquaredDistance(torch.nn.Module):
    """A loss with state of its own (steps seen), like the cross-batch memory."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        same = (labels[:, None] == labels[None, :]).float()
        return ((torch.cdist(embeddings, embeddings) ** 2) * (2 * same - 1)).mean()


class FakeBackend(Backend):
    """One process that plays ``rank`` of ``size``: broadcasts return ``received`` off the root, gathers ``others``."""

    def __init__(self, *, rank: int = 0, size: int = 1, received=None, others: list[np.ndarray] = ()) -> None:
        super().__init__()
        self.set_world(World(rank=rank, size=size))
        self.received, self.others = received, list(others)
        self.broadcasts: list[str] = []

    def broadcast_object(self, value, root=0, *, name="pksampler.broadcast_object"):
        self.broadcasts.append(name)
        return value if self.rank == root else self.received

    def allgather_numpy(self, row: np.ndarray) -> np.ndarray:
        return np.stack([row, *self.others])


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 8))


def make_trainer(hooks=(), *, sampler=None, backend=None, epochs: int = 2, storage=None) -> Trainer:
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = sampler if sampler is not None else ListSampler([[0, 1, 6, 7], [12, 13, 18, 19], [2, 8, 14, 20]])
    parts = StepParts(
        backend=backend or FakeBackend(), model=model, train_model=model, optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), loss_fn=SquaredDistance(),
        sampler=sampler, train_set=Images(), epochs=epochs, global_batch=sampler.batch_size, gather=False,
    )
    return Trainer(parts, list(hooks), storage=storage)


class Recorder(HookBase):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def _note(self, point: str) -> None:
        self.calls.append((point, self.trainer.state.epoch, self.trainer.state.global_step))

    def before_train(self):
        self._note("before_train")

    def before_epoch(self):
        self._note("before_epoch")

    def after_step(self):
        self._note("after_step")

    def after_epoch(self):
        self._note("after_epoch")

    def after_train(self):
        self._note("after_train")


def test_the_loop_calls_hooks_in_order_and_puts_every_step_in_the_storage():
    recorder = Recorder()
    trainer = make_trainer([recorder])
    state = trainer.train()
    assert (state.epoch, state.global_step, state.consumed) == (2, 6, 0)
    assert [c[0] for c in recorder.calls] == ["before_train", "before_epoch", "after_step", "after_step", "after_step",
                                              "after_epoch", "before_epoch", "after_step", "after_step",
                                              "after_step", "after_epoch", "after_train"]
    steps, losses = trainer.storage.series("loss")
    assert steps.tolist() == [1, 2, 3, 4, 5, 6] and np.isfinite(losses).all()
    assert trainer.storage.latest_step["step"] == 3 and trainer.storage.latest_step["epoch"] == 1
    assert trainer.parts.train_set.epochs == [0, 1] and int(trainer.parts.loss_fn.steps) == 6


def test_hooks_run_in_registration_order_and_the_shares_they_own_join_the_shared_parts():
    a, b, c = Recorder(), Recorder(), Recorder()
    table = Table()
    # a hook that keeps a sharded table of its own, built from the trainer it is registered with (its world)
    b.shares = lambda: (table,) if b.trainer.parts is not None else ()
    trainer = make_trainer([a])
    before = tuple(trainer.parts.shared)
    trainer.register([b, c])
    assert trainer.hooks == [a, b, c] and all(hook.trainer is trainer for hook in (a, b, c))
    assert tuple(trainer.parts.shared) == (*before, table)  # Trainer.set_world and Horovod elastic carry it


class Table:
    """The sharded-state protocol's members (docs/sharded-head.md), none of them called here."""

    num_rows = 4

    def set_world(self, world) -> None: ...

    def range_state(self, *, copy=True): ...

    def load_range(self, dense, fill) -> None: ...

    def load_initial(self) -> None: ...


class NoRangeState(Table):
    range_state = None  # not callable: as if the method were missing


@pytest.mark.parametrize("junk, error, rule", [
    ("none", TypeError, r"Recorder\.shares\(\) must return a sequence of parts, got None"),
    ("missing", TypeError, r"NoRangeState.* lacks range_state \(the sharded-state protocol"),
    ("object", TypeError, r"object.* lacks num_rows, set_world, range_state, load_range, load_initial"),
    ("twice", ValueError, r"shares .*Table.* twice"),
    ("loss", ValueError, r"shares .*SquaredDistance.* twice"),
])
def test_a_hook_whose_shares_are_junk_is_refused_at_registration_in_one_line(junk, error, rule):
    """What a hook shares is committed and re-assembled by Horovod elastic's handlers, where a missing method
    would fail mid-commit on every rank: the trainer checks each part at registration, before anything changes,
    and refuses a part shared twice (two handlers would assemble one table)."""
    trainer = make_trainer([Recorder()])
    trainer.parts.shared = (trainer.parts.loss_fn,)  # the head's loss, as the application shares it
    before, hooks = tuple(trainer.parts.shared), list(trainer.hooks)
    table = Table()
    hook = Recorder()
    hook.shares = lambda: {"none": None, "missing": (table, NoRangeState()), "object": (object(),),
                           "twice": (table, table), "loss": (trainer.parts.loss_fn,)}[junk]
    with pytest.raises(error, match=rule) as refused:
        trainer.register([hook])
    assert "\n" not in str(refused.value)
    assert tuple(trainer.parts.shared) == before and trainer.hooks == hooks


def test_a_rank_0_hook_is_built_and_called_only_while_its_process_is_rank_0():
    """Horovod elastic: rank 0 changes hands; the new one builds the hook (a display, an event file) and runs it."""
    main, built = [False], []

    def build() -> Recorder:
        built.append(Recorder())
        return built[-1]

    wrapped = OnMainRank(build, lambda: main[0])
    trainer = make_trainer([wrapped])
    trainer.train()  # 2 epochs of 3 steps, never rank 0
    assert built == []
    main[0] = True
    trainer.state.epoch = 1  # one more epoch, now as rank 0
    trainer.parts.epochs = 2
    trainer.train()
    assert len(built) == 1 and built[0].trainer is trainer
    assert [c[0] for c in built[0].calls] == ["before_train", "before_epoch", "after_step", "after_step", "after_step",
                                              "after_epoch", "after_train"]


def test_metrics_log_writes_each_step_and_each_new_record_but_not_the_replayed_ones(tmp_path):
    storage = EventStorage()
    storage.put_record("eval", epoch=0, global_step=0, recall_at_1=0.1)  # e.g. read back on resume

    class Evaluate(HookBase):
        def after_epoch(self):
            self.trainer.storage.put_record("eval", epoch=self.trainer.state.epoch,
                                            global_step=self.trainer.state.global_step, recall_at_1=0.5)

    log = EventLog(tmp_path / "metrics.jsonl", True)
    trainer = make_trainer([Evaluate(), WriterHook([JSONWriter(log)])], storage=storage)
    trainer.train()
    log.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["type"], r["global_step"]) for r in records] == [
        ("step", 1), ("step", 2), ("step", 3), ("eval", 3), ("step", 4), ("step", 5), ("step", 6), ("eval", 6)]
    assert list(records[0]) == ["type", "epoch", "step", "global_step", "loss", "lr", "images_per_sec",
                                "global_batch", "time"]
    replayed = EventStorage()
    assert replayed.replay(tmp_path / "metrics.jsonl") == 8
    assert replayed.series("loss")[1].tolist() == trainer.storage.series("loss")[1].tolist()


def test_metrics_log_writes_a_record_put_just_before_the_run_stops(tmp_path):
    class RecordThenFail(HookBase):
        def after_epoch(self):
            self.trainer.storage.put_record("bad_images", epoch=1, global_step=3, bad=3, total=12)
            raise ConfigError("data.max_bad_fraction: too many")

    log = EventLog(tmp_path / "metrics.jsonl", True)
    with pytest.raises(ConfigError):
        make_trainer([WriterHook([JSONWriter(log)]), RecordThenFail()]).train()
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["type"] == "bad_images"


def test_progress_shows_the_storage_values():
    stream = io.StringIO()
    progress = Progress(3, 2, interactive=False, every_steps=3, every_seconds=None, stream=stream)
    trainer = make_trainer([WriterHook([ProgressWriter(progress)])])
    trainer.train()
    lines = stream.getvalue().splitlines()
    assert [line.split(" loss ")[0] for line in lines] == ["[pksampler] epoch 1/2 step 3/3", "[pksampler] epoch 2/2 step 3/3"]
    assert f"loss {trainer.storage.latest_step['loss']:.4f}" in lines[-1]


def test_checkpoints_hold_the_trainer_state_plus_metadata_at_every_n_steps_and_epoch_ends():
    written: list[tuple[str, dict]] = []
    # The trainer's state dict shares the live tensors (cheap); a writer serialises it at once, as here.
    hook = CheckpointHook(lambda name, checkpoint: written.append((name, copy.deepcopy(checkpoint))), every=2,
                          max_steps=None,
                          metadata={"format": 2, "config": {"seed": 1}})
    make_trainer([hook]).train()
    assert [(name, c["state"]["global_step"]) for name, c in written] == [
        ("last.pt", 2), ("last.pt", 3), ("last.pt", 4), ("last.pt", 6), ("last.pt", 6)]
    checkpoint = written[1][1]
    assert set(checkpoint) == {"format", "config", "model", "optimizer", "scheduler", "scaler", "loss", "state",
                               "sampler", "world_size"}
    assert "history" not in checkpoint["state"] and checkpoint["state"]["epoch"] == 1
    assert checkpoint["sampler"] == {"epoch": 0, "step": 3} and int(checkpoint["loss"]["steps"]) == 3


def test_checkpoints_stop_at_max_steps_and_only_the_main_rank_writes():
    written: list[str] = []
    trainer = make_trainer([CheckpointHook(lambda name, c: written.append(c["state"]["global_step"]), every=0,
                                           max_steps=4)])
    state = trainer.train()
    assert written == [3, 4] and state.global_step == 4 and state.stop
    quiet: list = []
    make_trainer([CheckpointHook(lambda *a: quiet.append(a), every=1, max_steps=None, is_main=lambda: False)]).train()
    assert quiet == []


def test_evaluation_records_metrics_and_gallery_and_keeps_the_best(tmp_path):
    scores = {2: 0.6, 3: 0.4, 4: 0.7}
    saved: list[tuple[str, int]] = []
    trainer = make_trainer(epochs=4)
    hook = EvaluationHook(lambda epoch: {"recall_at_1": scores[epoch], "map_at_r": scores[epoch] / 2},
                          lambda name: saved.append((name, trainer.state.epoch)), every=2, epochs=3, is_main=lambda: True,
                          gallery=lambda: tmp_path / "gallery.png")
    trainer.register([hook])
    trainer.parts.epochs = 3
    trainer.train()
    evaluations = trainer.storage.records("eval")
    assert [(r["epoch"], r["global_step"], r["recall_at_1"]) for r in evaluations] == [(2, 6, 0.6), (3, 9, 0.4)]
    assert saved == [("best.pt", 2)] and trainer.state.best == 0.6
    assert trainer.state.final_metrics == {"recall_at_1": 0.4, "map_at_r": 0.2}
    assert trainer.storage.images_since(0)[0] == [("eval/gallery", 6, tmp_path / "gallery.png"),
                                                  ("eval/gallery", 9, tmp_path / "gallery.png")]


def test_other_ranks_evaluate_but_record_nothing():
    calls: list[int] = []
    trainer = make_trainer([EvaluationHook(lambda epoch: calls.append(epoch) or {}, lambda name: None, every=1,
                                           epochs=2, is_main=lambda: False)])
    trainer.train()
    assert calls == [1, 2] and trainer.storage.records() == []


def test_the_epoch_checkpoint_is_written_before_evaluation():
    written: list[int] = []

    def failing_evaluation(epoch):
        raise RuntimeError("evaluation crashed")

    trainer = make_trainer([CheckpointHook(lambda name, c: written.append(c["state"]["epoch"]), every=0, max_steps=None),
                            EvaluationHook(failing_evaluation, lambda name: None, every=1, epochs=2, is_main=lambda: True)])
    with pytest.raises(RuntimeError, match="evaluation crashed"):
        trainer.train()
    assert written == [1]  # the finished epoch is saved; a resume starts at epoch 2


class InMemoryCommits:
    """Horovod's ``TorchState`` in one process: ``save`` copies the trainer's state, ``restore`` puts it back."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.trainer.state_dict())

    def restore(self) -> None:
        self.trainer.load_state_dict(copy.deepcopy(self.saved))

    def check_host_updates(self) -> None:
        pass


class WorkerLost(Exception):
    """Stands for Horovod's ``HorovodInternalError``: a worker died, the survivors roll back."""


class LoseAWorkerOnce(HookBase):
    def __init__(self, step: int) -> None:
        self.step, self.done = step, False

    def after_step(self) -> None:
        if not self.done and self.trainer.state.global_step == self.step:
            self.done = True
            raise WorkerLost(f"a worker died after global step {self.step}")


def _logged(path: Path) -> list[tuple[str, int]]:
    lines = path.read_text().splitlines() if path.is_file() else []
    return [(record["type"], record["global_step"]) for record in map(json.loads, lines)]


def _elastic_trainer(path: Path, written: list[tuple[int, list]], hooks=(), **kwargs) -> tuple[Trainer, Any, Any]:
    """A trainer wired as under Horovod elastic (the writer hook first, commits, commit_every=100); ``written``
    gets, per ``last.pt``, its step and the lines metrics.jsonl held when it was handed to the writer."""
    from pksampler.train.engine.elastic import CommitHook, Commits

    commits: list[Commits] = []
    checkpoints = CheckpointHook(lambda name, c: written.append((c["state"]["global_step"], _logged(path))),
                                 every=2, max_steps=kwargs.pop("max_steps", None),
                                 commit=lambda: commits[0].in_memory())
    metrics = CommittedJSONWriter(path, lambda: True)
    writers = WriterHook([metrics])
    trainer = make_trainer([writers, checkpoints, *hooks], **kwargs)
    state = InMemoryCommits(trainer)
    commits.append(Commits(state, writers, metrics))
    trainer.register([CommitHook(commits[0], every=100)])
    return trainer, state, metrics


def test_under_elastic_a_checkpoint_is_taken_at_a_commit_and_a_reset_logs_no_step_twice(tmp_path):
    # commit_every=100, a checkpoint every 2 steps; 3 steps an epoch, 2 epochs. A worker is lost after
    # step 5: the run rolls back to the last commit and trains the steps after it again.
    path, written = tmp_path / "metrics.jsonl", []
    trainer, state, metrics = _elastic_trainer(path, written, [LoseAWorkerOnce(5)])
    while True:  # hvd.elastic.run's loop: a lost worker restores the committed state, the reset callbacks run
        try:
            trainer.train()
            break
        except WorkerLost:
            state.restore()
            metrics.on_world_change()  # the reset callback: the held steps are rolled back
    for step, lines in written:
        assert lines == [("step", s) for s in range(1, step + 1)], (
            f"last.pt of global step {step} was handed to the writer while metrics.jsonl held {lines}: a "
            "checkpoint must never be ahead of the logged steps")
    assert [step for step, _ in written] == [2, 3, 4, 6, 6]
    assert trainer.storage.series("loss")[0].tolist() == [1, 2, 3, 4, 5, 5, 6], \
        "the reset should roll back to the commit of step 4's checkpoint and train step 5 again"
    assert _logged(path) == [("step", s) for s in range(1, 7)]


def test_under_elastic_a_checkpoint_before_the_first_step_writes_no_replayed_record_again(tmp_path):
    # A resumed run at max_steps: the checkpoint in before_train commits; the history read back is not new.
    path, written = tmp_path / "metrics.jsonl", []
    storage = EventStorage()
    storage.put_step(epoch=0, step=1, global_step=1, loss=0.5)
    storage.put_record("eval", epoch=1, global_step=1, recall_at_1=0.25)
    trainer, _, _ = _elastic_trainer(path, written, max_steps=0, storage=storage)
    trainer.train()
    assert written == [(0, [])] and _logged(path) == []


class FakeWriter:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def scalars(self, step, **values):
        self.calls.append(("scalars", step, sorted(values)))

    def metrics(self, step, metrics, *, epoch=None):
        self.calls.append(("metrics", step, metrics, epoch))

    def image(self, tag, step, image):
        self.calls.append(("image", tag, step))

    def flush(self):
        self.calls.append(("flush",))

    def close(self):
        self.calls.append(("close",))


def test_tensorboard_reads_steps_records_and_images_from_the_storage():
    class Evaluate(HookBase):
        def after_epoch(self):
            if self.trainer.state.epoch == 2:
                self.trainer.storage.put_record("eval", epoch=2, global_step=6, recall_at_1=0.5)
                self.trainer.storage.put_image("eval/gallery", 6, Path("g.png"))

    writer = FakeWriter()
    make_trainer([Evaluate(), WriterHook([TensorBoardEventWriter(writer)])]).train()
    assert [c for c in writer.calls if c[0] == "scalars"] == [
        ("scalars", step, ["images_per_sec", "loss", "lr"]) for step in range(1, 7)]
    assert [c for c in writer.calls if c[0] != "scalars"] == [
        ("metrics", 6, {"recall_at_1": 0.5}, 2), ("image", "eval/gallery", 6), ("flush",), ("close",)]


class BadImages(Images):
    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad

    def bad_image_counts(self):
        return self.bad, len(self)


def test_bad_images_are_summed_over_ranks_recorded_and_stop_the_run_past_the_limit():
    backend = FakeBackend(size=2, others=[np.array([1, 24])])
    trainer = make_trainer([BadImageHook(BadImages(1), backend, max_fraction=0.05, is_main=lambda: True)], backend=backend)
    trainer.train()
    assert [(r["epoch"], r["bad"], r["total"]) for r in trainer.storage.records("bad_images")] == [(1, 2, 48), (2, 2, 48)]
    backend = FakeBackend(size=2, others=[np.array([5, 24])])
    with pytest.raises(ConfigError, match=r"data.max_bad_fraction: 5 of 48 images \(10.42%\) could not be decoded in "
                                          r"epoch 1, more than the allowed 5.00%"):
        make_trainer([BadImageHook(BadImages(0), backend, max_fraction=0.05, is_main=lambda: False)], backend=backend).train()


def _triplet_sampler(rank: int) -> DistributedTripletBatchSampler:
    return DistributedTripletBatchSampler(LABELS, 2, num_replicas=2, rank=rank, seed=0, negatives="hard",
                                          hard_classes=1, hard_fraction=1.0)


def _planted(rows: int) -> np.ndarray:
    """Class centroids where 0 and 1 are neighbours, and 2 and 3."""
    centres = np.array([[1.0, 0.0], [0.9, 0.1], [-1.0, 0.0], [-0.9, -0.1]])
    return centres[LABELS][:rows]


def test_hard_negatives_are_mined_on_rank_zero_broadcast_and_handed_to_the_sampler():
    expected = np.array([[1], [0], [3], [2]])
    embedded: list[int] = []

    def embed():
        embedded.append(1)
        return _planted(LABELS.size), LABELS

    backend = FakeBackend(rank=0, size=2)
    sampler = _triplet_sampler(0)
    trainer = make_trainer([HardNegativeHook(embed, sampler, backend, epochs=2)], sampler=sampler, backend=backend)
    trainer.parts.global_batch = 2 * sampler.batch_size
    trainer.train()
    assert len(embedded) == 1  # after epoch 1 only: nothing is mined after the last epoch
    assert backend.broadcasts == ["pksampler.class_neighbours"]
    assert np.array_equal(sampler.neighbours(1), expected) and sampler.neighbours(0) is None
    # Rank 1 mines nothing of its own: it installs what rank 0 sent.
    other = _triplet_sampler(1)
    receiving = FakeBackend(rank=1, size=2, received=expected)
    trainer = make_trainer([HardNegativeHook(lambda: (np.zeros((LABELS.size, 2)), LABELS), other, receiving,
                                             epochs=2)], sampler=other, backend=receiving)
    trainer.train()
    assert np.array_equal(other.neighbours(1), expected)


def test_final_artifacts_draw_the_curves_from_the_storage_and_write_the_final_metrics(tmp_path):
    drawn: list[tuple] = []

    class Evaluate(HookBase):
        def after_epoch(self):
            self.trainer.state.final_metrics = {"recall_at_1": np.float64(0.75)}

    trainer = make_trainer([Evaluate(), FinalArtifactsHook(tmp_path, lambda path, storage: drawn.append(
        (path.name, storage.series("loss")[0].tolist())), epochs=2)])
    trainer.train()
    assert drawn == [("curves.png", [1, 2, 3, 4, 5, 6])]
    assert json.loads((tmp_path / "final_metrics.json").read_text()) == {"recall_at_1": 0.75}


def test_state_dict_resumes_mid_epoch_exactly():
    whole = make_trainer()
    whole.train()
    first = make_trainer([CheckpointHook(lambda *a: None, every=0, max_steps=2)])
    first.train()
    saved = first.state_dict()
    assert saved["sampler"] == {"epoch": 0, "step": 2}
    second = make_trainer()
    second.load_state_dict(saved)
    second.train()
    assert second.state.global_step == 6 and int(second.parts.loss_fn.steps) == 6
    for name, value in whole.parts.model.state_dict().items():
        assert torch.equal(value, second.parts.model.state_dict()[name]), name


def test_state_dict_loads_at_another_world_size():
    # Saved by rank 0 of 2 (P = 1 class each), loaded by one process (P = 2): the position is in global steps.
    labels = LABELS
    two = DistributedBalancedBatchSampler(labels, 1, 2, num_replicas=2, rank=0, seed=5)
    one = DistributedBalancedBatchSampler(labels, 2, 2, num_replicas=1, rank=0, seed=5)
    first = make_trainer([CheckpointHook(lambda *a: None, every=0, max_steps=3)], sampler=two)
    first.train()
    second = make_trainer(sampler=one)
    second.load_state_dict(first.state_dict())
    assert second.state.global_step == 3 and second.state.consumed == 3
    assert one.state_dict(batches_consumed=0)["step"] == 3
    remaining = list(one)
    assert len(remaining) == one.num_batches - 3
    both = [list(DistributedBalancedBatchSampler(labels, 1, 2, num_replicas=2, rank=r, seed=5)) for r in (0, 1)]
    assert remaining == [a + b for a, b in zip(both[0], both[1])][3:]


def test_the_storage_keeps_series_compact_and_records_in_order():
    storage = EventStorage()
    for step in range(1, 4):
        storage.put_step(epoch=0, step=step, global_step=step, loss=1.0 / step, lr=0.1, time=123.0)
    storage.put_record("eval", epoch=1, global_step=3, recall_at_1=0.5)
    assert storage.series("loss")[0].tolist() == [1, 2, 3]
    assert storage.series("time")[0].size == 0 and storage.series("missing")[1].size == 0
    assert math.isclose(storage.series("loss")[1][-1], 1 / 3)
    new, cursor = storage.records_since(0)
    assert [r["type"] for r in new] == ["eval"] and storage.records_since(cursor) == ([], 1)
    with pytest.raises(ValueError, match=r"put_step\(\) needs global_step="):
        storage.put_step(loss=1.0)


def test_a_hook_adds_new_scalars_to_the_step_just_put_and_never_a_second_value_of_one():
    storage = EventStorage()
    with pytest.raises(ValueError, match=r"add_to_step\(head_loss\): no step has been put yet"):
        storage.add_to_step(head_loss=1.0)
    storage.put_step(epoch=0, step=1, global_step=1, loss=2.0)
    storage.add_to_step(head_loss=1.5, note="text")
    assert storage.latest_step["head_loss"] == 1.5 and storage.series("head_loss")[0].tolist() == [1]
    with pytest.raises(ValueError, match=r"add_to_step\(loss\): the step's record has loss already"):
        storage.add_to_step(loss=3.0)
    # one value a step, the record's (a replay of metrics.jsonl reads the record)
    assert storage.series("loss")[1].tolist() == [2.0] and storage.latest_step["loss"] == 2.0


def test_a_main_rank_hook_is_told_of_a_change_of_world_once_built():
    """``OnMainRank`` forwards the world protocol's ``on_world_change`` to the hook it built, and builds none."""
    from pksampler.train.engine.trainer import HookBase

    class Told(HookBase):
        def __init__(self) -> None:
            self.changes = 0

        def on_world_change(self) -> None:
            self.changes += 1

    built: list[Told] = []
    main = [False]
    wrapper = OnMainRank(lambda: built.append(Told()) or built[-1], lambda: main[0])
    wrapper.trainer = None
    wrapper.on_world_change()
    assert built == []
    main[0] = True
    wrapper.before_train()
    main[0] = False
    wrapper.on_world_change()
    assert built[0].changes == 1

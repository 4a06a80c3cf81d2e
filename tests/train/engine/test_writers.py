"""One writer hook over many writers: every writer sees each step and each record once, whatever keys they carry."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from pksampler.train.engine.events import EventStorage
from pksampler.train.engine.trainer import TrainState
from pksampler.train.engine.writers import (CommittedJSONWriter, EventWriter, JSONWriter, OnMainRankWriter,
                                            TensorBoardEventWriter, WriterHook)
from pksampler.train.runtime.workspace import EventLog


class Recording(EventWriter):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def begin_epoch(self, epoch, step):
        self.calls.append(("begin_epoch", epoch, step))

    def write_step(self, record):
        self.calls.append(("step", record["global_step"]))

    def write_records(self, records, images):
        self.calls.append(("records", [r["type"] for r in records], [tag for tag, _, _ in images]))

    def end_epoch(self):
        self.calls.append(("end_epoch",))

    def on_world_change(self):
        self.calls.append(("world",))

    def close(self):
        self.calls.append(("close",))


class Board:
    """TensorBoardWriter's three verbs, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def scalars(self, step, **values):
        self.calls.append(("scalars", step, values))

    def metrics(self, step, metrics, *, epoch=None):
        self.calls.append(("metrics", step, metrics, epoch))

    def image(self, tag, step, image):
        self.calls.append(("image", tag, step))

    def flush(self):
        self.calls.append(("flush",))

    def close(self):
        self.calls.append(("close",))


def _hook(writers, storage: EventStorage | None = None) -> WriterHook:
    hook = WriterHook(writers)
    hook.trainer = SimpleNamespace(storage=storage if storage is not None else EventStorage(), state=TrainState())
    return hook


def _epoch(hook: WriterHook, steps: range, *, record: dict | None = None) -> None:
    """One epoch as the loop drives it: steps put and handed over, then (an evaluation's) record."""
    storage = hook.trainer.storage
    hook.before_epoch()
    for step in steps:
        storage.put_step(epoch=0, step=step, global_step=step, loss=0.5, lr=0.1, images_per_sec=10.0,
                         global_batch=8, time=0.0)
        hook.after_step()
    if record is not None:
        storage.put_record(**record)
        storage.put_image("eval/gallery", steps[-1], Path("g.png"))
    hook.after_epoch()


def test_every_writer_sees_each_step_and_each_new_record_once_and_replayed_records_never():
    storage = EventStorage()
    storage.put_record("eval", epoch=0, global_step=0, recall_at_1=0.1)  # a resumed run's history
    first, second = Recording(), Recording()
    hook = _hook([first, second], storage)
    hook.before_train()
    _epoch(hook, range(1, 3), record=dict(kind="eval", epoch=1, global_step=2, recall_at_1=0.5))
    hook.after_train()
    assert first.calls == second.calls == [
        ("begin_epoch", 0, 0), ("step", 1), ("step", 2), ("records", ["eval"], ["eval/gallery"]), ("end_epoch",),
        ("close",)]


def test_tensorboard_writes_whatever_scalar_keys_the_events_carry():
    board = Board()
    hook = _hook([TensorBoardEventWriter(board)])
    hook.before_train()
    storage = hook.trainer.storage
    storage.put_step(epoch=0, step=1, global_step=1, loss=0.5, global_batch=8, time=1.0, head_collapse=0.25,
                     note="text", finite=True)
    hook.after_step()
    storage.put_record("eval", epoch=1, global_step=1, recall_at_1=0.5, collapse_rank=3.0)
    hook.after_epoch()
    assert board.calls[0] == ("scalars", 1, {"loss": 0.5, "head_collapse": 0.25})  # no positions, text or flags
    assert board.calls[1:] == [("metrics", 1, {"recall_at_1": 0.5, "collapse_rank": 3.0}, 1), ("flush",)]


def test_a_main_rank_writer_is_built_by_the_process_that_is_rank_0_when_it_writes():
    main, built = [False], []

    def build() -> Recording:
        built.append(Recording())
        return built[-1]

    hook = _hook([OnMainRankWriter(build, lambda: main[0])])
    hook.before_train()
    _epoch(hook, range(1, 3))
    assert built == []
    main[0] = True  # rank 0's host left: this process is rank 0 now
    _epoch(hook, range(3, 4))
    hook.after_train()
    assert len(built) == 1 and built[0].calls == [("begin_epoch", 0, 0), ("step", 3), ("end_epoch",), ("close",)]


def test_the_direct_and_the_committed_json_writer_write_the_same_lines(tmp_path):
    direct_log = EventLog(tmp_path / "direct.jsonl", True)
    committed = CommittedJSONWriter(tmp_path / "committed.jsonl", lambda: True)
    hook = _hook([JSONWriter(direct_log), committed])
    hook.before_train()
    _epoch(hook, range(1, 3), record=dict(kind="eval", epoch=1, global_step=2, recall_at_1=0.5))
    assert not (tmp_path / "committed.jsonl").exists()  # held until the commit
    committed.commit()
    direct_log.close()
    read = [[json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
            for name in ("direct.jsonl", "committed.jsonl")]
    assert read[0] == read[1] and [(r["type"], r["global_step"]) for r in read[0]] == [
        ("step", 1), ("step", 2), ("eval", 2)]


def test_a_change_of_world_drops_the_held_lines_of_the_rolled_back_steps(tmp_path):
    committed, seen = CommittedJSONWriter(tmp_path / "metrics.jsonl", lambda: True), Recording()
    hook = _hook([committed, seen])
    hook.before_train()
    _epoch(hook, range(1, 2))
    committed.commit()
    _epoch(hook, range(2, 4))  # steps 2 and 3 were never committed: a reset rolls them back
    hook.on_world_change()
    committed.commit()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["global_step"] for line in lines] == [1]
    assert seen.calls[-1] == ("world",)


def test_the_progress_bar_is_closed_before_the_epoch_hooks_print_their_lines():
    """The writer hook is registered after the evaluation (static runs): the epoch's bar must not be still open
    while the hooks before it print their results (the old progress hook ran first), or a line lands on the bar."""
    import io

    from pksampler.train.engine.hooks import HookBase
    from pksampler.train.engine.progress import Progress
    from pksampler.train.engine.writers import ProgressWriter

    stream = io.StringIO()
    progress = Progress(3, 1, interactive=True, stream=stream)

    class Evaluation(HookBase):
        def after_epoch(self) -> None:
            stream.write("[pksampler] epoch 0: recall_at_1=0.5\n")

    evaluation, writers = Evaluation(), _hook([ProgressWriter(progress)])
    storage = writers.trainer.storage
    for hook in (evaluation, writers):
        hook.before_epoch()
    for step in (1, 2, 3):
        storage.put_step(epoch=0, step=step, global_step=step, loss=0.5, lr=0.1, images_per_sec=10.0,
                         global_batch=8, time=0.0)
        for hook in (evaluation, writers):
            hook.after_step()
    for hook in (evaluation, writers):
        hook.after_epoch()
    text = stream.getvalue()
    assert "3/3" in text.split("[pksampler] epoch 0")[0]  # the bar finished and closed before the line
    assert text.rstrip("\n").endswith("recall_at_1=0.5")  # nothing of the bar drawn after it


def test_a_main_rank_writer_is_told_of_a_change_of_world_once_built():
    """The world protocol reaches a writer held for the main rank: the wrapper forwards ``on_world_change`` to the
    writer it built (whichever rank this process is now), and builds none for it."""
    built: list[Recording] = []

    def build() -> Recording:
        built.append(Recording())
        return built[-1]

    main = [False]
    hook = _hook([OnMainRankWriter(build, lambda: main[0])])
    hook.on_world_change()
    assert built == []  # nothing built for a change of world
    main[0] = True
    _epoch(hook, range(1, 2))
    main[0] = False  # a reset: this process is not rank 0 any more, its writer still hears of it
    hook.on_world_change()
    assert built[0].calls[-1] == ("world",)


def test_the_committed_json_writer_writes_non_finite_numbers_as_the_direct_one(tmp_path):
    """NaN and infinities (a diverging loss, an empty evaluation's mean) are strings in both writers' lines: JSON
    has no such numbers, and a strict reader of the elastic run's metrics.jsonl must parse it too."""
    direct_log = EventLog(tmp_path / "direct.jsonl", True)
    committed = CommittedJSONWriter(tmp_path / "committed.jsonl", lambda: True)
    hook = _hook([JSONWriter(direct_log), committed])
    hook.before_train()
    _epoch(hook, range(1, 2), record=dict(kind="eval", epoch=1, global_step=1, recall_at_1=float("nan"),
                                          map_at_r=float("inf")))
    committed.commit()
    direct_log.close()

    def strict(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    read = [[json.loads(line, parse_constant=strict) for line in (tmp_path / name).read_text().splitlines()]
            for name in ("direct.jsonl", "committed.jsonl")]
    assert read[0] == read[1] and read[1][-1]["recall_at_1"] == "nan" and read[1][-1]["map_at_r"] == "inf"

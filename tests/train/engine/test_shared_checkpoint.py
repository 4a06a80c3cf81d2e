"""A table a hook shares (``HookBase.shares()``, the sharded-state protocol) is checkpointed as the head is: each
rank writes its range beside ``last.pt`` under the hook's class name, and any world size reads it back, each rank
from the files that overlap its range; a resumed Horovod elastic job's rank 0 hands out the files' names, never
the table. Ranks are threads running the real writer, reader and elastic handler."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "modeling"))
from test_head_replicas import run_each  # noqa: E402
from test_hooks import FakeBackend, make_trainer  # noqa: E402
from toy_table import ToyTable  # noqa: E402

from pksampler.train.engine.elastic import SharedPartHandler, Shared  # noqa: E402
from pksampler.train.engine.trainer import HookBase  # noqa: E402
from pksampler.train.modeling import range_checkpoint  # noqa: E402
from pksampler.train.modeling.range_checkpoint import RangeFileError, located, write_ranges  # noqa: E402

STEP = 3
ROWS = ToyTable.ROWS


class KeepTable(HookBase):
    """A hook that keeps a :class:`ToyTable` (built in the trainer's world when it is registered)."""

    table: ToyTable

    def shares(self):
        self.table = ToyTable(self.trainer.parts.backend.world)
        return (self.table,)


def _saved(tmp_path: Path) -> tuple[Path, dict]:
    """Two ranks, two hooks of one class; the first one's table stepped (+100 a row); each rank writes its ranges
    as the checkpoint hook does. Rank 0's checkpoint state, manifests made absolute."""
    checkpoint = tmp_path / "checkpoints" / "last.pt"

    def work(group):
        first, second = KeepTable(), KeepTable()
        trainer = make_trainer([first, second], backend=FakeBackend(rank=group.rank, size=2))
        first.table.rows[:, 0] += 100
        trainer.state.global_step = STEP
        return trainer.state_dict(write_rows=lambda key, rows, own: write_ranges(
            checkpoint, key, own, num_rows=rows, step=STEP, collectives=group))

    state, other = run_each(2, work)
    assert state["shared"] == other["shared"]
    return checkpoint, state


def _check_rows(tables: list[ToyTable], added: int) -> None:
    """Every row once, in order, each its id plus ``added``."""
    rows = torch.cat([table.rows for table in tables])
    ids = torch.arange(ROWS, dtype=torch.float64)
    assert torch.equal(rows[:, 1], ids) and torch.equal(rows[:, 0], ids + added), rows


def _reads(monkeypatch) -> dict[int, list[str]]:
    """The range files each thread-rank opens (its rank set in ``reading.rank``)."""
    opened: dict[int, list[str]] = {}
    original = range_checkpoint._read_file

    def read(folder, entry):
        opened.setdefault(reading.rank, []).append(entry["name"])
        return original(folder, entry)

    monkeypatch.setattr(range_checkpoint, "_read_file", read)
    return opened


reading = threading.local()


def test_a_hooks_table_saved_at_two_ranks_resumes_at_one_and_three_every_row_back(tmp_path, monkeypatch):
    checkpoint, state = _saved(tmp_path)
    assert sorted(state["shared"]) == ["KeepTable", "KeepTable-2"]  # a second hook of a class: its own key
    assert state["shared"]["KeepTable"] == {"toy": True, "ranges": {
        "manifest": "last.shared/KeepTable/step-3/manifest.json", "rows": ROWS}}
    saved, opened = located(state, checkpoint), _reads(monkeypatch)
    for world in (1, 3):
        def load(group):
            reading.rank = group.rank
            trainer = make_trainer([], backend=FakeBackend(rank=group.rank, size=world))
            trainer.load_state_dict(saved)
            first, second = KeepTable(), KeepTable()
            trainer.register([first, second])  # as run_setup: the hooks come after the resume
            trainer.load_saved_shares()
            return first.table, second.table

        opened.clear()
        tables = run_each(world, load)
        _check_rows([first for first, _ in tables], 100)
        _check_rows([second for _, second in tables], 0)
        if world == 3:  # rows [0, 13), [13, 25), [25, 37) from files [0, 19), [19, 37), each table
            assert {rank: sorted(set(names)) for rank, names in opened.items()} == {
                0: ["rows-0-19.pt"], 1: ["rows-0-19.pt", "rows-19-37.pt"], 2: ["rows-19-37.pt"]}


def test_a_hooks_table_of_another_size_is_refused_in_one_line_naming_it(tmp_path):
    checkpoint, state = _saved(tmp_path)
    saved = located(state, checkpoint)
    saved["shared"]["KeepTable"]["ranges"]["rows"] = ROWS - 1
    trainer = make_trainer([], backend=FakeBackend())
    trainer.load_state_dict(saved)
    trainer.register([KeepTable()])
    with pytest.raises(RangeFileError, match=r"KeepTable/step-3/manifest\.json: shared part 'KeepTable' was saved "
                                             r"with 36 rows, this run's has 37: they must match"):
        trainer.load_saved_shares()


def test_a_resumed_horovod_elastic_rank_0_hands_out_the_files_names_and_each_rank_reads_its_range(
        tmp_path, monkeypatch):
    """Only rank 0 read ``last.pt``; the handler's first sync gives every rank of 3 its range of the table."""
    checkpoint, state = _saved(tmp_path)
    saved, opened = located(state, checkpoint), _reads(monkeypatch)

    def resumed(group):
        reading.rank = group.rank
        trainer = make_trainer([], backend=FakeBackend(rank=group.rank, size=3))
        if group.rank == 0:
            trainer.load_state_dict(saved)
        hook = KeepTable()
        trainer.register([hook])
        (key, part), = trainer.shared_parts()
        handed = trainer.resumed_share(key)
        handler = SharedPartHandler(Shared(part, key), collectives=group, host=lambda: group.rank, resumed=handed)
        handler.sync()
        return key, handed, hook.table

    ranks = run_each(3, resumed)
    assert all(not isinstance(rank, BaseException) for rank in ranks), ranks
    key, handed, _ = ranks[0]
    assert key == "KeepTable" and handed == saved["shared"]["KeepTable"]  # names and dense state, no rows
    assert all(other is None for _, other, _ in ranks[1:])
    _check_rows([table for _, _, table in ranks], 100)
    assert {rank: names for rank, names in opened.items()} == {
        0: ["rows-0-19.pt"], 1: ["rows-0-19.pt", "rows-19-37.pt"], 2: ["rows-19-37.pt"]}


class RenamedTable(KeepTable):
    """:class:`KeepTable` under another class name: its table's key is not the one the checkpoint holds."""


def test_a_table_no_hook_claims_after_registering_is_refused_in_one_line_not_lost(tmp_path):
    """A hook renamed (or removed) between save and resume: its saved table has no owner once the hooks are
    registered; before, the renamed hook's table started from its initial rows without a word."""
    checkpoint, state = _saved(tmp_path)
    trainer = make_trainer([], backend=FakeBackend())
    trainer.load_state_dict(located(state, checkpoint))  # no hook yet: nothing is refused
    renamed = RenamedTable()
    trainer.register([KeepTable(), renamed])
    with pytest.raises(ValueError, match=r"^the checkpoint holds the table of shared part\(s\) \['KeepTable-2'\], "
                                         r"which no hook of this run shares \(this run's shared parts: \['KeepTable', "
                                         r"'RenamedTable'\]\): a hook renamed or removed since would lose it"):
        trainer.load_saved_shares()


class FewRows(ToyTable):
    ROWS = 2


class KeepFewRows(HookBase):
    def shares(self):
        self.table = FewRows(self.trainer.parts.backend.world)
        return (self.table,)


def test_a_table_of_fewer_rows_than_ranks_saved_at_three_resumes_at_two_and_five(tmp_path):
    """Ranges of 0 rows: written (an empty file the manifest lists), never read; every row back at W = 2 and 5."""
    checkpoint = tmp_path / "checkpoints" / "last.pt"

    def save(group):
        hook = KeepFewRows()
        trainer = make_trainer([hook], backend=FakeBackend(rank=group.rank, size=3))
        hook.table.rows[:, 0] += 100
        return trainer.state_dict(write_rows=lambda key, rows, own: write_ranges(
            checkpoint, key, own, num_rows=rows, step=STEP, collectives=group))

    saved = located(run_each(3, save)[0], checkpoint)
    files = sorted(path.name for path in checkpoint.with_suffix(".shared").glob("KeepFewRows/step-3/*"))
    assert files == ["manifest.json", "rows-0-1.pt", "rows-1-2.pt", "rows-2-2.pt"]
    for world in (2, 5):
        def load(group):
            trainer = make_trainer([], backend=FakeBackend(rank=group.rank, size=world))
            trainer.load_state_dict(saved)
            hook = KeepFewRows()
            trainer.register([hook])
            trainer.load_saved_shares()
            return hook.table.rows

        rows = torch.cat(run_each(world, load))
        assert torch.equal(rows, torch.tensor([[100.0, 0.0], [101.0, 1.0]], dtype=torch.float64)), (world, rows)


def test_a_range_file_lost_before_a_resumed_horovod_elastic_job_fails_every_rank_in_one_line(tmp_path):
    """Rank 0 hands out the files' names; rows-19-37.pt is gone, which ranks 1 and 2 of 3 read: every rank raises
    the same line naming it (before, rank 0 went on alone into the job's next collective)."""
    checkpoint, state = _saved(tmp_path)
    (checkpoint.with_suffix(".shared") / "KeepTable" / f"step-{STEP}" / "rows-19-37.pt").unlink()
    saved = located(state, checkpoint)

    def resumed(group):
        trainer = make_trainer([], backend=FakeBackend(rank=group.rank, size=3))
        if group.rank == 0:
            trainer.load_state_dict(saved)
        trainer.register([KeepTable()])
        (key, part), = trainer.shared_parts()
        SharedPartHandler(Shared(part, key), collectives=group, host=lambda: group.rank,
                     resumed=trainer.resumed_share(key)).sync()

    errors = run_each(3, resumed)
    assert all(isinstance(error, RangeFileError) for error in errors), errors
    assert {str(error) for error in errors} == {
        f"checkpoint rows file {checkpoint.with_suffix('.shared')}/KeepTable/step-{STEP}/rows-19-37.pt is missing "
        "(its manifest lists rows 19-37)"}


def _headed_trainer(group, world: int):
    """A trainer whose loss is a sharded head's (shared, as the application shares it) at ``world`` ranks."""
    from test_sharded_head import C, D, _CentreDistance

    from pksampler.train.losses.headed import HeadedLoss
    from pksampler.train.modeling.sharded_head import ShardedMarginHead

    trainer = make_trainer([], backend=FakeBackend(rank=group.rank, size=world))
    loss = HeadedLoss(_CentreDistance(), ShardedMarginHead(C, D, group, seed=1))
    trainer.parts.loss_fn, trainer.parts.shared = loss, (loss,)
    return trainer, loss


def test_a_checkpoint_written_without_range_files_holds_the_whole_head_and_loads_at_another_world_size():
    """``CheckpointHook(folder=None)``: no range files, so the head goes inside the checkpoint whole, as its
    docstring says; it held nn.Module's state of rank 0's range alone (the other ranks' rows lost, and no other
    world size could load it)."""
    def save(group):
        trainer, loss = _headed_trainer(group, 2)
        with torch.no_grad():
            loss.head.rows.add_(float(group.rank + 1))
        return trainer.state_dict(), loss.whole_state(everywhere=True)["head"]["rows"]

    (state, rows), _ = run_each(2, save)
    assert torch.equal(state["loss"]["head"]["rows"], rows)

    def load(group):
        trainer, loss = _headed_trainer(group, 3)
        trainer.load_state_dict(state)
        return loss.head.rows

    assert torch.equal(torch.cat(run_each(3, load)), rows)

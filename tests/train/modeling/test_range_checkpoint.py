"""Rank-range checkpoints of the sharded head: written by each rank at one world size, loaded at any other, each
rank reading only the files that overlap its range; a missing or damaged file fails every rank in one line."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_sharded_head import C, D, TRACE_SPEC, _CentreDistance, head_steps, run_ranks  # noqa: E402

from pksampler.agree import raise_together  # noqa: E402
from pksampler.train.losses.headed import HeadedLoss, saved_rows, whole_loss_state  # noqa: E402
from pksampler.train.modeling import range_checkpoint  # noqa: E402
from pksampler.train.modeling.head_replicas import RangeCopy  # noqa: E402
from pksampler.train.modeling.range_checkpoint import RangeFileError, located, write_ranges  # noqa: E402
from pksampler.train.modeling.sharded_head import ShardedMarginHead, row_range  # noqa: E402
from pksampler.train.solver.sparse_rows import SparseRowSGD  # noqa: E402

STEP = 4


def _loss(group) -> HeadedLoss:
    return HeadedLoss(_CentreDistance(), ShardedMarginHead(C, D, group, **TRACE_SPEC, seed=1))


def _write(checkpoint, world: int) -> list[dict]:
    """``world`` ranks step the head, then write their ranges beside ``checkpoint`` as the trainer does; each
    rank's (checkpoint state of the loss, the whole head gathered for comparison)."""
    def work(group):
        loss = _loss(group)
        head_steps(loss.head, SparseRowSGD(loss.head, momentum=0.9, weight_decay=0.01), range(STEP))
        dense, own = loss.range_state()
        reference = write_ranges(checkpoint, "loss", own, num_rows=loss.num_rows, step=STEP, collectives=group)
        return {**dense, "ranges": reference}, loss.whole_state(everywhere=True)["head"]

    return run_ranks(world, work)


def test_ranges_written_at_two_ranks_load_at_one_and_three_reading_only_their_files(tmp_path, monkeypatch):
    checkpoint = tmp_path / "checkpoints" / "last.pt"
    (state, whole), (other, _) = _write(checkpoint, 2)
    assert state["ranges"] == other["ranges"] == {"manifest": "last.shared/loss/step-4/manifest.json", "rows": C}
    assert "rows" not in state["head"] and whole["momentum"].abs().sum() > 0  # the rows moved and stayed apart
    folder = checkpoint.with_suffix(".shared") / "loss" / f"step-{STEP}"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [(f["name"], f["start"], f["stop"]) for f in manifest["files"]] == [("rows-0-25.pt", 0, 25),
                                                                               ("rows-25-50.pt", 25, 50)]
    assert manifest["rows"] == C and manifest["step"] == STEP
    saved = located(state, checkpoint)
    read = []  # which files each load opened
    original = range_checkpoint._read_file
    monkeypatch.setattr(range_checkpoint, "_read_file", lambda folder, entry: read.append(entry["name"]) or
                        original(folder, entry))
    for world in (1, 3):
        def load(group):
            loss = _loss(group)
            loss.load_state_dict(saved)
            return loss.head

        read.clear()
        for rank, head in enumerate(run_ranks(world, load)):
            lo, hi = row_range(C, world, rank)
            assert torch.equal(head.rows, whole["rows"][lo:hi]) and torch.equal(head.momentum, whole["momentum"][lo:hi])
            assert head.step == STEP and head.decay.steps == STEP
        # rank 0 of 3 (rows 0-17) and rank 2 (34-50) each read one file, rank 1 (17-34) both
        assert sorted(read) == (["rows-0-25.pt", "rows-25-50.pt"] if world == 1 else
                                ["rows-0-25.pt", "rows-0-25.pt", "rows-25-50.pt", "rows-25-50.pt"])
    assert torch.equal(saved_rows(saved, [3, 40, 3]), whole["rows"][[3, 40, 3]])
    assert torch.equal(whole_loss_state(saved)["head"]["rows"], whole["rows"])


def _damage_message(tmp_path, damage) -> list:
    checkpoint = tmp_path / "last.pt"
    (state, _), _ = _write(checkpoint, 2)
    damage(checkpoint.with_suffix(".shared") / "loss" / f"step-{STEP}")
    saved = located(state, checkpoint)

    def load(group):
        loss = _loss(group)
        error = None
        try:
            loss.load_state_dict(saved)
        except RangeFileError as caught:
            error = caught
        raise_together(group, error, kind=RangeFileError)

    return run_ranks_errors(3, load)


def run_ranks_errors(world: int, work) -> list:
    """Each rank's exception (None where it returned)."""
    def each(group):
        try:
            work(group)
        except Exception as error:  # noqa: BLE001 - compared by the test
            return error
        return None

    return run_ranks(world, each)


@pytest.mark.parametrize("damage, message", [
    (lambda folder: (folder / "rows-25-50.pt").unlink(), r"rows-25-50\.pt is missing"),
    (lambda folder: (folder / "rows-0-25.pt").write_bytes(b"not a checkpoint"), r"rows-0-25\.pt holds \d+ bytes"),
    (lambda folder: (folder / "manifest.json").unlink(), r"manifest .*manifest\.json is missing"),
])
def test_a_missing_or_damaged_range_file_fails_every_rank_in_one_line_naming_it(tmp_path, damage, message):
    errors = _damage_message(tmp_path, damage)
    assert all(isinstance(error, RangeFileError) for error in errors), errors
    assert len({str(error) for error in errors}) == 1 and "\n" not in str(errors[0])
    assert str(tmp_path) in str(errors[0])
    assert re.search(message, str(errors[0])), str(errors[0])


def test_a_range_file_from_another_checkpoint_of_the_same_size_is_refused(tmp_path):
    """Same rows, same bytes, other values: the digest tells them apart."""
    (state, _), _ = _write(tmp_path / "a" / "last.pt", 2)
    _write(tmp_path / "b" / "last.pt", 2)  # the same run: identical files, so damage b's values in place
    folder = lambda root: root / "last.shared" / "loss" / f"step-{STEP}"  # noqa: E731
    stored = torch.load(folder(tmp_path / "b") / "rows-0-25.pt", weights_only=True)
    stored["tensors"][0][0, 0, 0] += 1.0
    with open(folder(tmp_path / "a") / "rows-0-25.pt", "wb") as stream:  # as the writer saves: to a stream
        torch.save(stored, stream)
    with pytest.raises(RangeFileError, match=r"rows-0-25\.pt does not match its manifest"):
        saved_rows(located(state, tmp_path / "a" / "last.pt"), [0])


def test_older_step_folders_are_dropped_once_a_newer_checkpoint_is_durable(tmp_path):
    checkpoint = tmp_path / "last.pt"
    for step in (2, 4, 6):
        (checkpoint.with_suffix(".shared") / "loss" / f"step-{step}").mkdir(parents=True)
    range_checkpoint.drop_older(checkpoint, 4)
    assert sorted(p.name for p in (checkpoint.with_suffix(".shared") / "loss").iterdir()) == ["step-4", "step-6"]


def test_a_rank_that_cannot_write_its_range_fails_every_rank_naming_its_file_and_no_manifest_is_written(
        tmp_path, monkeypatch):
    original = range_checkpoint._write_own

    def full_disk_on_rank_1(folder, own):
        if own.lo:
            raise OSError(28, "No space left on device")
        return original(folder, own)

    monkeypatch.setattr(range_checkpoint, "_write_own", full_disk_on_rank_1)

    def work(group):
        lo, hi = row_range(C, 2, group.rank)
        own = RangeCopy(lo, hi, (torch.zeros(hi - lo, 1, D),))
        write_ranges(tmp_path / "last.pt", "loss", own, num_rows=C, step=1, collectives=group)

    errors = run_ranks_errors(2, work)
    assert all(isinstance(error, OSError) for error in errors), errors
    assert str(errors[0]) == str(errors[1]) and re.search(r"step-1/rows-25-50\.pt could not be written: .*No space",
                                                          str(errors[0]))
    assert not (tmp_path / "last.shared" / "loss" / "step-1" / "manifest.json").exists()


def test_the_whole_table_is_read_in_the_dtype_it_was_saved_in(tmp_path):
    """A float64 table's whole copy (an export's, a test's) stays float64: it was read into float32 tensors."""
    checkpoint = tmp_path / "last.pt"

    def work(group):
        lo, hi = row_range(C, group.size, group.rank)
        rows = torch.arange(lo, hi, dtype=torch.float64)[:, None] / 3
        return write_ranges(checkpoint, "table", RangeCopy(lo, hi, (rows, -rows)), num_rows=C, step=1,
                            collectives=group)

    reference, _ = run_ranks(2, work)
    whole = range_checkpoint.whole_copy(checkpoint.parent / reference["manifest"])
    assert [t.dtype for t in whole.tensors] == [torch.float64, torch.float64] and (whole.lo, whole.hi) == (0, C)
    assert torch.equal(whole.tensors[0][:, 0], torch.arange(C, dtype=torch.float64) / 3)
    assert torch.equal(whole.tensors[1], -whole.tensors[0])


@pytest.mark.parametrize(("late", "found"), [
    ((torch.float32, (4,)), r"\('float32', \(4,\)\)\], the first file \[\('float64', \(4,\)\)\]"),  # was cast
    ((torch.float64, (1,)), r"\('float64', \(1,\)\)\], the first file \[\('float64', \(4,\)\)\]"),  # broadcast
])
def test_a_whole_copy_refuses_range_files_that_disagree_in_dtype_or_row_shape(tmp_path, late, found):
    """Each file matches its manifest, but the second rank's rows differ from the first's in dtype (a float64
    table's range rebuilt in float32 by an elastic reset, as before the reset kept the rows' dtype) or in row
    shape: copied into the first file's tensors they were cast or broadcast without a word."""
    checkpoint = tmp_path / "last.pt"

    def work(group):
        lo, hi = row_range(C, group.size, group.rank)
        dtype, shape = (torch.float64, (4,)) if group.rank == 0 else late
        rows = torch.arange(lo, hi, dtype=dtype).reshape(hi - lo, *[1] * len(shape)).expand(hi - lo, *shape) / 3
        return write_ranges(checkpoint, "table", RangeCopy(lo, hi, (rows.contiguous(),)), num_rows=C, step=1,
                            collectives=group)

    reference, _ = run_ranks(2, work)
    with pytest.raises(RangeFileError, match=r"rows file .*step-1/rows-\d+-\d+\.pt holds tensors of \(dtype, row "
                       r"shape\) \[" + found + r": every range file of a table must hold the same"):
        range_checkpoint.whole_copy(checkpoint.parent / reference["manifest"])

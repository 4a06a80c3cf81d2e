"""train.init_from in one process: classes matched by name, new rows imprinted (the same at every W), the start
line, the image-level evaluation split into known and new classes, and the refusals."""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from pksampler.train.config.load import ConfigError, load_config
from pksampler.train.engine.checkpoint import load_checkpoint, save_checkpoint
from pksampler.train.engine.continuation import IMPRINT_BLOCK, imprint_rows, match_classes, neck_statistics
from pksampler.train.losses.headed import saved_rows, whole_loss_state
from pksampler.train.modeling.range_checkpoint import located
from pksampler.train.modeling.sharded_head import ShardedMarginHead
from pksampler.train.run_setup import assemble, train
from pksampler.train.runtime.distributed import Backend
from tiny_runs import TINY, grown_folders

HEADED = [*TINY, "head.name=arcface", "data.name=folder", "data.args={}", "data.split_by=name", "data.heldout_images=1",
          "train.checkpoint_every=0"]


class Ranks:
    """What the head needs of the collectives, for one rank of ``size`` simulated in one process."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def folders(tmp_path: Path) -> tuple[Path, Path]:
    return grown_folders(tmp_path)


def config(tmp_path: Path, root: Path, name: str, *extra: str):
    return load_config(None, [*HEADED, f"data.root={root}", f"workspace={tmp_path / name}", *extra], environ={})


def test_classes_match_by_name_not_by_code():
    match = match_classes(["b", "a", "gone", "c"], ["a", "new", "c", "b"])
    assert match.saved_of.tolist() == [1, -1, 3, 0]
    assert (match.kept, match.added, match.dropped) == (3, 1, 1)
    assert match_classes([], ["a"]).saved_of.tolist() == [-1]


@pytest.mark.parametrize("subcentres", [1, 2])
def test_imprinted_rows_are_the_same_at_every_world_size(subcentres):
    classes, dim = 11, 6
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(60, dim, generator=generator)
    labels = np.random.default_rng(0).integers(0, classes, 60)
    labels[labels == 4] = 5  # class 4 has no training image: it keeps its initial row
    new = np.array([1, 4, 6, 7, 10])

    def rows_at(world: int) -> torch.Tensor:
        parts = []
        for rank in range(world):
            head = ShardedMarginHead(classes, dim, Ranks(rank, world), subcentres=subcentres, scale=10.0)
            initial = head.rows.clone()
            local = torch.from_numpy(new[(new >= head.lo) & (new < head.hi)] - head.lo)
            seen = []
            done = imprint_rows(head, lambda block: seen.append(block.size) or features[block], labels, local,
                                length=0.5)
            assert max(seen, default=0) <= 1024 and done[1] == int(np.isin(labels, head.lo + local.numpy()).sum())
            untouched = np.setdiff1d(np.arange(head.hi - head.lo), local.numpy()[local.numpy() + head.lo != 4])
            assert torch.equal(head.rows[untouched], initial[untouched])
            parts.append(head.rows)
        return torch.cat(parts)

    one = rows_at(1)
    for world in (2, 3, 5):
        assert torch.allclose(rows_at(world), one, atol=1e-6, rtol=0)
    for c in (1, 6, 7, 10):  # length 0.5 along the normalised mean of the normalised features
        mean = F.normalize(F.normalize(features[torch.from_numpy(labels == c)], dim=1).mean(dim=0), dim=0)
        for k in range(subcentres):
            assert torch.allclose(one[c, k], 0.5 * mean, atol=1e-6)


def test_a_continued_run_keeps_rows_by_name_imprints_new_ones_and_says_so(tmp_path, capsys):
    week1, week2 = folders(tmp_path)
    train(config(tmp_path, week1, "w1"), Backend())
    path = tmp_path / "w1" / "checkpoints" / "last.pt"
    saved = located(load_checkpoint(path), path)
    names = saved["classes"]["names"]
    assert names == [f"product_{c:05d}" for c in range(24)]
    capsys.readouterr()
    run = assemble(config(tmp_path, week2, "w2", f"train.init_from={tmp_path / 'w1' / 'checkpoints' / 'last.pt'}"),
                   Backend())
    try:
        line = [text for text in capsys.readouterr().out.splitlines() if "init_from" in text]
        assert len(line) == 1 and "classes kept 22, added 8" in line[0] and "dropped 2" in line[0]
        assert "optimizer state and row momentum reset" in line[0]
        parts = run.trainer.parts
        for key, value in saved["model"].items():
            assert torch.equal(parts.model.state_dict()[key], value)
        head, today = parts.loss_fn.head, [f"product_{c:05d}" for c in range(2, 32)]
        for code, name in enumerate(today):
            if name in names:  # kept: the saved row of the same name, whatever its code was
                assert torch.equal(head.rows[code], saved_rows(saved["loss"], [names.index(name)])[0])
        assert not parts.loss_fn.head.momentum.any()  # momentum reset
        data_train = parts.train_set
        trained = {names[c] for c in saved["classes"]["trained"].tolist()}
        known = torch.tensor([name in trained for name in today])  # kept rows that were positives in week 1
        assert 0 < int(known.sum()) < 22
        length = head.rows[known].double().norm(dim=2).mean().float()
        trained_new = [c for c in range(22, 30) if (data_train.labels == c).any()]
        assert trained_new
        for code in trained_new:
            assert torch.allclose(head.rows[code].norm(), length, rtol=1e-5)
    finally:
        run.close()


def test_the_continued_run_evaluates_at_step_0_known_and_new_apart(tmp_path):
    week1, week2 = folders(tmp_path)
    train(config(tmp_path, week1, "w1", "train.epochs=1"), Backend())
    start = tmp_path / "w1" / "checkpoints" / "last.pt"
    train(config(tmp_path, week2, "w2", f"train.init_from={start}", "train.epochs=1", "train.tensorboard=true"),
          Backend())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "w2" / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    for tag in ("eval/image_known_recall_at_1", "eval/image_new_recall_at_1", "eval/image_recall_at_1"):
        steps = [event.step for event in board.Scalars(tag)]
        assert len(steps) == 2 and steps[0] == 0 < steps[1]
    evals = [r for r in map(json.loads, (tmp_path / "w2" / "metrics.jsonl").read_text().splitlines())
             if r["type"] == "eval"]
    assert [r["global_step"] for r in evals][0] == 0 and len(evals) == 2
    for record in evals:
        assert record["image_known_num_queries"] + record["image_new_num_queries"] == record["image_num_queries"]
        assert record["image_known_num_queries"] > 0 and record["image_new_num_queries"] > 0
        assert 0.0 <= record["image_known_recall_at_1"] <= 1.0 and "recall_at_1" in record
    # a resume of the continued run does not continue it again
    resumed = train(config(tmp_path, week2, "w2", f"train.init_from={start}", "train.epochs=2"), Backend())
    assert resumed.epochs_done == 2
    # ... and still reports known and new apart (the resumed run read them from its own checkpoint)
    evals = [r for r in map(json.loads, (tmp_path / "w2" / "metrics.jsonl").read_text().splitlines())
             if r["type"] == "eval"]
    assert len(evals) == 3 and evals[-1]["epoch"] == 2
    assert evals[-1]["image_known_num_queries"] == evals[0]["image_known_num_queries"] > 0
    assert evals[-1]["image_new_num_queries"] == evals[0]["image_new_num_queries"] > 0
    start.unlink()  # the run it continued from may be gone by then
    again = train(config(tmp_path, week2, "w2", f"train.init_from={start}", "train.epochs=3",
                         "train.eval_every=1"), Backend())
    assert again.epochs_done == 3
    last = [r for r in map(json.loads, (tmp_path / "w2" / "metrics.jsonl").read_text().splitlines())
            if r["type"] == "eval"][-1]
    assert last["epoch"] == 3 and last["image_known_num_queries"] == evals[0]["image_known_num_queries"]


def test_init_from_refuses_a_checkpoint_without_class_names(tmp_path):
    week1, week2 = folders(tmp_path)
    train(config(tmp_path, week1, "w1", "train.max_steps=0"), Backend())
    state = load_checkpoint(tmp_path / "w1" / "checkpoints" / "last.pt")
    del state["classes"]
    save_checkpoint(tmp_path / "old.pt", state)
    with pytest.raises(ConfigError, match=r"^train\.init_from: .*old\.pt records no class names") as caught:
        train(config(tmp_path, week2, "w2", f"train.init_from={tmp_path / 'old.pt'}"), Backend())
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"^train\.init_from: .*model does not fit this run's model"):
        train(config(tmp_path, week2, "w3", f"train.init_from={tmp_path / 'w1' / 'checkpoints' / 'last.pt'}",
                     "model.embedding_dim=24"), Backend())
    with pytest.raises(ConfigError, match=r"^train\.init_from: checkpoint not found"):
        train(config(tmp_path, week2, "w4", f"train.init_from={tmp_path / 'missing.pt'}"), Backend())
    os.mkfifo(tmp_path / "fifo.pt")  # "not found" before, for a folder or a FIFO that is there
    for planted, what in ((tmp_path / "w1" / "checkpoints", "a directory"), (tmp_path / "fifo.pt", "not a regular")):
        with pytest.raises(ConfigError, match=rf"^train\.init_from: checkpoint .* is {what}"):
            train(config(tmp_path, week2, "w5", f"train.init_from={planted}"), Backend())


class ThreadRanks:
    """``size`` ranks as threads of one process: allreduce_sum sums every rank's tensor (a barrier each side)."""

    def __init__(self, size: int) -> None:
        self.size, self.parts, self.barrier = size, [None] * size, threading.Barrier(size)

    def rank_view(self, rank: int):
        outer = self

        class View:
            def __init__(self) -> None:
                self.rank, self.size = rank, outer.size

            def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
                outer.parts[rank] = tensor.clone()
                outer.barrier.wait()
                total = torch.stack(outer.parts).sum(0)
                outer.barrier.wait()
                return total

        return View()


def test_the_neck_statistics_of_imprinting_are_the_same_at_every_world_size():
    from concurrent.futures import ThreadPoolExecutor


    features = torch.randn(3000, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3 + 1
    seen: list[int] = []

    def at(world: int):
        ranks = ThreadRanks(world)

        def one(rank: int):
            return neck_statistics(lambda block: seen.append(block.size) or features[block], len(features), 5,
                                   ranks.rank_view(rank))

        with ThreadPoolExecutor(world) as pool:
            results = list(pool.map(one, range(world)))
        for mean, var in results[1:]:
            assert torch.equal(mean, results[0][0]) and torch.equal(var, results[0][1])
        return results[0]

    mean, var = at(1)
    assert seen == [IMPRINT_BLOCK]  # a fixed sample, not the whole training set
    sample = features[np.unique(np.linspace(0, 2999, IMPRINT_BLOCK).round().astype(np.int64))]
    assert torch.allclose(mean, sample.mean(0)) and torch.allclose(var, sample.var(0, unbiased=False))
    for world in (2, 3, 7):
        other = at(world)
        assert torch.allclose(other[0], mean, atol=1e-12) and torch.allclose(other[1], var, atol=1e-12)


def test_a_new_class_with_one_training_image_is_imprinted_through_the_bnneck(tmp_path, capsys):
    """The neck normalised each block of new images with the block's own statistics: one image failed, one class
    gave a row of noise, and the rows depended on the world size."""
    week1, week2 = folders(tmp_path)
    train(config(tmp_path, week1, "w1", "train.max_steps=1"), Backend())
    week3 = tmp_path / "week3"
    shutil.copytree(week1, week3)
    new = sorted(p for p in week2.iterdir() if not (week1 / p.name).exists())[0]
    (week3 / new.name).mkdir()
    for image in sorted(new.iterdir())[:2]:  # data.heldout_images=1 keeps one: one training image
        (week3 / new.name / image.name).write_bytes(image.read_bytes())
    capsys.readouterr()
    run = assemble(config(tmp_path, week3, "w3", f"train.init_from={tmp_path / 'w1' / 'checkpoints' / 'last.pt'}"),
                   Backend())
    try:
        assert "added 1 (1 imprinted from 1 images)" in capsys.readouterr().out
        parts, code = run.trainer.parts, 24  # the new name sorts last
        head, neck = parts.loss_fn.head, parts.loss_fn.neck
        assert neck is not None and (parts.train_set.labels == code).sum() == 1
        assert torch.isfinite(head.rows[code]).all()
        length = head.rows[:code].double().norm(dim=2).mean()
        assert torch.allclose(head.rows[code].double().norm(), length, rtol=0.5)
    finally:
        run.close()


@pytest.fixture(scope="module")
def saved_week1(tmp_path_factory):
    """Week 1 trained one step; (root, week 2's folder, its checkpoint's state)."""
    root = tmp_path_factory.mktemp("grown")
    week1, week2 = folders(root)
    train(config(root, week1, "w1", "train.max_steps=1"), Backend())
    path = root / "w1" / "checkpoints" / "last.pt"
    state = located(load_checkpoint(path), path)
    return root, week2, {**state, "loss": whole_loss_state(state["loss"])}  # the damage is done to the rows inside


def _names(state):
    return state["classes"]["names"]


#: a damaged or hostile checkpoint -> (how it is made from week 1's, the one line that refuses it)
DAMAGED = {
    "duplicate names": (lambda s: _names(s).__setitem__(1, _names(s)[0]), r"class names are not distinct strings"),
    "names that are not strings": (lambda s: s["classes"].__setitem__("names", list(range(len(_names(s))))),
                                   r"class names are not distinct strings"),
    "trained codes outside the names": (lambda s: s["classes"].__setitem__("trained", torch.tensor([0, 999])),
                                        r"trained classes are not codes of its 24 names"),
    "trained codes as strings": (lambda s: s["classes"].__setitem__("trained", ["a"]),
                                 r"trained classes are not codes of its 24 names"),
    "more names than head rows": (lambda s: _names(s).extend(["zz_a", "zz_b"]),
                                  r"head's rows are not one \(subcentres, dimension\) block for each of its 26 names"),
    "head rows as a list": (lambda s: s["loss"]["head"].__setitem__("rows", [1.0, 2.0]), r"head's rows are not one"),
    "a neck of another width": (lambda s: s["loss"].__setitem__("neck", {"norm.weight": torch.ones(3),
                                                                         "norm.bias": torch.zeros(3)}),
                                r"does not fit this run's head\.bnneck's neck"),
    "a section missing": (lambda s: s.pop("sampler"), r"section 'sampler' must be a dict, it holds nothing"),
    "a diverged model": (lambda s: next(iter(s["model"].values())).fill_(float("nan")),
                         r"holds \d+ NaN or infinite model value\(s\)"),
    "diverged head rows": (lambda s: s["loss"]["head"]["rows"].fill_(float("inf")),
                           r"its head holds NaN or infinite rows"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_init_from_refuses_a_damaged_checkpoint_in_one_line(saved_week1, tmp_path, case):
    """Before, each of these ran on (a diverged model, its rows imprinted from NaN: none), or raised a traceback
    (IndexError, AttributeError, RuntimeError) on the ranks that read the bad part while the others waited."""
    root, week2, state = saved_week1
    damaged = copy.deepcopy(state)
    make, refusal = DAMAGED[case]
    make(damaged)
    save_checkpoint(tmp_path / "damaged.pt", damaged)
    with pytest.raises(ConfigError, match=r"^train\.init_from: .*damaged\.pt.*" + refusal) as caught:
        assemble(config(tmp_path, week2, "w2", f"train.init_from={tmp_path / 'damaged.pt'}"), Backend())
    assert "\n" not in str(caught.value) and "--no-resume" not in str(caught.value)


def test_init_from_a_checkpoint_without_a_head_imprints_every_row_and_says_so(saved_week1, tmp_path, capsys):
    """The start line said 'classes kept 22' of a checkpoint that had no rows to keep."""
    root, week2, state = saved_week1
    headless = copy.deepcopy(state)
    del headless["loss"]["head"]
    save_checkpoint(tmp_path / "headless.pt", headless)
    capsys.readouterr()
    run = assemble(config(tmp_path, week2, "w2", f"train.init_from={tmp_path / 'headless.pt'}"), Backend())
    try:
        line = [text for text in capsys.readouterr().out.splitlines() if "init_from" in text][0]
        trained = int(np.unique(run.trainer.parts.train_set.labels).size)
        assert f"the saved run had no head, every row is new ({trained} imprinted from" in line
        assert "classes it knew by name 22, added 8, dropped 2" in line and "classes kept" not in line
        for key, value in state["model"].items():  # the model is taken all the same
            assert torch.equal(run.trainer.parts.model.state_dict()[key], value)
    finally:
        run.close()


def test_init_from_never_runs_code_from_the_file(saved_week1, tmp_path):
    root, week2, state = saved_week1

    class Planted:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "ran",))

    torch.save({**state, "state": {"planted": Planted()}}, tmp_path / "planted.pt")
    with pytest.raises(ConfigError, match=r"^train\.init_from: checkpoint .*planted\.pt was refused") as caught:
        assemble(config(tmp_path, week2, "w2", f"train.init_from={tmp_path / 'planted.pt'}"), Backend())
    message = str(caught.value)  # the resume's advice (--no-resume) is not the continued run's
    assert "could run code" in message and "--no-resume" not in message
    assert message.endswith("; continue from another checkpoint")
    assert not (tmp_path / "ran").exists()


def test_the_start_line_says_when_no_class_name_matched():
    """Week 1 on one dataset, week 2 joining it with another (``DATASETS=a,b``): every name gains its dataset's
    prefix, so nothing matched; the line said only 'kept 0'."""
    from pksampler.train.engine.continuation import Continuation

    joined = match_classes(["x", "y"], ["a/x", "a/y", "b/z"])
    assert (joined.kept, joined.added, joined.dropped) == (0, 3, 2)
    line = Continuation("w1.pt", joined, 3, 9, "imprint", np.zeros(3, dtype=bool), 0).line()
    assert "classes kept 0, added 3" in line and "no class name matched the saved run's" in line
    assert "<dataset>/<class>" in line and "\n" not in line
    kept = Continuation("w1.pt", match_classes(["a/x"], ["a/x", "b/z"]), 1, 3, "imprint", np.ones(2, dtype=bool), 0)
    assert "no class name matched" not in kept.line()

"""Unreadable held-out images: left out of the evaluation and counted, never replaced by a twin."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pksampler.datasets import ImageFolderDataset, LabelledSubset, eval_preset
from pksampler.train.config.load import ConfigError, load_config
from pksampler.train.runtime.distributed import Backend
from pksampler.train.evaluation.heldout import HeldOutEvaluator, embed
from pksampler.train.evaluation.metrics import evaluate_retrieval
from pksampler.train.run_setup import train

GARBAGE = b"garbage"  # 7 bytes that no decoder accepts


def write_classes(root: Path, classes: int, per_class: int, *, bad: callable = lambda c, i: False) -> None:
    """``classes`` folders of noisy solid-colour PNGs; items where ``bad(class, item)`` are garbage bytes."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class_{c:02d}"
        folder.mkdir(parents=True)
        colour = rng.integers(0, 256, size=3)
        for i in range(per_class):
            path = folder / f"img_{i:02d}.png"
            if bad(c, i):
                path.write_bytes(GARBAGE)
                continue
            pixels = np.clip(colour + rng.normal(0, 60, size=(24, 24, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(path)


def evaluator(tmp_path: Path, dataset, test: LabelledSubset, model, **kwargs) -> HeldOutEvaluator:
    return HeldOutEvaluator(model, dataset, test, Backend(), galleries=tmp_path / "galleries", gallery_queries=3,
                            **kwargs)


def projection() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 24 * 24, 16))


def test_unreadable_held_out_images_are_left_out_and_counted_not_duplicated(tmp_path):
    write_classes(tmp_path / "data", 8, 6, bad=lambda c, i: i % 2 == 1)  # half of every class unreadable
    dataset = ImageFolderDataset(tmp_path / "data")
    test = LabelledSubset(dataset, np.arange(len(dataset)), transform=eval_preset(24))
    model = projection()
    evaluate = evaluator(tmp_path, dataset, test, model)
    evaluate.max_bad_fraction = 0.5
    metrics = evaluate(epoch=1)

    readable = np.flatnonzero(np.arange(len(dataset)) % 2 == 0)
    clean = LabelledSubset(dataset, readable, transform=eval_preset(24), on_bad="raise")
    expected = evaluate_retrieval(embed(model, clean, Backend()), clean.labels, ks=(1, 5, 10)).metrics
    assert metrics["num_unreadable"] == 24 and metrics["num_queries"] == 24
    for key in ("recall_at_1", "recall_at_5", "map_at_r", "precision_at_1"):
        assert metrics[key] == pytest.approx(expected[key]), key
    assert (tmp_path / "galleries" / "epoch_001.png").is_file()


def test_too_many_unreadable_held_out_images_are_one_error_naming_the_key(tmp_path):
    write_classes(tmp_path / "data", 4, 4, bad=lambda c, i: i == 0)
    dataset = ImageFolderDataset(tmp_path / "data")
    test = LabelledSubset(dataset, np.arange(len(dataset)), transform=eval_preset(24))
    with pytest.raises(ConfigError, match=r"data.max_bad_fraction: 4 of 16 held-out images \(25.00%\) could not be "
                                          r"decoded at the evaluation of epoch 2, more than the allowed 10.00%"):
        evaluator(tmp_path, dataset, test, projection(), max_bad_fraction=0.1)(epoch=2)


def test_a_run_with_an_unreadable_first_image_in_every_class_evaluates_and_finishes(tmp_path):
    write_classes(tmp_path / "data", 24, 6, bad=lambda c, i: i == 0)
    config = load_config(None, [
        "data.name=folder", f"data.root={tmp_path / 'data'}", "data.image_size=24", "data.workers=0",
        "data.args={}", "data.max_bad_fraction=0.2", "sampler.classes_per_step=4", "sampler.samples_per_class=3",
        "model.width=8", "model.depth=[1, 1]", "model.embedding_dim=16", "loss.name=batch_hard",
        "optim.base_batch=12", "train.epochs=1", "train.eval_every=1", "train.gallery_queries=3",
        f"workspace={tmp_path / 'run'}"], environ={})
    result = train(config, Backend())
    assert result.epochs_done == 1
    test_classes = round(24 * config.data.test_fraction)
    assert result.final_metrics["num_unreadable"] == test_classes
    assert result.final_metrics["num_queries"] == 5 * test_classes
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "num_unreadable" in r]
    assert evals and evals[-1]["num_unreadable"] == test_classes


class RecordingBackend:
    """Stands in for W ranks in one process: the first pass records each rank's row, the second gathers them."""

    def __init__(self, size: int) -> None:
        self.size, self.rows, self.gather = size, [], False

    def allgather_numpy(self, row: np.ndarray) -> np.ndarray:
        if not self.gather:
            self.rows.append(row.copy())
            return row[None]
        return np.stack(self.rows)


def test_unreadable_flags_of_every_rank_are_combined():
    from pksampler.train.evaluation.heldout import _flagged_on_any_rank

    rng = np.random.default_rng(0)
    count, world = 77, 3
    owned = [np.arange(count) % world == r for r in range(world)]  # embed's strided shares
    truth = rng.random(count) < 0.2
    backend = RecordingBackend(world)
    for r in range(world):
        _flagged_on_any_rank(backend, truth & owned[r])
    backend.gather = True
    for r in range(world):
        np.testing.assert_array_equal(_flagged_on_any_rank(backend, truth & owned[r]), truth)

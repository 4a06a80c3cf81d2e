"""The batch-size benchmark's arms: each is a valid run config that differs from the others in batch and optimizer only."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from batch_size import Arm, arm_overrides, parse_arms, read_curve, table  # noqa: E402

from pksampler.train.config.load import load_config  # noqa: E402
from pksampler.train.solver.build import learning_rate  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_arms_parse_with_an_optional_optimizer_and_refuse_batches_that_k_does_not_divide():
    assert parse_arms("64, 1024:lamb", "adamw", 4) == [Arm(64, "adamw"), Arm(1024, "lamb")]
    with pytest.raises(SystemExit, match=r"--arms: '66': the batch must be a positive multiple of K=4"):
        parse_arms("64,66", "adamw", 4)


def test_every_arm_is_a_valid_config_with_equal_epochs_and_its_own_batch_rule(tmp_path):
    args = argparse.Namespace(size=32, lr=0.004, warmup_fraction=0.05, epochs=15, evals=5, workspace=tmp_path / "runs",
                              overrides=["model.stem_stride=2"])
    configs = {arm: load_config(ROOT / "configs" / "folder.yaml", arm_overrides(arm, args, tmp_path / "data", 4), environ={})
               for arm in (Arm(64, "adamw"), Arm(1024, "adamw"), Arm(1024, "lars"))}
    for arm, config in configs.items():
        assert config.sampler.classes_per_step * config.sampler.samples_per_class == arm.batch
        assert (config.train.epochs, config.train.steps, config.train.eval_every) == (15, None, 3)
        assert config.optim.warmup_fraction == 0.05 and config.model.stem_stride == 2
    assert [learning_rate(c.optim, a.batch) for a, c in configs.items()] == pytest.approx([0.004, 0.016, 0.064])


def test_the_curve_is_read_from_the_eval_records_in_images_seen(tmp_path):
    records = [{"type": "step", "global_step": 1, "loss": 0.9},
               {"type": "eval", "epoch": 3, "global_step": 15, "recall_at_1": 0.2, "map_at_r": 0.05}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    curve = read_curve(tmp_path, 1024)
    assert curve == [{"epoch": 3, "global_step": 15, "images": 15 * 1024, "recall_at_1": 0.2, "map_at_r": 0.05}]
    assert read_curve(tmp_path / "missing", 64) == []
    rows = [{"batch": 64, "optimizer": "adamw", "updates": 1305, "lr": 0.004, "warmup": 65, "recall_at_1": 0.5,
             "map_at_r": 0.2, "seconds": 600.0},
            {"batch": 1024, "optimizer": "lamb", "updates": 75, "lr": 0.016, "warmup": 4, "recall_at_1": None,
             "map_at_r": None, "seconds": 60.0}]
    assert table(rows).splitlines()[2:] == ["| 64 | adamw | 1305 | 0.004 | 65 | 0.500 | 0.200 | 1.00 | 10 min |",
                                            "| 1,024 | lamb | 75 | 0.016 | 4 | – | – | – | 1 min |"]

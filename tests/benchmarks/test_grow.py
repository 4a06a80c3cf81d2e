"""benchmarks/grow.py's own parts: the week-1 folder keeps every held-out class, and the table's arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from grow import summary, week1_folder  # noqa: E402

from pksampler.datasets import ImageFolderDataset, SyntheticProducts, class_disjoint_split_by_name  # noqa: E402


def test_week1_holds_a_share_of_the_training_classes_and_every_held_out_class(tmp_path):
    SyntheticProducts(40, 2, image_size=16, root=tmp_path / "full")
    week1, training = week1_folder(tmp_path / "full", tmp_path / "week1", fraction=0.7, test_fraction=0.3)
    full, small = ImageFolderDataset(tmp_path / "full"), ImageFolderDataset(tmp_path / "week1")
    assert week1 == round(0.7 * training) and len(small.classes) == week1 + 40 - training
    held = [set(np.asarray(d.classes)[np.unique(d.labels[class_disjoint_split_by_name(d.labels, d.classes, 0.3)[1]])])
            for d in (full, small)]
    assert held[0] == held[1]  # both weeks are evaluated on the same held-out classes


def test_the_table_counts_steps_to_scratch_and_the_known_classes_fall():
    scratch = [{"global_step": s, "recall_at_1": r, "image_recall_at_1": r, "map_at_r": 0.1}
               for s, r in ((30, 0.2), (60, 0.5))]
    imprint = [{"global_step": s, "recall_at_1": r, "image_recall_at_1": i, "image_known_recall_at_1": k,
                "map_at_r": 0.1} for s, r, i, k in ((0, 0.45, 0.3, 0.8), (10, 0.52, 0.4, 0.75), (20, 0.55, 0.6, 0.79))]
    table = summary({"scratch": scratch, "imprint": imprint})
    row = table["imprint"]
    assert row["steps_to_scratch_recall_at_1"] == 10 and row["steps_to_scratch_image_recall_at_1"] == 20
    assert row["image_known_start"] == 0.8 and abs(row["image_known_largest_fall"] - 0.05) < 1e-12
    assert table["scratch"]["recall_at_1"] == 0.5

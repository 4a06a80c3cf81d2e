"""TensorBoardWriter: events written, then read back with TensorBoard's own reader."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from pksampler.train.engine import tensorboard as tb

pytestmark = pytest.mark.skipif(not tb.available(), reason="the optional 'tensorboard' package is not installed")


def read_events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    return accumulator


def test_scalars_metrics_and_images_read_back(tmp_path):
    gallery = np.zeros((30, 40, 3), np.uint8)
    gallery[:, :20] = (0, 170, 0)
    png = tmp_path / "gallery.png"
    Image.fromarray(gallery).save(png)
    with tb.TensorBoardWriter(tmp_path, flush_secs=1) as board:
        for step in (1, 2, 3):
            board.scalars(step, loss=torch.tensor(1.0 / step), lr=0.01 * step, images_per_sec=np.float32(150.5),
                          skipped=None)
        board.metrics(3, {"recall_at_1": 0.75, "map_at_r": 0.5, "num_queries": 96, "note": "text"}, epoch=1)
        board.image("gallery", 3, png)
        board.image("gallery_array", 3, gallery)
    events = read_events(tmp_path / "tensorboard")
    tags = events.Tags()
    assert set(tags["scalars"]) == {"train/loss", "train/lr", "train/images_per_sec", "eval/recall_at_1",
                                    "eval/map_at_r", "eval/num_queries", "eval/epoch"}
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([1.0, 0.5, 1 / 3])
    assert events.Scalars("train/images_per_sec")[0].value == pytest.approx(150.5)
    assert [(e.step, e.value) for e in events.Scalars("eval/recall_at_1")] == [(3, 0.75)]
    assert events.Scalars("eval/num_queries")[0].value == 96
    assert set(tags["images"]) == {"gallery", "gallery_array"}
    for tag in ("gallery", "gallery_array"):
        (event,) = events.Images(tag)
        assert (event.step, event.width, event.height) == (3, 40, 30)
        decoded = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
        assert tuple(decoded[5, 5]) == (0, 170, 0) and tuple(decoded[5, 30]) == (0, 0, 0)


def test_disabled_writer_creates_nothing(tmp_path):
    board = tb.TensorBoardWriter(tmp_path, enabled=False)
    board.scalars(1, loss=0.5)
    board.metrics(1, {"recall_at_1": 0.5})
    board.image("gallery", 1, np.zeros((4, 4, 3), np.uint8))
    board.close()
    assert not (tmp_path / "tensorboard").exists()


def test_missing_package_is_reported_with_the_install_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(tb, "available", lambda: False)
    with pytest.raises(ImportError, match=r"pip install 'pksampler\[tensorboard\]'"):
        tb.TensorBoardWriter(tmp_path)
    tb.TensorBoardWriter(tmp_path, enabled=False).close()  # disabled needs no package


def test_bad_input(tmp_path):
    with tb.TensorBoardWriter(tmp_path) as board:
        with pytest.raises(ValueError, match=r"scalars\(step=\) must be a non-negative int, got -1"):
            board.scalars(-1, loss=0.1)
        with pytest.raises(TypeError, match=r"scalars\(loss=\) must be a number, got str"):
            board.scalars(1, loss="low")
        with pytest.raises(ValueError, match=r"image\(image=\) must be \(H, W, 3\), got shape \(4, 4, 1\)"):
            board.image("x", 1, np.zeros((4, 4, 1), np.uint8))

"""Training curves (matplotlib figure and PNG) and the labelled result gallery."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pksampler.train.engine.plots import curves_figure, save_curves_png, smooth
from pksampler.train.evaluation.render import render_gallery, save_gallery_png


def test_curves_figure_has_two_labelled_panels_with_the_data():
    import matplotlib.pyplot as plt

    steps = np.arange(1, 101)
    losses = 2.0 * np.exp(-steps / 30) + 0.3
    figure = curves_figure(steps, losses, [1, 2, 3], [0.5, 0.7, 0.9], [0.2, 0.3, 0.4], title="demo run")
    try:
        loss_axes, eval_axes = figure.axes
        assert figure.get_suptitle() == "demo run"
        for axes in figure.axes:
            assert axes.get_xlabel() and axes.get_ylabel() and axes.get_title()
            assert axes.get_legend() is not None
        assert loss_axes.get_xlabel().startswith("global step") and eval_axes.get_xlabel() == "epoch"
        raw, smoothed = loss_axes.get_lines()
        assert list(raw.get_xdata()) == list(steps) and list(raw.get_ydata()) == pytest.approx(losses)
        assert np.abs(np.diff(smoothed.get_ydata())).max() <= np.abs(np.diff(losses)).max()
        labels = [line.get_label() for line in eval_axes.get_lines()]
        assert labels == ["Recall@1", "MAP@R"]
        assert list(eval_axes.get_lines()[0].get_ydata()) == [0.5, 0.7, 0.9]
        assert eval_axes.get_ylim() == (0.0, 1.05)
    finally:
        plt.close(figure)


def test_curves_png_decodes_and_is_written_atomically(tmp_path):
    path = save_curves_png(tmp_path / "run" / "curves.png", torch.arange(1, 30).tolist(), np.linspace(1, 0.2, 29),
                           [1, 2], [0.4, 0.6])
    with Image.open(path) as image:
        assert image.format == "PNG" and 1000 <= image.width <= 1400 and 350 <= image.height <= 600
    assert not list((tmp_path / "run").glob(".*"))  # no temporary left behind


def test_curves_without_data_still_render(tmp_path):
    path = save_curves_png(tmp_path / "curves.png", [], [], [], [])
    with Image.open(path) as image:
        assert image.size[0] > 0


def test_curves_reject_mismatched_lengths():
    with pytest.raises(ValueError, match=r"save_curves_png\(losses=\) must have one value per point \(3\), got 2"):
        curves_figure([1, 2, 3], [0.1, 0.2], [], [])


def test_smooth_removes_noise_without_start_bias():
    values = np.full(50, 4.0)
    assert smooth(values) == pytest.approx(values)  # bias-corrected: no ramp up from 0
    noisy = 1.0 + np.where(np.arange(200) % 2, 0.5, -0.5)
    assert np.ptp(smooth(noisy)[50:]) < 0.2 < np.ptp(noisy)
    with pytest.raises(ValueError, match=r"smooth\(weight=\) must be in \[0, 1\), got 1.0"):
        smooth(values, weight=1.0)


def _images(n: int, cell: int = 16) -> list[np.ndarray]:
    return [np.full((cell, cell, 3), 140 + 30 * i, np.uint8) for i in range(n)]  # bright: dark pixels are text


def test_gallery_png_has_headers_frames_scores_and_caption(tmp_path):
    images = _images(4)
    correct = [[True, False, True], [False, False, True]]
    similarities = [[0.91, 0.85, 0.80], [0.7, 0.6, np.nan]]
    cell, border = 48, 3
    picture = render_gallery(images[:2], [images[1:4], images[0:3]], correct, similarities=similarities,
                             title="epoch 3", cell=cell, border=border)
    bare = render_gallery(images[:2], [images[1:4], images[0:3]], correct, cell=cell, border=border)
    array = np.asarray(picture)
    # taller than the image rows alone: title, header, score line per row, caption
    assert array.shape[0] > 2 * (cell + 2 * border) + 60 and array.shape[0] > np.asarray(bare).shape[0]
    colours = {tuple(pixel) for pixel in array.reshape(-1, 3)}
    assert {(0, 170, 0), (210, 0, 0), (128, 128, 128)} <= colours  # green, red, grey frames
    dark_text_rows = np.flatnonzero((array.max(axis=2) < 100).sum(axis=1) > 0)
    assert dark_text_rows.min() < 30 and dark_text_rows.max() > array.shape[0] - 30  # title/header and caption
    path = save_gallery_png(tmp_path / "out" / "gallery.png", images[:2], [images[1:4], images[0:3]], correct,
                            similarities=similarities, title="epoch 3", cell=cell, border=border)
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[1] == array.shape[0]
    assert not list((tmp_path / "out").glob(".*"))


def test_gallery_frames_sit_around_each_cell():
    images = _images(3)
    picture = np.asarray(render_gallery(images[:1], [images[1:3]], [[True, False]], cell=40, border=4))
    green = np.argwhere((picture == (0, 170, 0)).all(axis=2))
    red = np.argwhere((picture == (210, 0, 0)).all(axis=2))
    assert green.size and red.size
    assert green[:, 1].max() < red[:, 1].min()  # 1st (correct) left of 2nd (wrong)
    assert green[:, 1].max() - green[:, 1].min() + 1 == 40 + 2 * 4  # frame = cell + both borders


def test_gallery_accepts_tensors_and_float_images():
    chw = torch.rand(3, 10, 12)
    hwc_float = np.linspace(-1, 1, 10 * 10 * 3).reshape(10, 10, 3)
    picture = render_gallery([chw], [[hwc_float, np.zeros((10, 10), np.uint8)]], [[True, True]], cell=20)
    assert picture.mode == "RGB"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"query_images": []}, r"query_images=\) is empty"),
        ({"correct": [[True]]}, r"1 query images need 1 neighbour rows and correct of shape \(1, 2\)"),
        ({"similarities": [[0.5]]}, r"similarities=\) must have shape \(1, 2\), got \(1, 1\)"),
    ],
)
def test_gallery_bad_input(kwargs, match):
    images = _images(3)
    args = {"query_images": images[:1], "neighbour_images": [images[1:3]], "correct": [[True, False]]}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        render_gallery(**args)

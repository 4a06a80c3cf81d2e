"""Collapse made visible (issue 37 item 5): effective rank and mean cosines per evaluation, the curves, and the
one-line warning when a head's loss stays at its starting level."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modeling"))
from test_sharded_head import run_ranks  # noqa: E402

from pksampler.train.engine.plots import curves_figure  # noqa: E402
from pksampler.train.engine.stall import HeadStallHook  # noqa: E402
from pksampler.train.evaluation.collapse import (  # noqa: E402
    COLLAPSE_KEYS, collapse_metrics, effective_rank, sampled_collapse_metrics)


def _brute_force(x: np.ndarray, labels: np.ndarray) -> tuple[float, float, float]:
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    cos = x @ x.T
    off = ~np.eye(len(x), dtype=bool)
    same = (labels[:, None] == labels[None, :]) & off
    return cos[off].mean(), cos[same].mean(), cos[off & ~same].mean()


def test_mean_cosines_match_the_pairwise_means_and_the_rank_counts_used_directions():
    rng = np.random.default_rng(0)
    x, labels = rng.normal(size=(40, 6)), rng.integers(0, 5, size=40)
    metrics = collapse_metrics(x, labels)
    assert np.allclose([metrics["mean_cosine"], metrics["mean_cosine_same"], metrics["mean_cosine_other"]],
                       _brute_force(x, labels), atol=1e-12)
    # one direction: rank 1 and every cosine 1; orthonormal classes: same 1, other 0, rank = number of classes
    collapsed = collapse_metrics(np.ones((10, 4)) * rng.uniform(0.5, 2, size=(10, 1)), np.arange(10) % 3)
    assert collapsed["effective_rank"] == pytest.approx(1.0)
    assert collapsed["mean_cosine"] == pytest.approx(1.0) and collapsed["mean_cosine_other"] == pytest.approx(1.0)
    spread = collapse_metrics(np.repeat(np.eye(4), 3, axis=0), np.repeat(np.arange(4), 3))
    assert spread["effective_rank"] == pytest.approx(4.0)
    assert spread["mean_cosine_same"] == pytest.approx(1.0) and spread["mean_cosine_other"] == pytest.approx(0.0)
    assert effective_rank(np.zeros((3, 2))) == 0.0
    singletons = collapse_metrics(np.eye(3), np.arange(3))  # no same-class pair: NaN, not a division error
    assert np.isnan(singletons["mean_cosine_same"]) and singletons["mean_cosine_other"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match=r"collapse_metrics: embeddings \(N, D\) and labels \(N,\) expected"):
        collapse_metrics(np.ones((3, 2)), np.ones(4))


def test_the_sampled_metrics_are_the_same_at_every_world_size_and_bounded_in_size():
    rng = np.random.default_rng(1)
    embeddings = rng.normal(size=(300, 8)).astype(np.float32)
    labels = np.repeat(np.arange(30), 10)
    readable = np.arange(300)
    results = {}
    for world in (1, 2, 3):
        def work(group, world=world):
            mine = np.arange(group.rank, 300, world)  # any split of the positions over the ranks
            return sampled_collapse_metrics(torch.from_numpy(embeddings[mine]), mine, readable, labels, group,
                                            sample=120)
        results[world] = run_ranks(world, work)
    reference = results[1][0]
    assert all(r == reference for rows in results.values() for r in rows)
    whole = collapse_metrics(embeddings, labels)
    assert reference != whole  # a 120-item sample, not all 300
    assert abs(reference["mean_cosine"] - whole["mean_cosine"]) < 0.05


def _stall_run(losses: list[float], **options) -> list[str]:
    lines: list[str] = []
    hook = HeadStallHook(lambda: torch.tensor(hook.trainer.value), emit=lines.append, **options)
    hook.trainer = SimpleNamespace(state=SimpleNamespace(global_step=0), value=0.0)
    for step, value in enumerate(losses, start=1):
        hook.trainer.state.global_step, hook.trainer.value = step, value
        hook.after_step()
    return lines


def test_the_stall_warning_is_one_line_once_and_only_for_a_loss_that_stayed():
    flat = _stall_run([6.9] * 100, after_steps=40, window=10)
    assert len(flat) == 1 and "\n" not in flat[0]
    assert "the head's loss (without its margin) has not left its starting level after 40 steps (6.900" in flat[0]
    falling = _stall_run([6.9 - 0.05 * t for t in range(100)], after_steps=40, window=10)
    assert falling == []
    with pytest.raises(ValueError, match=r"after_steps \(10\) must be at least 2 × window \(20\)"):
        HeadStallHook(lambda: 0.0, after_steps=10, window=20)


def test_the_curves_show_the_collapse_metrics():
    figure = curves_figure([1, 2, 3], [3.0, 2.0, 1.5], [1, 2], [0.2, 0.4], [0.1, 0.2],
                           collapse={"mean_cosine": [0.99, 0.5], "mean_cosine_same": [0.99, 0.8],
                                     "mean_cosine_other": [0.99, 0.3], "effective_rank": [1.5, 20.0]})
    try:
        labels = {line.get_label() for axes in figure.axes for line in axes.get_lines()}
        assert {"mean cosine (all)", "mean cosine (same class)", "mean cosine (other class)",
                "effective rank"} <= labels
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_embeddings_give_nan_metrics_not_a_healthy_spread_or_a_crash(bad):
    # NaN rows were read as zero rows (rank 0, cosines 0: "no collapse"); an infinite one stopped the SVD
    x = np.random.default_rng(0).standard_normal((6, 4))
    x[2, 1] = bad
    metrics = collapse_metrics(x, np.array([0, 0, 1, 1, 2, 2]))
    assert set(metrics) == set(COLLAPSE_KEYS)
    assert all(np.isnan(value) for value in metrics.values()), metrics


def test_the_score_axis_shows_the_lowest_mean_cosine_of_any_series():
    # each cosine series set the axis from its own minimum, so a later series with a higher one cut off an earlier
    # negative mean (other-class cosines below 0 are what a healthy space shows)
    figure = curves_figure([1, 2, 3], [3.0, 2.0, 1.5], [1, 2], [0.2, 0.4], [0.1, 0.2],
                           collapse={"mean_cosine": [-0.4, -0.3], "mean_cosine_same": [0.6, 0.8],
                                     "mean_cosine_other": [0.2, 0.3]})
    try:
        score = next(axes for axes in figure.axes if any(line.get_label() == "mean cosine (all)"
                                                          for line in axes.get_lines()))
        assert score.get_ylim()[0] <= -0.4
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)

"""Training curves as a matplotlib figure (headless Agg), written atomically.

Two panels side by side:

1. training loss per optimizer step: the raw values as faint points and a
   smoothed line (exponential moving average with bias correction, the
   smoothing TensorBoard shows), so a noisy loss still shows its trend;
2. held-out retrieval per evaluation (x = epoch): Recall@1 and, when given,
   MAP@R, on a fixed 0..1 scale so runs compare by eye; and, when given, the
   collapse metrics (:mod:`pksampler.train.evaluation.collapse`): the mean
   cosines (all, same class, other class) as dashed lines on the same scale
   and the effective rank on a second axis, so a head that pulls every
   embedding together shows as the three cosines meeting near 1.

matplotlib is imported lazily and switched to the ``Agg`` backend before
pyplot is loaded, so the trainer works on machines without a display and
nothing imports matplotlib unless a figure is drawn. The figure is built by
:func:`curves_figure` (tests inspect it) and saved by :func:`save_curves_png`
into memory, then through :func:`pksampler.files.atomic_write_bytes`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from pksampler.arrays import as_numpy
from pksampler.files import atomic_write_bytes

__all__ = ["curves_figure", "save_curves_png", "smooth"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def smooth(values: Any, *, weight: float | None = None) -> np.ndarray:
    """Exponential moving average with bias correction (no pull towards 0 at the start).

    ``weight`` (0 <= w < 1) is the share of the past kept per step; ``None``
    picks ``1 - 1/span`` with ``span = max(1, n / 20)``, i.e. about 5 % of the
    run, so long and short runs look equally smooth.
    """
    values = as_numpy(values, name="smooth(values=)", dtype=np.float64, ndim=1)
    if weight is None:
        weight = 1.0 - 1.0 / max(1.0, values.size / 20.0)
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smooth(weight=) must be in [0, 1), got {weight!r}")
    out = np.empty_like(values)
    running, norm = 0.0, 0.0
    for i, value in enumerate(values):  # n is the number of logged steps: small
        running = weight * running + (1.0 - weight) * value
        norm = weight * norm + (1.0 - weight)
        out[i] = running / norm
    return out


def _series(name: str, values: Sequence[float] | None, length: int | None = None) -> np.ndarray:
    array = as_numpy([] if values is None else values, name=f"save_curves_png({name}=)", dtype=np.float64, ndim=1)
    if length is not None and array.size not in (0, length):
        raise ValueError(f"save_curves_png({name}=) must have one value per point ({length}), got {array.size}")
    return array


def curves_figure(
    loss_steps: Sequence[float],
    losses: Sequence[float],
    eval_epochs: Sequence[float],
    recalls: Sequence[float],
    map_at_r: Sequence[float] | None = None,
    *,
    title: str = "Training run",
    smoothing: float | None = None,
    collapse: Mapping[str, Sequence[float]] | None = None,
):
    """The two-panel figure (see the module docstring); the caller owns (and closes) it.

    Args:
        loss_steps: global step of each logged loss.
        losses: mean training loss of that step.
        eval_epochs: epoch (1-based, completed epochs) of each evaluation.
        recalls: held-out Recall@1 of each evaluation.
        map_at_r: held-out MAP@R of each evaluation (optional).
        title: figure title, e.g. the config name and world size.
        smoothing: EMA weight for the loss line, ``None`` = automatic (see :func:`smooth`).
        collapse: per evaluation, any of ``mean_cosine``, ``mean_cosine_same``, ``mean_cosine_other`` and
            ``effective_rank`` (optional; NaN where an evaluation lacks it).
    """
    steps = _series("loss_steps", loss_steps)
    loss = _series("losses", losses, steps.size)
    epochs = _series("eval_epochs", eval_epochs)
    recall = _series("recalls", recalls, epochs.size)
    mapr = _series("map_at_r", map_at_r, epochs.size)
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100, layout="constrained")
    figure.suptitle(title, fontsize=14)
    _loss_panel(left, steps, loss, smoothing)
    _retrieval_panel(right, epochs, recall, mapr, collapse or {})
    from matplotlib.ticker import MaxNLocator

    for axes in (left, right):  # steps and epochs are whole numbers
        axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    return figure


def _loss_panel(left: Any, steps: np.ndarray, loss: np.ndarray, smoothing: float | None) -> None:
    """The left panel: every step's loss and its EMA."""
    left.set_title("Training loss")
    left.set_xlabel("global step (optimizer updates)")
    left.set_ylabel("loss (mean over the global batch)")
    if steps.size:
        left.plot(steps, loss, linestyle="none", marker=".", markersize=3, alpha=0.35, color="tab:blue",
                  label="per step")
        left.plot(steps, smooth(loss, weight=smoothing), color="tab:blue", linewidth=2, label="smoothed (EMA)")
        left.legend(loc="upper right")
        if steps.min() == steps.max():  # one step: an axis around it, not a 0.1-wide one
            left.set_xlim(steps[0] - 1, steps[0] + 1)
    else:
        left.text(0.5, 0.5, "no steps logged", ha="center", va="center", transform=left.transAxes, color="grey")
    left.grid(True, alpha=0.3)


def _retrieval_panel(right: Any, epochs: np.ndarray, recall: np.ndarray, mapr: np.ndarray,
                     collapse: Mapping[str, Sequence[float]]) -> None:
    """The right panel: held-out Recall@1 and MAP@R per evaluation, and the collapse lines."""
    right.set_title("Held-out classes (retrieval)")
    right.set_xlabel("epoch")
    right.set_ylabel("score (0 to 1)")
    right.set_ylim(0.0, 1.05)
    if epochs.size:
        right.plot(epochs, recall, marker="o", color="tab:green", label="Recall@1")
        if mapr.size:
            right.plot(epochs, mapr, marker="s", color="tab:purple", label="MAP@R")
        right.annotate(f"{recall[-1]:.3f}", (epochs[-1], recall[-1]), textcoords="offset points", xytext=(0, 8),
                       ha="center", color="tab:green")
        low, high = float(epochs.min()), float(epochs.max())
        right.set_xlim(low - 0.5, high + 0.5)
        _collapse_lines(right, epochs, collapse)
        right.legend(loc="lower right", fontsize=8)
    else:
        right.text(0.5, 0.5, "no evaluation yet", ha="center", va="center", transform=right.transAxes,
                   color="grey")
    right.grid(True, alpha=0.3)


_COSINES = (("mean_cosine", "mean cosine (all)", "tab:grey"), ("mean_cosine_same", "mean cosine (same class)", "tab:orange"),
            ("mean_cosine_other", "mean cosine (other class)", "tab:red"))


def _collapse_lines(axes: Any, epochs: np.ndarray, collapse: Mapping[str, Sequence[float]]) -> None:
    """The mean cosines (dashed, on the score axis) and the effective rank (on a second axis) per evaluation."""
    lowest = 0.0  # the axis reaches the lowest mean of every series (negative cosines included)
    for key, label, colour in _COSINES:
        if key in collapse:
            values = _series(key, collapse[key], epochs.size)
            if values.size and np.isfinite(values).any():
                axes.plot(epochs, values, linestyle="--", marker=".", color=colour, label=label)
                lowest = min(lowest, float(np.nanmin(values)) - 0.05)
                axes.set_ylim(lowest, 1.05)
    if "effective_rank" in collapse:
        rank = _series("effective_rank", collapse["effective_rank"], epochs.size)
        if rank.size and np.isfinite(rank).any():
            twin = axes.twinx()
            twin.plot(epochs, rank, linestyle=":", marker="^", color="tab:brown", label="effective rank")
            twin.set_ylabel("effective rank of the embeddings", color="tab:brown")
            twin.set_ylim(0, max(1.0, float(np.nanmax(rank))) * 1.1)
            twin.legend(loc="upper left", fontsize=8)


def save_curves_png(
    path: str | Path,
    loss_steps: Sequence[float],
    losses: Sequence[float],
    eval_epochs: Sequence[float],
    recalls: Sequence[float],
    map_at_r: Sequence[float] | None = None,
    *,
    title: str = "Training run",
    smoothing: float | None = None,
    collapse: Mapping[str, Sequence[float]] | None = None,
) -> Path:
    """Draw :func:`curves_figure` and write it as a PNG atomically; returns the path."""
    figure = curves_figure(loss_steps, losses, eval_epochs, recalls, map_at_r, title=title, smoothing=smoothing,
                           collapse=collapse)
    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, format="png")
    finally:
        _pyplot().close(figure)
    return atomic_write_bytes(path, buffer.getvalue())



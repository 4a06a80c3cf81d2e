"""Held-out-class retrieval of a config's data: raw pixels, an untrained network, a trained checkpoint.

Run: .venv/bin/python benchmarks/baselines.py [--config configs/demo.yaml] [--checkpoint workspace/demo/checkpoints/best.pt]
     [--set data.root=... ...]

Uses the same class-disjoint split and evaluation images as the trainer, so
the numbers compare directly with a run's final Recall@1.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from pksampler.train.config.load import RunConfig, load_config
from pksampler.train.runtime.distributed import Backend
from pksampler.train.evaluation.metrics import retrieval_metrics
from pksampler.train.modeling.model import build_model
from pksampler.train.builders import build_data
from pksampler.train.evaluation.heldout import embed

__all__ = ["baseline_rows", "format_rows", "load_model_state"]

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = (("R@1", "recall_at_1"), ("R@5", "recall_at_5"), ("R@10", "recall_at_10"), ("MAP@R", "map_at_r"))


def load_model_state(path: Path) -> Mapping[str, torch.Tensor]:
    """The ``model`` entry of a checkpoint, read with ``weights_only=True`` (nothing in the file executes)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ValueError(f"checkpoint {path} cannot be read with torch.load(weights_only=True): {error}") from None
    if not isinstance(state, Mapping) or "model" not in state:
        raise ValueError(f"checkpoint {path} has no 'model' entry (keys: {sorted(state) if isinstance(state, Mapping) else type(state).__name__})")
    return state["model"]


def baseline_rows(config: RunConfig, checkpoint: Path | None = None,
                  trained_name: str | None = None) -> tuple[dict[str, dict[str, float]], np.ndarray]:
    """Metrics of raw pixels (cosine), the untrained network and, if given, the checkpoint's model.

    Returns the rows by name and the held-out labels.
    """
    data = build_data(config)
    test_set, view = data.test, data.view
    labels = test_set.labels
    # The model's input (uint8 square from the worker, centre crop, normalised), flattened.
    pixels = np.stack([view(test_set[i][0][None]).reshape(-1).numpy() for i in range(len(test_set))])
    rows = {"raw pixels (cosine)": retrieval_metrics(pixels, labels)}
    torch.manual_seed(config.seed)
    model = build_model(config.model)
    rows["untrained network"] = retrieval_metrics(embed(model, test_set, Backend(), view=view), labels)
    if checkpoint is not None:
        model.load_state_dict(load_model_state(checkpoint))
        rows[trained_name or f"trained ({checkpoint.name})"] = retrieval_metrics(
            embed(model, test_set, Backend(), view=view), labels)
    return rows, labels


def format_rows(rows: Mapping[str, Mapping[str, float]], markdown: bool = False) -> str:
    """The rows as a fixed-width table, or as a Markdown table."""
    if markdown:
        lines = ["| embedding | " + " | ".join(c for c, _ in COLUMNS) + " |", "| --- " * (len(COLUMNS) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(f"{m[k]:.3f}" for _, k in COLUMNS) + " |" for name, m in rows.items()]
        return "\n".join(lines)
    lines = [f"{'embedding':34s} " + " ".join(f"{c:>7s}" for c, _ in COLUMNS)]
    lines += [f"{name:34s} " + " ".join(f"{m[k]:7.4f}" for _, k in COLUMNS) for name, m in rows.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    config = load_config(args.config, args.overrides, environ={})
    torch.set_num_threads(2)
    rows, labels = baseline_rows(config, args.checkpoint)
    print(f"held-out classes: {np.unique(labels).size}, images: {labels.size}")
    print(format_rows(rows))


if __name__ == "__main__":
    main()

"""Held-out-class retrieval of the demo data: raw pixels, an untrained network, a trained checkpoint.

Run: .venv/bin/python benchmarks/baselines.py [--config configs/demo.yaml] [--checkpoint workspace/demo/checkpoints/best.pt]

Uses the same class-disjoint split and evaluation images as the trainer, so
the numbers compare directly with the demo's final Recall@1.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from pksampler.train.config import load_config
from pksampler.train.distributed import Backend
from pksampler.train.evaluate import retrieval_metrics
from pksampler.train.model import build_model
from pksampler.train.trainer import build_data, embed

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    parser.add_argument("--checkpoint", type=Path, default=None)
    args = parser.parse_args()
    config = load_config(args.config, environ={})
    torch.set_num_threads(2)
    _, _, test_set = build_data(config)
    labels = test_set.labels
    pixels = np.stack([test_set[i][0].reshape(-1).numpy() for i in range(len(test_set))])
    rows = {"raw pixels (cosine)": retrieval_metrics(pixels, labels)}
    torch.manual_seed(config.seed)
    model = build_model(config.model)
    rows["untrained network"] = retrieval_metrics(embed(model, test_set, Backend()), labels)
    if args.checkpoint is not None:
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        rows[f"trained ({args.checkpoint.name})"] = retrieval_metrics(embed(model, test_set, Backend()), labels)
    print(f"held-out classes: {np.unique(labels).size}, images: {labels.size}")
    print(f"{'embedding':28s} {'R@1':>7s} {'R@5':>7s} {'R@10':>7s} {'MAP@R':>7s}")
    for name, m in rows.items():
        print(f"{name:28s} {m['recall_at_1']:7.4f} {m['recall_at_5']:7.4f} {m['recall_at_10']:7.4f} {m['map_at_r']:7.4f}")


if __name__ == "__main__":
    main()

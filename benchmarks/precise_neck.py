"""Whether recomputing the neck's running statistics before an evaluation (PreciseBN) helps retrieval.

Run: .venv/bin/python benchmarks/precise_neck.py [--epochs 6] [--batches 4,16] [--workspace DIR] [--set key=value ...]

Trains configs/folder.yaml's model, loss and head keys on the demo data in
one process and, after each epoch, embeds the held-out classes three ways:
with the neck's running statistics (the exponential average the training
leaves, what evaluation and export read) and with statistics recomputed under
the current weights over ``--batches`` batches of 64 training images (no
augmentation; the mean of the batches' means and unbiased variances, as
detectron2's ``PreciseBN``). Prints, per epoch and way, Recall@1, the mean
cosine between held-out embeddings (the shared direction) and the effective
rank. The neck's statistics are those of the global batch at every world
size, so one process answers for all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_runs import folder_keys  # noqa: E402

from pksampler.datasets import LabelledSubset  # noqa: E402
from pksampler.train.builders import build_data  # noqa: E402
from pksampler.train.config.load import load_config  # noqa: E402
from pksampler.train.engine.hooks import HookBase  # noqa: E402
from pksampler.train.evaluation.collapse import collapse_metrics  # noqa: E402
from pksampler.train.evaluation.heldout import embed  # noqa: E402
from pksampler.train.evaluation.metrics import retrieval_metrics  # noqa: E402
from pksampler.train.run_setup import train  # noqa: E402
from pksampler.train.runtime.distributed import Backend  # noqa: E402


def features(model: torch.nn.Module, subset, view) -> torch.Tensor:
    """The pre-neck embeddings of ``subset`` (the projection's output, caught on its way to the neck)."""
    caught: list[torch.Tensor] = []
    handle = model.head.register_forward_hook(lambda module, inputs, output: caught.append(output.detach()))
    embed(model, subset, Backend(), view=view)
    handle.remove()
    return torch.cat(caught)


def finish(neck: torch.nn.BatchNorm1d, pre: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> np.ndarray:
    """The embedding with the neck's affine part and the given statistics, L2-normalised."""
    scaled = (pre - mean) / torch.sqrt(var + neck.eps) * neck.weight.detach() + neck.bias.detach()
    return torch.nn.functional.normalize(scaled, dim=1).numpy()


def score(embeddings: np.ndarray, labels: np.ndarray) -> list[float]:
    """Recall@1, mean cosine, effective rank."""
    collapse = collapse_metrics(embeddings, labels)
    return [round(float(retrieval_metrics(embeddings, labels, ks=(1,))["recall_at_1"]), 4),
            round(float(collapse["mean_cosine"]), 4), round(float(collapse["effective_rank"]), 1)]


class PreciseProbe(HookBase):
    """After each epoch: the held-out scores with the running statistics and with recomputed ones."""

    def __init__(self, data, batches: list[int]) -> None:
        self.data, self.batches = data, batches

    def after_epoch(self) -> None:
        data, model = self.data, self.trainer.parts.model
        plain = LabelledSubset(data.dataset, data.train.indices, transform=data.test.transform)
        test, seen = features(model, data.test, data.view), features(model, plain, data.view)
        labels, neck = np.asarray(data.test.labels), model.neck
        row = {"epoch": self.trainer.state.epoch, "step": self.trainer.state.global_step,
               "running": score(finish(neck, test, neck.running_mean, neck.running_var), labels)}
        generator = np.random.default_rng(0)
        for count in self.batches:
            picks = [generator.choice(len(seen), 64, replace=False) for _ in range(count)]
            mean = torch.stack([seen[p].mean(0) for p in picks]).mean(0)
            var = torch.stack([seen[p].var(0) for p in picks]).mean(0)
            row[f"precise_{count}"] = score(finish(neck, test, mean, var), labels)
        print("[precise_neck]", json.dumps(row), flush=True)
        model.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batches", default="4,16", help="training batches of 64 the statistics are recomputed over")
    parser.add_argument("--workspace", type=Path, default=Path("workspace/precise_neck"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    config = load_config(None, [*folder_keys(), f"workspace={args.workspace}", f"train.epochs={args.epochs}",
                                "train.eval_every=1000", "train.checkpoint_every=0", "train.tensorboard=false",
                                "data.workers=0", "train.resume=false", *args.overrides], environ={})
    data = build_data(config)
    train(config, Backend(), extra_hooks=[PreciseProbe(data, [int(b) for b in args.batches.split(",")])])


if __name__ == "__main__":
    main()

"""How much a rounding-sized change of the starting weights moves the loss trace, with and without the BNNeck.

Run: .venv/bin/python benchmarks/bnneck_sensitivity.py [--eps 1e-7] [--elastic-head]

Trains the tiny sharded-head config of tests/distributed/test_sharded_head.py
(7 steps of 18 images, ArcFace with sub-centres) in one process four times:
with and without ``head.bnneck``, each from the seeded weights and from the
same weights scaled by ``1 + eps * N(0, 1)`` (``eps`` the size of fp32
rounding, which another summation order gives). Prints the relative change
of the loss at each step. It tells a world-size bug from the training's own
sensitivity: the trace at W = 2 or 3 may drift only as far as this.

``--elastic-head`` measures the run of the elastic head tests instead
(tests/distributed/test_elastic.py ``HEAD_SETTINGS``: the demo data, 12 SGD
steps, CosFace beside the pair loss, no BNNeck), with and without the model's
BatchNorm neck on the gathered batch (``model.neck: batch``, configs/folder.yaml's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "distributed"))
from test_elastic import HEAD_SETTINGS  # noqa: E402
from test_sharded_head import CONFIG  # noqa: E402

from pksampler.train import main as train  # noqa: E402
from pksampler.train.config.load import build_config, load_config  # noqa: E402
from pksampler.train.engine.trainer import HookBase  # noqa: E402


class ScaleWeights(HookBase):
    """Before the first step, scale every model parameter by ``1 + eps * N(0, 1)`` (a fixed draw)."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def before_train(self) -> None:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter in self.trainer.parts.model.parameters():
                parameter.mul_(1 + self.eps * torch.randn(parameter.shape, generator=generator))


def trace(neck: bool, eps: float, workspace: Path, *, elastic_head: bool = False) -> list[float]:
    """The step losses of one run: with or without the head's BNNeck, or (``elastic_head``) the model's neck."""
    if elastic_head:
        config = load_config(ROOT / "configs" / "demo.yaml",
                             [*HEAD_SETTINGS, f"model.neck={'batch' if neck else 'none'}", f"workspace={workspace}"])
    else:
        config = build_config({**CONFIG, "head": {**CONFIG["head"], "bnneck": neck}, "workspace": str(workspace)})
    train(config, [ScaleWeights(eps)])
    lines = (workspace / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if record["type"] == "step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eps", type=float, default=1e-7)
    parser.add_argument("--elastic-head", action="store_true",
                        help="the elastic head tests' run, with and without the model's neck (model.neck: batch)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for neck in (True, False):
            seeded, moved = (trace(neck, eps, Path(folder) / f"{neck}-{eps}", elastic_head=args.elastic_head)
                             for eps in (0.0, args.eps))
            change = [abs(a - b) / abs(a) for a, b in zip(seeded, moved)]
            cells = " | ".join(f"{c:.1e}" for c in change)
            rows.append(f"| {'with' if neck else 'without'} the neck | {cells} |")
    steps = len(change)
    print(f"relative change of the loss after scaling the weights by 1 + {args.eps:g} * N(0, 1)\n")
    print("| step | " + " | ".join(str(s) for s in range(1, steps + 1)) + " |")
    print("| --- |" + " --- |" * steps)
    print("\n".join(rows))


if __name__ == "__main__":
    main()

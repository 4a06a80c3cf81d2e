"""How much a rounding-sized change of the starting weights moves the loss trace, with and without the BNNeck.

Run: .venv/bin/python benchmarks/bnneck_sensitivity.py [--eps 1e-7] [--elastic-head | --head-knobs [KNOB ...]]
     [--dtype float64]

Trains the tiny sharded-head config of tests/distributed/test_global_neck.py (HEAD_TINY)
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

``--head-knobs`` finds which part of the head's defaults amplifies the
change: the ``head_fp64`` run of tests/distributed/test_global_neck.py in float32
(``head.name=arcface``, every other head key its default: the BNNeck, weight 1;
12 SGD steps on the demo data) with one knob turned at a time. For each knob
it prints the relative distance of the network's weights and of the head's
rows from the unperturbed run after steps 4, 8 and 12, the network's
per-step growth factor over the 12 steps, the largest relative change of the
loss, and the mean L2 norm of the network's gradient.

``--dtype float64`` trains every run in float64 (tests/distributed/trace_runs.py's
``computing_in``): whether a difference of any size grows, or only one large
enough to flip the training's switches (a ReLU, a mined pair).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "distributed"))
from test_elastic import HEAD_SETTINGS  # noqa: E402
from test_global_neck import COMMON  # noqa: E402
from test_global_neck import HEAD_TINY as CONFIG  # noqa: E402
from trace_runs import computing_in  # noqa: E402

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
                parameter.mul_(1 + self.eps * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


def step_losses(workspace: Path) -> list[float]:
    """The loss of every step a run wrote to ``metrics.jsonl``."""
    lines = (workspace / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if record["type"] == "step"]


def trace(neck: bool, eps: float, workspace: Path, *, elastic_head: bool = False) -> list[float]:
    """The step losses of one run: with or without the head's BNNeck, or (``elastic_head``) the model's neck."""
    if elastic_head:
        config = load_config(ROOT / "configs" / "demo.yaml",
                             [*HEAD_SETTINGS, "head.bnneck=false", f"model.neck={'batch' if neck else 'none'}",
                              f"workspace={workspace}"])
    else:
        config = build_config({**CONFIG, "head": {**CONFIG["head"], "bnneck": neck}, "workspace": str(workspace)})
    train(config, [ScaleWeights(eps)])
    return step_losses(workspace)


class Recorder(HookBase):
    """Copies of the network's weights and the head's rows before the first step and after each; the network's
    gradient norm at each optimizer step. ``patch(trainer)`` turns a knob that no config key reaches first."""

    def __init__(self, patch: Callable[[Any], None] | None = None) -> None:
        self.patch, self.weights, self.rows, self.grad_norms = patch, [], [], []

    def _record(self) -> None:
        parts = self.trainer.parts
        self.weights.append(torch.cat([p.detach().flatten() for p in parts.model.parameters()]))
        head = getattr(parts.loss_fn, "head", None)  # none for the pair loss alone
        self.rows.append(head.rows.detach().flatten().clone() if head is not None else torch.zeros(0))

    def before_train(self) -> None:
        if self.patch is not None:
            self.patch(self.trainer)
        params = list(self.trainer.parts.model.parameters())
        self.trainer.parts.optimizer.register_step_pre_hook(lambda *_: self.grad_norms.append(float(
            torch.cat([p.grad.flatten() for p in params if p.grad is not None]).norm())))
        self._record()

    def after_step(self) -> None:
        self._record()


def _with_neck(set_up: Callable[[Any], None]) -> Callable[[Any], None]:
    return lambda trainer: set_up(trainer.parts.loss_fn.neck.norm)


def _scale_rows(factor: float) -> Callable[[Any], None]:
    def scale(trainer: Any) -> None:
        with torch.no_grad():
            trainer.parts.loss_fn.head.rows.mul_(factor)
    return scale


#: knob -> (--set overrides on top of head.name=arcface, a patch of the built parts or None)
KNOBS: dict[str, tuple[list[str], Callable[[Any], None] | None]] = {
    "the head's defaults (BNNeck, head.weight 1)": ([], None),
    "the BNNeck's scale frozen at 1 (no affine)": ([], _with_neck(lambda norm: norm.weight.requires_grad_(False))),
    "the BNNeck's eps 0.1": ([], _with_neck(lambda norm: setattr(norm, "eps", 0.1))),
    "head.lr 0.01": (["head.lr=0.01"], None),
    "head.momentum 0": (["head.momentum=0"], None),
    "rows start at length ~0.8 (x10)": ([], _scale_rows(10.0)),
    "rows start at length ~8 (x100: turn ~10^4 slower)": ([], _scale_rows(100.0)),
    "the margin from step 1 (softmax_steps 0, no ramp)": (["head.softmax_steps=0", "head.margin_ramp_steps=0"], None),
    "head.scale 5 (default 10)": (["head.scale=5"], None),
    "optim.lr 0.001 (the network's rate / 4)": (["optim.lr=0.001"], None),
    "optim.clip_grad_norm 5 (insightface's)": (["optim.clip_grad_norm=5"], None),
    "optim.clip_grad_norm 1": (["optim.clip_grad_norm=1"], None),
    "head.weight 0.3": (["head.weight=0.3"], None),
    "head.weight 0.1": (["head.weight=0.1"], None),
    "no neck (head.bnneck=false)": (["head.bnneck=false"], None),
    "the neck in the model (model.neck=batch head.bnneck=false)": (["model.neck=batch", "head.bnneck=false"], None),
    "the neck in the model, head.weight 0.1 (folder.yaml's head)":
        (["model.neck=batch", "head.bnneck=false", "head.weight=0.1"], None),
    "the head alone (loss.weight 0: no mined pairs)": (["loss.weight=0"], None),
    "the pair loss alone (head.name=null)": (["head.name=null"], None),
    "AdamW (the recipe's optimiser) at its rate 0.004": (["optim.name=adamw"], None),
    "AdamW, the pair loss alone": (["optim.name=adamw", "head.name=null"], None),
    "AdamW, optim.clip_grad_norm 5": (["optim.name=adamw", "optim.clip_grad_norm=5"], None),
}


def knob_run(sets: list[str], patch: Callable[[Any], None] | None, eps: float, workspace: Path
             ) -> tuple[list[float], Recorder]:
    """The step losses and the recorder of one run of the trace test's ``head`` config with a knob."""
    config = load_config(None, [*COMMON, "head.name=arcface", *sets, f"workspace={workspace}"], environ={})
    recorder = Recorder(patch)
    hooks = [ScaleWeights(eps), recorder] if eps else [recorder]
    train(config, hooks)
    return step_losses(workspace), recorder


def knob_row(name: str, eps: float, folder: Path) -> str:
    """One knob's table row: the unperturbed run against the one whose weights were scaled by 1 + eps N(0, 1)."""
    sets, patch = KNOBS[name]
    (seeded, a), (moved, b) = (knob_run(sets, patch, e, folder / f"{len(list(folder.iterdir()))}") for e in (0.0, eps))

    def distance(first: list[torch.Tensor], second: list[torch.Tensor], step: int) -> float:
        return float((first[step] - second[step]).norm() / first[step].norm().clamp_min(1e-30))

    start, *network = (distance(a.weights, b.weights, step) for step in (0, 4, 8, 12))
    growth = (network[-1] / start) ** (1 / 12)
    rows = distance(a.rows, b.rows, 12) if a.rows[0].numel() else 0.0
    loss = max(abs(x - y) / abs(x) for x, y in zip(seeded, moved))
    cells = [*(f"{value:.1e}" for value in network), f"{growth:.2f}", f"{rows:.1e}", f"{loss:.1e}",
             f"{sum(a.grad_norms) / len(a.grad_norms):.2g}"]
    return f"| {name} | " + " | ".join(cells) + " |"


def head_knobs(names: list[str], eps: float) -> None:
    """Print the knob table (``names``: a subset of :data:`KNOBS`; empty: all)."""
    unknown = [name for name in names if name not in KNOBS]
    if unknown:
        raise SystemExit(f"--head-knobs: unknown knob {unknown[0]!r}; choose from {list(KNOBS)}")
    print(f"the trace test's head run, weights scaled by 1 + {eps:g} * N(0, 1): relative distance from the "
          "unperturbed run\n")
    print("| knob | network, step 4 | step 8 | step 12 | growth a step (0-12) | rows, step 12 | loss, largest "
          "| network gradient norm |")
    print("| --- |" + " --- |" * 7)
    with tempfile.TemporaryDirectory() as folder:
        for name in names or KNOBS:
            print(knob_row(name, eps, Path(folder)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eps", type=float, default=1e-7)
    parser.add_argument("--elastic-head", action="store_true",
                        help="the elastic head tests' run, with and without the model's neck (model.neck: batch)")
    parser.add_argument("--head-knobs", nargs="*", default=None, metavar="KNOB",
                        help="the trace test's head run with each knob (default: every knob)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="with --head-knobs: the precision every run trains in")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.head_knobs is not None:
        with computing_in(None if args.dtype == "float32" else args.dtype):
            head_knobs(args.head_knobs, args.eps)
        return
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

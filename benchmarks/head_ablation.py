"""Head only, pair loss only, head + pair: three arms on the typeface set under one P×K sampler and step budget.

Run: .venv/bin/python benchmarks/head_ablation.py [--classes 1000] [--config configs/folder.yaml] [--np 2]
     [--head arcface] [--set key=value ...]

Builds the cross-typeface character set (``sets/make_typeface_images.py``,
as benchmarks/typeface_retrieval.py), then trains ``--config`` three times
from scratch with ``horovodrun -np N`` and the same sampler, model,
optimiser, global batch and number of steps, changing only the loss:

* ``pair``: the config's pair loss (``head.name: null``);
* ``head``: the sharded margin head alone (``head.name``, ``loss.weight: 0``);
* ``head + pair``: both (``loss.weight: 1``, ``head.weight: 1``).

Each final model (``last.pt``) is evaluated on the same held-out classes
(the trainer's class-disjoint split): Recall@1, Recall@5 and MAP@R, in one
table with the raw pixels, written to ``<workspace>/head_ablation.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "sets"))
from make_typeface_images import make_typeface_images  # noqa: E402
from typeface_retrieval import ROOT, evaluate, run_training, train_command  # noqa: E402

from pksampler.files import atomic_write_text  # noqa: E402
from pksampler.train.config.load import load_config  # noqa: E402


def arms(head: str) -> dict[str, list[str]]:
    """Each arm's overrides on top of the config."""
    return {"pair": ["head.name=null"],
            "head": [f"head.name={head}", "loss.weight=0"],
            "head + pair": [f"head.name={head}", "loss.weight=1"]}


def table(rows: dict[str, dict[str, float]], timings: dict[str, tuple[float, float]]) -> str:
    lines = ["| arm | R@1 | R@5 | MAP@R | train wall / CPU |", "| --- | --- | --- | --- | --- |"]
    for name, metrics in rows.items():
        wall = timings.get(name)
        lines.append(f"| {name} | {metrics['recall_at_1']:.3f} | {metrics['recall_at_5']:.3f} | "
                     f"{metrics['map_at_r']:.3f} | {f'{wall[0]:.0f} s / {wall[1]:.0f} s' if wall else '–'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "folder.yaml")
    parser.add_argument("--np", dest="np_", type=int, default=2)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--head", default="arcface", choices=("arcface", "cosface", "softmax"))
    parser.add_argument("--workspace", type=Path, default=ROOT / "workspace" / "typefaces" / "head_ablation")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--skip-training", action="store_true", help="evaluate the arms' existing last.pt")
    args = parser.parse_args()
    if args.np_ < 1:
        raise SystemExit(f"--np must be >= 1, got {args.np_}")
    data = ROOT / "workspace" / "typefaces" / f"c{args.classes}"
    make_typeface_images(data, classes=args.classes, size=args.size, seed=args.data_seed)
    base = [f"data.root={data.resolve()}", *args.overrides]
    config = load_config(args.config, base, environ={})
    torch.set_num_threads(2)
    timings, checkpoints = {}, {}
    for index, (name, overrides) in enumerate(arms(args.head).items()):
        workspace = (args.workspace / f"arm{index}").resolve()
        if not args.skip_training:
            command = train_command("pk", args.config, args.np_, [*base, *overrides, f"workspace={workspace}"])
            timings[name] = run_training(command)
        checkpoints[name] = workspace / "checkpoints" / "last.pt"
    rows, labels = evaluate(config, checkpoints)
    print(f"\n{args.head} head; held-out images: {labels.size}; global batch {config.sampler.classes_per_step} x "
          f"{config.sampler.samples_per_class}; overrides {args.overrides}\n")
    print(table(rows, timings))
    atomic_write_text(args.workspace / "head_ablation.json", json.dumps(
        {"rows": rows, "timings": timings, "np": args.np_, "classes": args.classes, "head": args.head,
         "overrides": args.overrides}, indent=2))


if __name__ == "__main__":
    main()

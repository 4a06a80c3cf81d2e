"""Continue last week's model on this week's classes: imprinted rows, random rows, or from scratch.

Run: nice -n 10 .venv/bin/python benchmarks/grow.py [--classes 300] [--fraction 0.7] [--week1-steps 400]
     [--steps 600] [--continue-steps 200] [--parallel 2] [--set key=value ...] [--extra-arm NAME] [--report-only]

Builds the typeface set (``sets/make_typeface_images.py``, ``--classes``
characters, one capture per typeface), splits its classes by name
(``data.split_by: name``, so week 1 and week 2 hold out the same classes) and
keeps one image of every training class out of training
(``data.heldout_images: 1``, the image-level queries: a known character in a
typeface the model did not train on). Week 1 trains ``--config`` on
``--fraction`` of the training classes (every held-out class kept, so both
weeks are evaluated on the same ones), then week 2, on all of them:

* ``scratch``: from scratch, ``--steps`` global steps;
* ``imprint``: ``train.init_from`` week 1's ``last.pt``, new rows imprinted, ``--continue-steps``;
* ``random``: the same with ``train.init_rows: random``.

Every arm evaluates every epoch (a continued arm also before its first step).
Prints and writes ``<workspace>/grow.json`` (the table) and ``grow.png`` (R@1
class-disjoint, image-level, and the known classes' image-level R@1 against
steps).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "sets"))
from class_rich_sets import class_rich_set  # noqa: E402
from head_ablation import train_arms  # noqa: E402
from typeface_retrieval import ROOT, train_command  # noqa: E402

from pksampler.datasets import ImageFolderDataset, class_disjoint_split_by_name, name_keys  # noqa: E402
from pksampler.files import atomic_write_bytes, atomic_write_text  # noqa: E402

#: the curves drawn, one panel each
PANELS = (("recall_at_1", "R@1, held-out classes"), ("image_recall_at_1", "R@1, held-out images of training classes"),
          ("image_known_recall_at_1", "R@1, held-out images of week-1 classes"))


def week1_folder(full: Path, out: Path, *, fraction: float, test_fraction: float) -> tuple[int, int]:
    """A copy of ``full`` with ``fraction`` of its training classes (by a key of their names) and every held-out
    class; (week-1 training classes, all training classes)."""
    dataset = ImageFolderDataset(full)
    names = dataset.classes
    _, test = class_disjoint_split_by_name(dataset.labels, names, test_fraction, 0)
    test_classes = set(np.unique(dataset.labels[test]).tolist())
    training = [c for c in range(len(names)) if c not in test_classes]
    keys = name_keys([names[c] for c in training], seed=1)
    kept = [training[i] for i in np.argsort(keys)[:round(fraction * len(training))]]
    if not (out / ".complete").is_file():
        shutil.rmtree(out, ignore_errors=True)
        for code in sorted(test_classes | set(kept)):
            shutil.copytree(full / names[code], out / names[code])
        (out / ".complete").write_text("")
    return len(kept), len(training)


def curves(workspace: Path) -> list[dict]:
    """The eval records of one run's metrics.jsonl."""
    lines = (workspace / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record.get("type") == "eval"]


def summary(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per arm: final metrics; for a continued arm the steps to reach scratch's final R@1s and the known classes'
    largest image-level fall below their step-0 value."""
    target = runs["scratch"][-1]
    table = {}
    for arm, records in runs.items():
        last = records[-1]
        row = {key: last.get(key) for key in ("global_step", "recall_at_1", "map_at_r", "image_recall_at_1",
                                              "image_known_recall_at_1", "image_new_recall_at_1")}
        if arm != "scratch":
            for key in ("recall_at_1", "image_recall_at_1"):
                reached = [r["global_step"] for r in records if r[key] >= target[key]]
                row[f"steps_to_scratch_{key}"] = reached[0] if reached else None
            known = [r["image_known_recall_at_1"] for r in records]
            row["image_known_start"] = known[0]
            row["image_known_largest_fall"] = max(0.0, known[0] - min(known))
        table[arm] = row
    return table


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.8))
    colours = {arm: f"C{number}" for number, arm in enumerate(runs)}  # an arm's colour in every panel
    for axis, (key, title) in zip(axes, PANELS):
        for arm, records in runs.items():
            points = [(r["global_step"], r[key]) for r in records if key in r]
            if points:
                axis.plot(*zip(*points), marker="o", markersize=3, label=arm, color=colours[arm])
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("global steps (week 2)")
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    atomic_write_bytes(path, buffer.getvalue())


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "folder.yaml")
    parser.add_argument("--classes", type=int, default=300)
    parser.add_argument("--fraction", type=float, default=0.7)
    parser.add_argument("--week1-steps", type=int, default=400)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--continue-steps", type=int, default=None, help="default: a third of --steps")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--workspace", type=Path, default=ROOT / "workspace" / "grow")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--extra-arm", dest="extra", action="append", default=[], metavar="NAME",
                        help="also report the run in <workspace>/NAME (a continued arm trained apart)")
    parser.add_argument("--report-only", action="store_true", help="train nothing: the table and PNG of the runs")
    return parser.parse_args()


def main() -> None:
    args = parse()
    full = class_rich_set(ROOT / "workspace", "typefaces", classes=args.classes)
    week1 = args.workspace / "week1_images"
    known, training = week1_folder(full, week1, fraction=args.fraction, test_fraction=0.3)
    print(f"week 1: {known} of {training} training classes", flush=True)
    # the head the rows are imprinted into: folder.yaml's light ArcFace head, which the file leaves off
    common = ["head.name=arcface", "data.split_by=name", "data.heldout_images=1", "data.test_fraction=0.3", "train.eval_every=1",
              "train.tensorboard=false", *args.overrides]

    def command(arm: str, root: Path, steps: int, extra: list[str]) -> list[str]:
        return train_command("pk", args.config, 1, [*common, f"data.root={root}", f"train.steps={steps}",
                                                    f"workspace={args.workspace / arm}", *extra])

    continued = args.continue_steps or args.steps // 3
    start = args.workspace / "week1" / "checkpoints" / "last.pt"
    if not args.report_only:
        train_arms({"week1": command("week1", week1, args.week1_steps, []),
                    "scratch": command("scratch", full, args.steps, [])}, args.parallel)
        train_arms({arm: command(arm, full, continued, [f"train.init_from={start}", f"train.init_rows={arm}"])
                    for arm in ("imprint", "random")}, args.parallel)
    runs = {arm: curves(args.workspace / arm) for arm in ("scratch", "imprint", "random", *args.extra)}
    table = summary(runs)
    print(json.dumps(table, indent=2))
    atomic_write_text(args.workspace / "grow.json", json.dumps({"table": table, "curves": runs,
                                                                "week1_classes": known, "classes": training}, indent=1))
    plot(runs, args.workspace / "grow.png")


if __name__ == "__main__":
    main()

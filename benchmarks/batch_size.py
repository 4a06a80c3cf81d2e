"""Global batch size at equal images: G x K = 64, 256 and 1,024, held-out R@1 and MAP@R as training goes.

Run (the numbers on docs/large-batches.md, "Batch size at equal epochs"):

    .venv/bin/python benchmarks/batch_size.py --arms 64,256,1024 --epochs 60 --size 32 --parallel 2

Steps:

1. Build the set unless it is there already: ``--data typefaces``
   (``sets/make_typeface_images.py``, ``--classes`` characters, one capture
   per typeface) or ``--data photos`` (``sets/make_real_images.py``,
   ``--classes`` regions of real photographs × ``--views`` captures), 64 px.
2. Train ``--config`` (default ``configs/folder.yaml``) once per arm, from
   scratch, in one process each (``distributed.backend=none``, one torch
   thread; runs are bit for bit the same at ``-np 1`` and ``-np 2``, so
   ``--parallel`` arms share the machine's cores). An arm is ``B`` or
   ``B:optimizer`` (``1024:lamb``): ``sampler.classes_per_step = B / K``,
   every arm the same ``train.epochs`` (so the same images), the same
   ``optim.lr`` stated for ``optim.base_batch = 64`` and moved to B by the
   optimizer's rule (``optim.scaling: auto``: √ for AdamW and LAMB, linear
   for SGD and LARS), and the same warm-up share of the run
   (``--warmup-fraction``). The held-out evaluation runs every
   ``epochs / --evals`` epochs.
3. Read every arm's ``metrics.jsonl``: R@1 and MAP@R against images seen
   (global steps x B); write ``batch_size.json`` and ``batch_size.png`` (R@1
   against images seen, one curve per arm) under ``--workspace``, and print
   the table: final R@1 and MAP@R, and R@1 as a share of the first arm's.

``--skip-training`` re-reads finished runs. A run that is cut off leaves its
arm out of the table, with its log under the workspace.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent / "sets"))
from class_rich_sets import DEFAULT_CLASSES, class_rich_set  # noqa: E402

from pksampler.files import atomic_write_bytes, atomic_write_text  # noqa: E402
from pksampler.train.config.load import load_config  # noqa: E402
from pksampler.train.solver.build import learning_rate, warmup_length  # noqa: E402


@dataclass(frozen=True)
class Arm:
    """One training run: ``batch`` images per global step with ``optimizer``."""

    batch: int
    optimizer: str

    @property
    def name(self) -> str:
        return f"b{self.batch}_{self.optimizer}"


def parse_arms(text: str, default_optimizer: str, samples_per_class: int) -> list[Arm]:
    """``"64,256,1024:lamb"`` -> arms; every B a positive multiple of K."""
    arms = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        batch, _, optimizer = item.partition(":")
        if not batch.isdigit() or int(batch) <= 0 or int(batch) % samples_per_class:
            raise SystemExit(f"--arms: {item!r}: the batch must be a positive multiple of K={samples_per_class}")
        arms.append(Arm(int(batch), optimizer or default_optimizer))
    if not arms:
        raise SystemExit(f"--arms: no arm in {text!r}")
    return arms


def arm_overrides(arm: Arm, args: argparse.Namespace, data: Path, samples_per_class: int) -> list[str]:
    """The ``--set`` items of one arm: its batch and optimizer; everything else shared."""
    return [f"data.root={data.resolve()}", f"data.image_size={args.size}",
            f"sampler.classes_per_step={arm.batch // samples_per_class}", f"optim.name={arm.optimizer}",
            f"optim.lr={args.lr}", "optim.base_batch=64", f"optim.warmup_fraction={args.warmup_fraction}",
            f"train.epochs={args.epochs}", f"train.eval_every={max(1, args.epochs // args.evals)}",
            "train.checkpoint_every=0", "train.tensorboard=false", "distributed.backend=none", "data.workers=0",
            f"workspace={(args.workspace / arm.name).resolve()}", *args.overrides]


def data_folder(args: argparse.Namespace) -> Path:
    """The set's folder (made at 64 px unless it is complete already); fills in ``args.classes``."""
    args.classes = args.classes or DEFAULT_CLASSES[args.data]
    return class_rich_set(ROOT / "workspace", args.data, classes=args.classes, views=args.views)


def launch(arm: Arm, overrides: list[str], config: Path, log: Path) -> subprocess.Popen:
    """Start one arm's training in its own process (one torch thread), its output in ``log``."""
    command = [sys.executable, str(ROOT / "train" / "retrieval.py"), "--config", str(config), "--no-resume"]
    command += [item for text in overrides for item in ("--set", text)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("DATASETS_PATH", "DATASETS", "WORKSPACE"):
        env.pop(key, None)
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"{arm.name}: {' '.join(command)}", flush=True)
    with log.open("w") as handle:
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def run_arms(arms: list[Arm], plans: dict[str, list[str]], config: Path, workspace: Path, parallel: int) -> dict:
    """Run the arms, ``parallel`` at a time; return each arm's wall seconds and exit status."""
    pending, running, done = list(arms), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            arm = pending.pop(0)
            running[arm.name] = (launch(arm, plans[arm.name], config, workspace / f"{arm.name}.log"), time.time())
        for name, (process, start) in list(running.items()):
            if process.poll() is not None:
                done[name] = {"seconds": time.time() - start, "returncode": process.returncode}
                print(f"{name}: exit {process.returncode} after {done[name]['seconds']:.0f} s", flush=True)
                del running[name]
        if running:
            try:
                next(iter(running.values()))[0].wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    return done


def read_curve(workspace: Path, batch: int) -> list[dict]:
    """The arm's evaluations: epoch, global step, images seen, R@1, MAP@R (empty when it never evaluated)."""
    path = workspace / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"epoch": r["epoch"], "global_step": r["global_step"], "images": r["global_step"] * batch,
             "recall_at_1": r["recall_at_1"], "map_at_r": r["map_at_r"]}
            for r in records if r.get("type") == "eval"]


def save_png(path: Path, curves: dict[str, list[dict]], title: str) -> None:
    """R@1 (left) and MAP@R (right) against images seen, one line per arm."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, curve in curves.items():
        images = [point["images"] / 1000 for point in curve]
        axes[0].plot(images, [point["recall_at_1"] for point in curve], marker="o", markersize=3, label=name)
        axes[1].plot(images, [point["map_at_r"] for point in curve], marker="o", markersize=3, label=name)
    for axis, label in zip(axes, ("held-out R@1", "held-out MAP@R")):
        axis.set_xlabel("training images seen (thousands)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    atomic_write_bytes(path, buffer.getvalue())


def table(rows: list[dict]) -> str:
    """The markdown table of the docs page."""
    lines = ["| G × K | optimizer | updates | peak lr | warm-up steps | R@1 | MAP@R | R@1 / first arm's | wall |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    first = rows[0]["recall_at_1"] if rows and rows[0]["recall_at_1"] else None
    for row in rows:
        share = f"{row['recall_at_1'] / first:.2f}" if first and row["recall_at_1"] is not None else "–"
        r1 = "–" if row["recall_at_1"] is None else f"{row['recall_at_1']:.3f}"
        mapr = "–" if row["map_at_r"] is None else f"{row['map_at_r']:.3f}"
        lines.append(f"| {row['batch']:,} | {row['optimizer']} | {row['updates']} | {row['lr']:.4g} | "
                     f"{row['warmup']} | {r1} | {mapr} | {share} | {row['seconds'] / 60:.0f} min |")
    return "\n".join(lines)


def summarise(arms: list[Arm], args: argparse.Namespace, plans: dict, timings: dict) -> list[dict]:
    """One row per arm: its final evaluation, its rate and warm-up as the trainer computed them."""
    rows = []
    for arm in arms:
        config = load_config(args.config, plans[arm.name], environ={})
        curve = read_curve(args.workspace / arm.name, arm.batch)
        last = curve[-1] if curve else {}
        updates = last.get("global_step", 0)
        rows.append({"arm": arm.name, "batch": arm.batch, "optimizer": arm.optimizer, "updates": updates,
                     "images": last.get("images", 0), "lr": learning_rate(config.optim, arm.batch),
                     "warmup": warmup_length(config.optim, updates) if updates else 0,
                     "recall_at_1": last.get("recall_at_1"), "map_at_r": last.get("map_at_r"),
                     "seconds": timings.get(arm.name, {}).get("seconds", math.nan), "curve": curve})
    return rows


def _previous_timings(workspace: Path) -> dict:
    """The wall times an earlier run of this script recorded (``--skip-training``), or none."""
    path = workspace / "batch_size.json"
    return json.loads(path.read_text()).get("timings", {}) if path.exists() else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "folder.yaml")
    parser.add_argument("--arms", default="64,256,1024", help="B or B:optimizer, comma-separated; first = reference")
    parser.add_argument("--optimizer", default="adamw", help="the arms' optimizer when an arm names none")
    parser.add_argument("--epochs", type=int, default=60, help="epochs of every arm (equal images)")
    parser.add_argument("--evals", type=int, default=10, help="held-out evaluations per run")
    parser.add_argument("--lr", type=float, default=0.004, help="optim.lr for 64 images per step")
    parser.add_argument("--warmup-fraction", type=float, default=0.05)
    parser.add_argument("--size", type=int, default=32, help="data.image_size (the set is made at 64 px)")
    parser.add_argument("--data", choices=("typefaces", "photos"), default="typefaces",
                        help="typefaces: --classes characters; photos: --classes regions x --views real captures")
    parser.add_argument("--classes", type=int, default=None, help="default: 1000 typefaces, 500 photos")
    parser.add_argument("--views", type=int, default=32, help="captures per class of the photos set")
    parser.add_argument("--parallel", type=int, default=2, help="arms trained at once")
    parser.add_argument("--workspace", type=Path, default=None,
                        help="default: workspace/batch_size (typefaces), workspace/batch_size_photos (photos)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--skip-training", action="store_true", help="read the finished runs only")
    args = parser.parse_args()
    args.workspace = args.workspace or ROOT / "workspace" / ("batch_size" if args.data == "typefaces" else
                                                             f"batch_size_{args.data}")
    data = data_folder(args)
    samples_per_class = load_config(args.config, [f"data.root={data.resolve()}"], environ={}).sampler.samples_per_class
    arms = parse_arms(args.arms, args.optimizer, samples_per_class)
    plans = {arm.name: arm_overrides(arm, args, data, samples_per_class) for arm in arms}
    timings = _previous_timings(args.workspace) if args.skip_training else run_arms(
        arms, plans, args.config, args.workspace, args.parallel)
    rows = summarise(arms, args, plans, timings)
    print("\n" + table(rows))
    title = (f"{args.data}, {args.classes} classes, {args.size} px, {args.epochs} epochs per arm; "
             f"lr {args.lr} at 64 images, optim.scaling auto, warm-up {args.warmup_fraction:.0%} of the run")
    save_png(args.workspace / "batch_size.png", {row["arm"]: row["curve"] for row in rows}, title)
    atomic_write_text(args.workspace / "batch_size.json", json.dumps(
        {"rows": rows, "timings": timings, "arguments": {k: str(v) for k, v in vars(args).items()}, "title": title}, indent=2))


if __name__ == "__main__":
    main()

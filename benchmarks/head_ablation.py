"""Pair loss only, head only, head + pair: arms on one data set under one P×K sampler and step budget.

Run: .venv/bin/python benchmarks/head_ablation.py [--data typefaces|photos] [--config configs/folder.yaml]
     [--np 2] [--parallel 1] [--steps N] [--head arcface] [--arms pair,head,head+pair] [--set key=value ...]
     .venv/bin/python benchmarks/head_ablation.py --merge RUN/head_ablation.json ... --workspace OUT

Builds the set (``typefaces``: the cross-typeface character set of
``sets/make_typeface_images.py``, ``--classes`` characters; ``photos``: the
real photographs of ``sets/make_real_images.py``, ``--classes`` regions ×
``--views`` captures), then trains ``--config`` once per arm from scratch
(``horovodrun -np N``; ``--parallel`` arms at once) with the same sampler,
model, optimiser, global batch and number of steps, changing only the loss:

* ``pair``: the config's pair loss (``head.name: null``);
* ``head``: the sharded margin head alone (``head.name``, ``loss.weight: 0``),
  with the head recipe's defaults (docs/sharded-head.md);
* ``head+pair``: both (``loss.weight: 1``, ``head.weight`` as the config has it: 0.1 in
  ``configs/folder.yaml``).

Each final model (``last.pt``) is evaluated on the same held-out classes (the
trainer's class-disjoint split): Recall@1, Recall@5, MAP@R, the collapse
metrics (effective rank, mean cosine all / same class / other class), for a
head with a BNNeck also the retrieval of the feature after the neck (held-out
batch statistics), and the final row norms of the head's training classes.
One table (stdout, ``<workspace>/head_ablation.json``) and one PNG of every
arm's curves (``<workspace>/head_ablation.png``: loss, R@1, mean cosines and
effective rank per evaluation, read from each arm's ``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "sets"))
from class_rich_sets import DEFAULT_CLASSES, class_rich_set  # noqa: E402
from typeface_retrieval import ROOT, run_training, train_command  # noqa: E402

from pksampler.files import atomic_write_bytes, atomic_write_text  # noqa: E402
from pksampler.train import builders  # noqa: E402
from pksampler.train.config.load import RunConfig, load_config  # noqa: E402
from pksampler.train.evaluation.collapse import collapse_metrics  # noqa: E402
from pksampler.train.evaluation.heldout import embed  # noqa: E402
from pksampler.train.evaluation.metrics import retrieval_metrics  # noqa: E402
from pksampler.train.losses.headed import saved_rows  # noqa: E402
from pksampler.train.modeling.model import build_model  # noqa: E402
from pksampler.train.modeling.range_checkpoint import located  # noqa: E402
from pksampler.train.runtime.distributed import Backend  # noqa: E402

ARMS = ("pair", "head", "head+pair")


def arms(head: str, names: list[str]) -> dict[str, list[str]]:
    """Each arm's overrides on top of the config."""
    every = {"pair": ["head.name=null"],
             "head": [f"head.name={head}", "loss.weight=0"],
             "head+pair": [f"head.name={head}", "loss.weight=1"]}
    unknown = [name for name in names if name not in every]
    if unknown:
        raise SystemExit(f"--arms: unknown arm {unknown[0]!r}; choose from {list(every)}")
    return {name: every[name] for name in names}


def data_folder(args: argparse.Namespace) -> Path:
    """The set's folder, built (or found complete) first."""
    return class_rich_set(ROOT / "workspace", args.data, classes=args.classes, views=args.views, seed=args.data_seed)


def train_arms(commands: dict[str, list[str]], parallel: int) -> dict[str, tuple[float, float]]:
    """Run the arms' commands, ``parallel`` at a time; (wall seconds, CPU seconds) each (CPU: sequential runs)."""
    if parallel <= 1:
        return {name: run_training(command) for name, command in commands.items()}
    timings, running, queue = {}, {}, list(commands.items())
    while queue or running:
        while queue and len(running) < parallel:
            name, command = queue.pop(0)
            print("$", " ".join(command), flush=True)
            running[name] = (subprocess.Popen(command, cwd=ROOT, env=_env()), time.perf_counter())
        for name, (process, started) in list(running.items()):
            if process.poll() is not None:
                if process.returncode:
                    raise SystemExit(f"arm {name!r} failed with exit status {process.returncode}")
                timings[name] = (time.perf_counter() - started, float("nan"))
                del running[name]
        time.sleep(1.0)  # polling child processes, not waiting for a result
    return timings


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ, HOROVOD_CYCLE_TIME=os.environ.get("HOROVOD_CYCLE_TIME", "10"),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for key in ("DATASETS_PATH", "DATASETS", "WORKSPACE"):
        env.pop(key, None)
    return env


def after_neck(embeddings: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """The head's feature: the embeddings batch-normalised with the held-out set's statistics (the BNNeck's
    bias is frozen at 0), times the neck's learnt scale, L2-normalised (retrieval by cosine)."""
    x = (embeddings - embeddings.mean(axis=0)) / np.sqrt(embeddings.var(axis=0) + 1e-5)
    if scale is not None:
        x = x * scale
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def row_norms(loss_state: dict[str, Any] | None, train_classes: np.ndarray) -> dict[str, float]:
    """Lengths of the head's rows of the training classes (the rows are normalised only in the forward pass)."""
    if not loss_state or "head" not in loss_state:
        return {}
    rows = saved_rows(loss_state, train_classes)  # from the range files beside the checkpoint, or inside it
    norms = rows.float().norm(dim=-1).flatten().numpy()
    return {"row_norm_mean": float(norms.mean()), "row_norm_min": float(norms.min()),
            "row_norm_max": float(norms.max())}


def evaluate_arm(config: RunConfig, checkpoint: Path, data: Any) -> dict[str, float]:
    """Retrieval, collapse metrics, the after-neck retrieval and the row norms of one arm's final model."""
    state = located(torch.load(checkpoint, map_location="cpu", weights_only=True), checkpoint)
    model = build_model(config.model)
    model.load_state_dict(state["model"])
    labels = np.asarray(data.test.labels)
    embeddings = embed(model, data.test, Backend(), view=data.view)
    embeddings = embeddings.numpy() if isinstance(embeddings, torch.Tensor) else np.asarray(embeddings)
    row = {**retrieval_metrics(embeddings, labels), **collapse_metrics(embeddings, labels)}
    neck = (state.get("loss") or {}).get("neck")
    if neck is not None:
        scale = neck["norm.weight"].numpy() if "norm.weight" in neck else None
        after = after_neck(embeddings.astype(np.float64), scale)
        row.update({f"after_neck_{k}": v for k, v in retrieval_metrics(after, labels).items()
                    if k in ("recall_at_1", "map_at_r")})
    return {**row, **row_norms(state.get("loss"), np.unique(np.asarray(data.train.labels)))}


def table(rows: dict[str, dict[str, float]], timings: dict[str, tuple[float, float]]) -> str:
    lines = ["| arm | R@1 | R@5 | MAP@R | effective rank | mean cosine all / same / other | R@1 after the neck | "
             "row norm mean (min–max) | train wall |", "| --- " * 9 + "|"]
    for name, m in rows.items():
        wall = timings.get(name)
        neck = f"{m['after_neck_recall_at_1']:.3f}" if "after_neck_recall_at_1" in m else "–"
        norms = (f"{m['row_norm_mean']:.3f} ({m['row_norm_min']:.3f}–{m['row_norm_max']:.3f})"
                 if "row_norm_mean" in m else "–")
        collapse = (f"{m['effective_rank']:.1f} | {m['mean_cosine']:.3f} / {m['mean_cosine_same']:.3f} / "
                    f"{m['mean_cosine_other']:.3f}" if "effective_rank" in m else "– | –")
        lines.append(f"| {name} | {m['recall_at_1']:.3f} | {m['recall_at_5']:.3f} | {m['map_at_r']:.3f} | {collapse} | "
                     f"{neck} | {norms} | {f'{wall[0]:.0f} s' if wall else '–'} |")
    return "\n".join(lines)


def read_curves(workspace: Path) -> dict[str, list]:
    """Steps and losses, and per evaluation the global step, R@1 and collapse metrics, from ``metrics.jsonl``."""
    curves: dict[str, list] = {"step": [], "loss": [], "eval_step": [], "recall_at_1": [], "mean_cosine_same": [],
                               "mean_cosine_other": [], "effective_rank": []}
    path = workspace / "metrics.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        record = json.loads(line)
        if record.get("type") == "step":
            curves["step"].append(record["global_step"])
            curves["loss"].append(record["loss"])
        elif record.get("type") == "eval":
            curves["eval_step"].append(record["global_step"])
            for key in ("recall_at_1", "mean_cosine_same", "mean_cosine_other", "effective_rank"):
                curves[key].append(record.get(key, float("nan")))
    return curves


def curves_png(path: Path, curves: dict[str, dict[str, list]], title: str) -> None:
    """Four panels, one line per arm: training loss (smoothed), R@1, mean cosines (same solid, other dashed),
    effective rank, against the global step."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pksampler.train.engine.plots import smooth

    figure, axes = plt.subplots(1, 4, figsize=(20, 5.5), dpi=100, layout="constrained")
    figure.suptitle(title, fontsize=13)
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
    for (name, c), colour in zip(curves.items(), colours):
        if c["step"]:
            axes[0].plot(c["step"], smooth(c["loss"]), color=colour, label=name)
        axes[1].plot(c["eval_step"], c["recall_at_1"], marker="o", color=colour, label=name)
        axes[2].plot(c["eval_step"], c["mean_cosine_same"], marker="o", color=colour, label=f"{name}: same class")
        axes[2].plot(c["eval_step"], c["mean_cosine_other"], marker="x", linestyle="--", color=colour,
                     label=f"{name}: other class")
        axes[3].plot(c["eval_step"], c["effective_rank"], marker="o", color=colour, label=name)
    for ax, label in zip(axes, ("training loss (smoothed)", "held-out Recall@1", "held-out mean cosine",
                                "effective rank of held-out embeddings")):
        ax.set_title(label)
        ax.set_xlabel("global step")
        ax.grid(True, alpha=0.3)
    # one legend of the arms under the panels (colour: arm; in the cosine panel o = same class, x = other class)
    axes[2].set_title("held-out mean cosine (o same class, x other class)")
    handles, labels = axes[1].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncol=min(3, len(labels)), fontsize=9)
    axes[1].set_ylim(0, 1.0)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    atomic_write_bytes(path, buffer.getvalue())


def merge(paths: list[Path], out: Path) -> None:
    """One table and one PNG of the arms of several earlier runs (their ``head_ablation.json``), each arm named
    with its run's head and overrides: arms trained by separate invocations, drawn together."""
    rows, curves, timings, titles = {}, {}, {}, []
    for path in paths:
        run = json.loads(path.read_text(encoding="utf-8"))
        extra = " ".join(item for item in run["overrides"] if not item.startswith("data."))
        for name, row in run["rows"].items():
            label = (name if name == "pair" else f"{name}, {run['head']}") + (f", {extra}" if extra else "")
            if label in rows:  # the same arm and overrides in two runs: keep both, numbered
                label = next(f"{label} ({n})" for n in range(2, len(rows) + 2) if f"{label} ({n})" not in rows)
            rows[label], curves[label] = row, run["curves"][name]
            if name in run["timings"]:
                timings[label] = run["timings"][name]
        titles.append(f"{run['data']}, {run['steps']} steps")
    title = f"{' / '.join(sorted(set(titles)))}: {len(rows)} arms"
    print(table(rows, timings))
    out.mkdir(parents=True, exist_ok=True)
    curves_png(out / "head_ablation.png", curves, title)
    atomic_write_text(out / "head_ablation.json", json.dumps({"rows": rows, "timings": timings, "title": title,
                                                              "merged": [str(p) for p in paths]}, indent=2))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", choices=("typefaces", "photos"), default="typefaces")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "folder.yaml")
    parser.add_argument("--np", dest="np_", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=1, help="arms trained at once")
    parser.add_argument("--steps", type=int, default=None, help="train.steps of every arm (default: the config's)")
    parser.add_argument("--classes", type=int, default=None, help="typefaces: 1000, photos: 500")
    parser.add_argument("--views", type=int, default=32, help="photos: captures per class")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--head", default="arcface", choices=("arcface", "cosface", "softmax"))
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--workspace", type=Path, default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--skip-training", action="store_true", help="evaluate the arms' existing last.pt")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                        help="draw the arms of these earlier runs' head_ablation.json together into --workspace")
    args = parser.parse_args()
    if args.np_ < 1 or args.parallel < 1:
        raise SystemExit(f"--np and --parallel must be >= 1, got {args.np_} and {args.parallel}")
    args.classes = args.classes or DEFAULT_CLASSES[args.data]
    args.workspace = args.workspace or ROOT / "workspace" / f"head_ablation_{args.data}"
    return args


def main() -> None:
    args = parse()
    if args.merge:
        merge(args.merge, args.workspace)
        return
    data_root = data_folder(args)
    base = [f"data.root={data_root.resolve()}", "train.eval_every=1", *args.overrides]
    if args.steps is not None:
        base.append(f"train.steps={args.steps}")
    chosen = arms(args.head, args.arms.split(","))
    torch.set_num_threads(2)
    workspaces = {name: (args.workspace / name.replace("+", "_")).resolve() for name in chosen}
    commands = {name: train_command("pk", args.config, args.np_, [*base, *overrides, f"workspace={workspaces[name]}"])
                for name, overrides in chosen.items()}
    timings = {} if args.skip_training else train_arms(commands, args.parallel)
    rows, curves = {}, {}
    for name, overrides in chosen.items():
        saved = workspaces[name] / "config.json"  # the run's own config (the file may have changed since)
        source, edits = (saved, []) if saved.exists() else (args.config, [*base, *overrides])
        config = load_config(source, edits, environ={})
        data = builders.build_data(config)
        rows[name] = evaluate_arm(config, workspaces[name] / "checkpoints" / "last.pt", data)
        curves[name] = read_curves(workspaces[name])
    config = load_config(args.config, base, environ={})
    title = (f"{args.data}: {args.head} head, {config.sampler.classes_per_step} x {config.sampler.samples_per_class} "
             f"images a step, {config.train.steps} steps")
    print(f"\n{title}; overrides {args.overrides}\n")
    print(table(rows, timings))
    curves_png(args.workspace / "head_ablation.png", curves, title)
    atomic_write_text(args.workspace / "head_ablation.json", json.dumps(
        {"rows": rows, "timings": timings, "np": args.np_, "data": args.data, "classes": args.classes,
         "head": args.head, "steps": config.train.steps, "overrides": args.overrides, "curves": curves}, indent=2))


if __name__ == "__main__":
    main()

"""Cross-typeface character retrieval: raw pixels, random batches, MPerClassSampler and P×K, side by side.

Run: .venv/bin/python benchmarks/typeface_retrieval.py [--classes 1000] [--config configs/folder.yaml]
     [--np 2] [--samplers pk,random,mperclass] [--set key=value ...]

Steps:

1. Build the typeface set with ``sets/make_typeface_images.py`` (``--classes``
   characters, one phone-camera capture per typeface, 64 px) unless ``--data``
   already holds a finished set with the same parameters.
2. Count, over one epoch of each sampler's plan, the positive pairs (two
   images of one class) in a global batch of G x K images, and the share of
   images that have a positive in their batch: what the loss can learn from.
3. Train ``--config`` three times from scratch, changing only the sampler
   (model, loss, optimiser, global batch and number of steps are the same):
   - ``pk``: the trainer as users run it (``horovodrun -np N``, pksampler's
     P x K plan);
   - ``random``: ``horovodrun -np N`` with torch's ``DistributedSampler``
     (shuffled, each rank a strided share) cut into batches of P x K;
   - ``mperclass``: pytorch-metric-learning's ``MPerClassSampler`` (``m = K``,
     batch G x K) in one process, the way it is meant to be used.
   The baselines run this script as the trainer's entry point
   (``--worker NAME``), which adds their sampler to the trainer's registry.
4. Evaluate each final model (``last.pt``) and the raw pixels on the same
   held-out classes (the trainer's class-disjoint split) and print one table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "sets"))
from baselines import load_model_state  # noqa: E402
from make_typeface_images import make_typeface_images  # noqa: E402

from pksampler.files import atomic_write_text  # noqa: E402
from pksampler.samplers import DistributedBalancedBatchSampler  # noqa: E402
from pksampler.train import builders  # noqa: E402  # noqa: E402
from pksampler.train.config.load import RunConfig, load_config  # noqa: E402
from pksampler.train.runtime.distributed import Backend  # noqa: E402
from pksampler.train.evaluation.metrics import retrieval_metrics  # noqa: E402
from pksampler.train.evaluation.heldout import embed  # noqa: E402
from pksampler.train.modeling.model import build_model  # noqa: E402

SAMPLERS = ("pk", "random", "mperclass")
TITLES = {"pk": "pksampler P×K (the trainer)", "random": "random batches (DistributedSampler)",
          "mperclass": "pml MPerClassSampler (1 process)"}


class FixedBatches:
    """A torch index sampler cut into ``num_batches`` lists of ``batch_size`` per epoch, for the trainer.

    The trainer asks a batch sampler for ``batch_size``, ``num_batches``,
    ``set_epoch``, ``state_dict``/``load_state_dict`` and ``index.num_classes``;
    this wraps ``DistributedSampler`` or ``MPerClassSampler`` with them. The
    number of steps is fixed to pksampler's for the same data, so every
    sampler trains the same number of steps; an exhausted sampler starts a
    new pass (reseeded) rather than ending the epoch early.
    """

    def __init__(self, sampler: Any, *, batch_size: int, global_batch_size: int, num_batches: int, num_classes: int,
                 seed: int, reseed: Any) -> None:
        self.sampler, self.batch_size, self.num_batches = sampler, batch_size, num_batches
        self.global_batch_size = global_batch_size
        self.index = SimpleNamespace(num_classes=num_classes)
        self.seed, self.epoch, self.skip, self._reseed = seed, 0, 0, reseed

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.skip = epoch, 0

    def state_dict(self, batches_consumed: int = 0) -> dict[str, int]:
        return {"epoch": self.epoch, "seed": self.seed, "consumed": self.skip + batches_consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.skip = int(state["epoch"]), int(state["consumed"])

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        made, round_ = 0, 0
        while made < self.num_batches:
            self._reseed(self.sampler, self.seed, self.epoch, round_)
            for index in self.sampler:
                batch.append(int(index))
                if len(batch) == self.batch_size:
                    if made >= self.skip:
                        yield batch
                    batch, made = [], made + 1
                    if made == self.num_batches:
                        return
            round_ += 1


def _pk_batches(sampler_config, labels: np.ndarray, world_size: int, rank: int, seed: int):
    """pksampler's P x K batch sampler, built as the trainer builds it."""
    return builders.SAMPLERS["balanced"](sampler_config, labels, world_size, rank, seed)


def random_batches(sampler_config, labels: np.ndarray, world_size: int, rank: int, seed: int) -> FixedBatches:
    """torch's DistributedSampler (shuffle, seed) in P x K-sized batches, as many steps as pksampler's plan."""
    from torch.utils.data.distributed import DistributedSampler

    pk = _pk_batches(sampler_config, labels, world_size, rank, seed)
    sampler = DistributedSampler(range(labels.size), num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    return FixedBatches(sampler, batch_size=pk.batch_size, global_batch_size=pk.global_batch_size,
                        num_batches=pk.num_batches,
                        num_classes=pk.index.num_classes, seed=seed,
                        reseed=lambda s, _seed, epoch, round_: s.set_epoch(epoch * 1000 + round_))


def mperclass_batches(sampler_config, labels: np.ndarray, world_size: int, rank: int, seed: int) -> FixedBatches:
    """pytorch-metric-learning's MPerClassSampler (m = K, batch G x K); one process only."""
    from pytorch_metric_learning.samplers import MPerClassSampler
    from pytorch_metric_learning.utils import common_functions

    if world_size != 1:
        raise builders.ConfigError(f"sampler.name=mperclass runs in one process, not {world_size} ranks")
    pk = _pk_batches(sampler_config, labels, 1, 0, seed)
    sampler = MPerClassSampler(labels, m=sampler_config.samples_per_class, batch_size=pk.batch_size,
                               length_before_new_iter=pk.batch_size * pk.num_batches)

    def reseed(_sampler, seed_: int, epoch: int, round_: int) -> None:
        # The sampler draws from the library's module-level generator; give it one keyed by the epoch.
        common_functions.NUMPY_RANDOM = np.random.RandomState(np.random.SeedSequence([seed_, epoch, round_])
                                                                .generate_state(1)[0])

    return FixedBatches(sampler, batch_size=pk.batch_size, global_batch_size=pk.global_batch_size,
                        num_batches=pk.num_batches,
                        num_classes=pk.index.num_classes, seed=seed, reseed=reseed)


def register_baseline_samplers() -> None:
    """Add ``random`` and ``mperclass`` to the trainer's sampler registry (this process only)."""
    builders.SAMPLERS.setdefault("random", random_batches)
    builders.SAMPLERS.setdefault("mperclass", mperclass_batches)


@dataclass
class BatchCounts:
    """Positives in a global batch, averaged over one epoch's steps."""

    positive_pairs: float
    images_with_positive: float
    classes: float


def batch_counts(name: str, sampler_config, labels: np.ndarray, world_size: int, seed: int) -> BatchCounts:
    """Walk epoch 0 of sampler ``name`` on every rank and count positives in each global batch."""
    build = {"pk": _pk_batches, "random": random_batches, "mperclass": mperclass_batches}[name]
    ranks = 1 if name == "mperclass" else world_size
    streams = []
    for rank in range(ranks):
        sampler = build(sampler_config, labels, ranks, rank, seed)
        sampler.set_epoch(0)
        streams.append(iter(sampler))
    pairs, with_positive, classes = [], [], []
    for batches in zip(*streams):
        batch_labels = labels[np.concatenate([np.asarray(b) for b in batches])]
        _, counts = np.unique(batch_labels, return_counts=True)
        pairs.append(float((counts * (counts - 1) // 2).sum()))
        with_positive.append(float(counts[counts > 1].sum() / batch_labels.size))
        classes.append(float(counts.size))
    return BatchCounts(float(np.mean(pairs)), float(np.mean(with_positive)), float(np.mean(classes)))


def train_command(name: str, config: Path, np_: int, overrides: list[str]) -> list[str]:
    """horovodrun for pk and random (N ranks), one plain process for mperclass (and for all at ``--np 1``)."""
    entry = [str(ROOT / "train" / "retrieval.py")] if name == "pk" else [__file__, "--worker", name]
    script = [sys.executable, *entry, "--config", str(config), "--no-resume"]
    script += [item for text in overrides for item in ("--set", text)]
    if name == "mperclass" or np_ == 1:
        return script + ["--set", "distributed.backend=none"]
    horovodrun = Path(sys.executable).with_name("horovodrun")
    return [str(horovodrun), "-np", str(np_), "-H", f"localhost:{np_}", *script]


def run_training(command: list[str]) -> tuple[float, float]:
    """Run ``command``; return (wall seconds, CPU seconds of it and its children)."""
    env = dict(os.environ, HOROVOD_CYCLE_TIME=os.environ.get("HOROVOD_CYCLE_TIME", "10"),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for key in ("DATASETS_PATH", "DATASETS", "WORKSPACE"):
        env.pop(key, None)
    print("$", " ".join(command), flush=True)
    before = os.times()
    start = time.perf_counter()
    subprocess.run(command, env=env, cwd=ROOT, check=True)
    after = os.times()
    return time.perf_counter() - start, (after.children_user - before.children_user) + (
        after.children_system - before.children_system)


def evaluate(config: RunConfig, checkpoints: dict[str, Path]) -> tuple[dict[str, dict[str, float]], np.ndarray]:
    """Raw pixels and each checkpoint's final model on the held-out classes."""
    data = builders.build_data(config)
    test_set, view = data.test, data.view  # uint8 images, made the model's input as the trainer makes them
    labels = test_set.labels
    pixels = np.stack([view(test_set[i][0][None]).reshape(-1).numpy() for i in range(len(test_set))])
    rows = {"raw pixels (cosine)": retrieval_metrics(pixels, labels)}
    for name, path in checkpoints.items():
        model = build_model(config.model)
        model.load_state_dict(load_model_state(path))
        rows[name] = retrieval_metrics(embed(model, test_set, Backend(), view=view), labels)
    return rows, labels


def worker(name: str, argv: list[str]) -> None:
    """The trainer's entry point with the baseline samplers registered (``--worker NAME``)."""
    register_baseline_samplers()
    from pksampler.train.retrieval import main as retrieval_main

    sys.exit(retrieval_main([*argv, "--set", f"sampler.name={name}"]))


def _table(rows: dict, counts: dict, timings: dict) -> str:
    lines = ["| embedding | positive pairs / global batch | images with a positive | R@1 | R@5 | MAP@R | train wall / CPU |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, metrics in rows.items():
        c = counts.get(name)
        t = timings.get(name)
        lines.append(f"| {name} | {f'{c.positive_pairs:.1f}' if c else '–'} | "
                     f"{f'{c.images_with_positive:.0%}' if c else '–'} | {metrics['recall_at_1']:.3f} | "
                     f"{metrics['recall_at_5']:.3f} | {metrics['map_at_r']:.3f} | "
                     f"{f'{t[0]:.0f} s / {t[1]:.0f} s' if t else '–'} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "folder.yaml")
    parser.add_argument("--np", dest="np_", type=int, default=2,
                        help="ranks for horovodrun (default 2); 1: every sampler in one process")
    parser.add_argument("--data", type=Path, default=None, help="set folder (default workspace/typefaces/c<classes>)")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--samplers", default=",".join(SAMPLERS), help=f"subset of {','.join(SAMPLERS)}")
    parser.add_argument("--workspace", type=Path, default=ROOT / "workspace" / "typefaces" / "runs")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--skip-training", action="store_true", help="evaluate the runs' existing last.pt")
    args = parser.parse_args()
    names = [n for n in args.samplers.split(",") if n]
    if args.np_ < 1 or not names or set(names) - set(SAMPLERS):
        raise SystemExit(f"--np must be >= 1 and --samplers a subset of {','.join(SAMPLERS)}; got {args.np_}, {args.samplers!r}")
    data = args.data or ROOT / "workspace" / "typefaces" / f"c{args.classes}"
    make_typeface_images(data, classes=args.classes, size=args.size, seed=args.data_seed)
    base = [f"data.root={data.resolve()}", *args.overrides]
    config = load_config(args.config, base, environ={})
    torch.set_num_threads(2)
    train_labels = builders.build_data(config).train.labels
    counts = {TITLES[n]: batch_counts(n, config.sampler, train_labels, args.np_, config.seed) for n in names}
    timings, checkpoints = {}, {}
    for name in names:
        workspace = (args.workspace / name).resolve()
        if not args.skip_training:
            command = train_command(name, args.config, args.np_, [*base, f"workspace={workspace}"])
            timings[TITLES[name]] = run_training(command)
        checkpoints[TITLES[name]] = workspace / "checkpoints" / "last.pt"
    rows, labels = evaluate(config, checkpoints)
    print(f"\nheld-out classes: {np.unique(labels).size}, images: {labels.size}; train images: {train_labels.size}; "
          f"global batch {config.sampler.classes_per_step} x {config.sampler.samples_per_class}\n")
    print(_table(rows, counts, timings))
    atomic_write_text(args.workspace / "typeface_retrieval.json", json.dumps(
        {"rows": rows, "counts": {k: vars(v) for k, v in counts.items()}, "timings": timings, "np": args.np_,
         "classes": args.classes, "overrides": args.overrides}, indent=2))


if __name__ == "__main__":
    main()

"""Re-planning after a membership change at N = 10^7: sync the sampler state, build the new world's plan.

Run: .venv/bin/python benchmarks/replan.py [--samples 1e7 --classes 1e6]

An elastic job that goes from W = 8 to W' = 7 ranks (G = 256 classes per
step, K = 4, so 37 or 36 classes per rank after the change) mid-epoch:

* sync: rank 0's ``state_dict`` pickled to the bytes a broadcast sends,
  unpickled and loaded on a new-world sampler (``load_state_dict``);
* plan: the new world's plan up to this rank's first batch, per rank, for a
  *survivor* (its sampler moves with ``set_world``; the labels' grouping and
  the epoch layout are kept) and for a *joiner* (a sampler built from the
  grouped labels, cold caches).

The trainer's own path (``--trainer``; the rows named ``trainer``): the
sampler that ``build_sampler`` makes from the config, moved at a reset by
:meth:`Trainer.set_world` (the backend, then the same sampler object's
``set_world``), the committed position loaded by the elastic sampler handler
(``on_reset``), then the plan to the first batch. Beside it, what the trainer
did before it used ``set_world``: a new sampler built from the labels
(grouping them again) for each new world.

Target: sync + plan <= 1 s per rank. Wall and CPU seconds are both shown:
on a loaded machine the wall time includes waiting for a core. Reference, in the same run and at the
same N: Horovod's own ``horovod.torch.elastic.ElasticSampler``, whose
``load_state_dict`` calls ``reset`` (a Python list of all N indices,
shuffled), then its first index (``__iter__`` copies and slices that list).
Grouping the labels (once per process, at start-up) is shown apart.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from typing import Any, Callable

import numpy as np

G, K, OLD_WORLD, NEW_WORLD, EPOCH = 256, 4, 8, 7, 3


class Clock:
    """Wall and CPU seconds of one call. On a loaded machine the wall time counts the waits for a core;
    the CPU time is what the call takes on a core of its own."""

    def __init__(self, wall: float = 0.0, cpu: float = 0.0) -> None:
        self.wall, self.cpu = wall, cpu

    def __add__(self, other: "Clock") -> "Clock":
        return Clock(self.wall + other.wall, self.cpu + other.cpu)

    def worst(self, other: "Clock") -> "Clock":
        return Clock(max(self.wall, other.wall), max(self.cpu, other.cpu))


def timed(function: Callable[[], Any]) -> tuple[Clock, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = function()
    return Clock(time.perf_counter() - wall, time.process_time() - cpu), result


Row = tuple[str, Clock, str]


def ours(labels: np.ndarray) -> list[Row]:
    from pksampler.samplers import DistributedBalancedBatchSampler, group_labels

    def build(index: Any, world: int, rank: int) -> DistributedBalancedBatchSampler:
        return DistributedBalancedBatchSampler(index, samples_per_class=K, classes_per_step=G, num_replicas=world,
                                               rank=rank, seed=0)

    grouping, index = timed(lambda: group_labels(labels))
    old = build(index, OLD_WORLD, 0)
    old.set_epoch(EPOCH)
    next(iter(old))  # a running rank: its epoch layout is built
    consumed = old.num_batches // 2
    rows = [("pksampler: group labels (once per process, at start-up)", grouping, f"N={labels.size:,}")]

    def sync(target: DistributedBalancedBatchSampler) -> int:
        payload = pickle.dumps(old.state_dict(batches_consumed=consumed))
        target.load_state_dict(pickle.loads(payload))
        return len(payload)

    worst_survivor, worst_joiner, size = Clock(), Clock(), 0
    for rank in (0, NEW_WORLD - 1):  # a rank with ceil(G/W') classes and one with floor(G/W')
        survivor = build(index, OLD_WORLD, rank)
        survivor.set_epoch(EPOCH)
        next(iter(survivor))
        seconds, size = timed(lambda: (survivor.set_world(NEW_WORLD, rank), sync(survivor))[1])
        plan, batch = timed(lambda: next(iter(survivor)))
        worst_survivor = worst_survivor.worst(seconds + plan)
        rows.append((f"pksampler survivor rank {rank}/{NEW_WORLD}: set_world + sync", seconds, f"{size} B payload"))
        rows.append((f"pksampler survivor rank {rank}/{NEW_WORLD}: plan to first batch", plan, f"{len(batch)} indices"))
        joiner_build, joiner = timed(lambda: build(index, NEW_WORLD, rank))
        seconds, _ = timed(lambda: sync(joiner))
        plan, batch = timed(lambda: next(iter(joiner)))
        worst_joiner = worst_joiner.worst(joiner_build + seconds + plan)
        rows.append((f"pksampler joiner rank {rank}/{NEW_WORLD}: build from grouped labels", joiner_build, ""))
        rows.append((f"pksampler joiner rank {rank}/{NEW_WORLD}: sync", seconds, f"{size} B payload"))
        rows.append((f"pksampler joiner rank {rank}/{NEW_WORLD}: plan to first batch", plan, f"{len(batch)} indices"))
    rows.append(("pksampler survivor total (worst rank)", worst_survivor, "target <= 1 s"))
    rows.append(("pksampler joiner total (worst rank)", worst_joiner, "target <= 1 s"))
    return rows


def trainer_path(labels: np.ndarray) -> list[Row]:
    """The trainer's reset for a survivor: Trainer.set_world + the handler's committed position + first batch."""
    from types import SimpleNamespace

    from pksampler.train.builders import build_sampler
    from pksampler.train.config.schema import SamplerConfig
    from pksampler.train.engine.elastic.handlers import SamplerHandler
    from pksampler.train.engine.trainer import Trainer
    from pksampler.train.runtime.distributed import Backend
    from pksampler.world import World

    config = SamplerConfig(classes_per_step=G, samples_per_class=K)
    rows, worst, worst_rebuilt = [], Clock(), Clock()
    for rank in (0, NEW_WORLD - 1):
        sampler = build_sampler(config, labels, OLD_WORLD, rank, 0)
        sampler.set_epoch(EPOCH)
        next(iter(sampler))  # a running rank: its epoch layout is built
        committed = {**sampler.state_dict(batches_consumed=0), "epoch": EPOCH, "step": sampler.num_batches // 2}
        handler = SamplerHandler(sampler, position=lambda committed=committed: committed)
        trainer = Trainer(SimpleNamespace(backend=Backend("cpu", "fp32"), sampler=sampler, shared=()), [])
        world = World(rank=rank, size=NEW_WORLD)
        moved, _ = timed(lambda: (trainer.set_world(world), handler.on_reset()))
        plan, batch = timed(lambda: next(iter(sampler)))
        worst = worst.worst(moved + plan)
        rows.append((f"trainer survivor rank {rank}/{NEW_WORLD}: Trainer.set_world + committed position", moved, ""))
        rows.append((f"trainer survivor rank {rank}/{NEW_WORLD}: plan to first batch", plan, f"{len(batch)} indices"))

        def rebuilt() -> Any:  # the trainer's former reset: a new sampler from the labels
            fresh = build_sampler(config, labels, NEW_WORLD, rank, 0)
            fresh.load_state_dict(committed)
            return next(iter(fresh))

        before, _ = timed(rebuilt)
        worst_rebuilt = worst_rebuilt.worst(before)
    rows.append(("trainer survivor total (worst rank), set_world", worst, "target <= 1 s"))
    rows.append(("trainer survivor, a sampler rebuilt from the labels (before set_world)", worst_rebuilt, ""))
    return rows


def horovod_reference(num_samples: int) -> list[Row]:
    import horovod.torch as hvd
    from horovod.torch.elastic import ElasticSampler

    hvd.init()  # one process: size 1, rank 0 (the reset's cost does not depend on W)
    sampler = ElasticSampler(range(1), shuffle=True, seed=0)
    sampler.dataset, sampler.epoch = range(num_samples), EPOCH  # skips a first reset of N (a minute here)
    sampler.processed_num = num_samples // 2
    payload = pickle.dumps(sampler.state_dict())
    seconds, _ = timed(lambda: sampler.load_state_dict(pickle.loads(payload)))  # reset(): list of N, shuffled
    first, _ = timed(lambda: next(iter(sampler)))
    hvd.shutdown()
    return [("Horovod ElasticSampler: sync (load_state_dict -> reset)", seconds, f"{len(payload)} B payload"),
            ("Horovod ElasticSampler: first index (__iter__)", first, ""),
            ("Horovod ElasticSampler total (sync + first index)", seconds + first, "")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=float, default=1e7)
    parser.add_argument("--classes", type=float, default=1e6)
    parser.add_argument("--trainer", action="store_true", help="only the trainer's own path (Trainer.set_world)")
    args = parser.parse_args()
    num_samples, num_classes = int(args.samples), int(args.classes)
    labels = np.random.default_rng(0).integers(0, num_classes, num_samples)
    print(f"N={num_samples:,} labels, C={num_classes:,} classes, G={G}, K={K}, W {OLD_WORLD} -> {NEW_WORLD}, "
          f"mid-epoch {EPOCH}")
    if args.trainer:
        _print(trainer_path(labels))
        return
    mine = ours(labels)
    rows = mine + trainer_path(labels)
    reference = horovod_reference(num_samples)
    _print(rows + reference)
    ours_worst = mine[-1][1].worst(mine[-2][1])
    print(f"Horovod ElasticSampler / pksampler (worst rank's total): {reference[-1][1].wall / ours_worst.wall:.0f}x "
          f"wall, {reference[-1][1].cpu / max(ours_worst.cpu, 1e-9):.0f}x CPU")


def _print(rows: list[Row]) -> None:
    width = max(len(name) for name, _, _ in rows)
    print(f"{'':<{width}}  {'wall s':>8}  {'CPU s':>8}")
    for name, clock, note in rows:
        print(f"{name:<{width}}  {clock.wall:8.3f}  {clock.cpu:8.3f}  {note}")


if __name__ == "__main__":
    main()

"""CPU time per training image in the full input pipeline, against Pillow's decode + resize alone (the floor).

Run: .venv/bin/python benchmarks/pipeline_cpu.py [--images 1200] [--repeats 5] [--workdir DIR]

1. Writes ``--images`` JPEGs (quality 90, sides drawn in [--min-side, --max-side],
   default 440-560 px: "~500 px") with the loader benchmark's generator as an
   image folder, and packs them into shards. Data lives in a temporary folder
   or ``--workdir`` (kept and reused), never in the repository.
2. The floor, in this process: for every image of the measured batches,
   ``Image.open``, ``draft("RGB", (S, S))``, one ``resize`` of the centre square
   to S x S (S = 224, the training size). Process CPU time
   (``time.process_time``), per image.
3. The full pipeline: a DataLoader with ``--workers`` persistent workers over
   ``--batches`` P x K batches (P=32, K=4) of the balanced sampler. Epoch 0
   warms up (starts the workers, fills the page cache); the CPU time the worker
   processes spend during epoch 1 (``utime + stime`` from ``/proc/PID/stat``:
   decode, transform, collate, hand-over through shared memory), divided by the
   images, is the cost per image. Cases:

   * ``before``: the previous pipeline, ``train_preset(224)`` in the workers
     (random resized crop, flip, colour jitter, to float, normalise; draft at
     256, the previous decode size) shipping float32;
   * ``folder``, ``shards``: the current one, :class:`~pksampler.datasets.ToUint8`
     in the workers (draft decode at 224, one resize) shipping uint8, with the
     dataset index (:class:`~pksampler.train.runtime.loader.TrainLoader`'s loader).

   The device-side augmentation (:class:`~pksampler.datasets.BatchAugment`)
   runs on the rank's device; its cost when that device is this CPU is
   reported separately, per image.
4. Cases and the floor are interleaved and repeated; each repeat's ratio to
   its own floor is reported, then the median and the range over repeats.
   CPU time, not wall time, because other work shares this machine; the
   shards/folder comparison is given both ways (CPU per image and images/s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loader_throughput import generate, run_in_workdir  # noqa: E402

TRAIN_SIZE, P, K = 224, 32, 4
_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def floor_seconds(paths: list[str]) -> float:
    """Process CPU seconds per image of Pillow's draft decode + one resize to the training size."""
    from PIL import Image

    started = time.process_time()
    for path in paths:
        with Image.open(path) as image:
            image.draft("RGB", (TRAIN_SIZE, TRAIN_SIZE))
            width, height = image.size
            side = min(width, height)
            left, top = (width - side) // 2, (height - side) // 2
            image.resize((TRAIN_SIZE, TRAIN_SIZE), Image.BILINEAR, box=(left, top, left + side, top + side))
    return (time.process_time() - started) / len(paths)


class _FloorImages:
    """The floor as a dataset: Pillow's draft decode + one resize per index, returning only the label."""

    def __init__(self, paths: list[str], labels: np.ndarray) -> None:
        self.paths, self.labels = paths, labels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> int:
        floor_seconds([self.paths[index]])
        return int(self.labels[index])


def _loader(case: str, folder: Path, shards: Path, batches: list[list[int]], workers: int, ship: int):
    """The DataLoader a case runs, a function listing its worker processes, and one stopping them."""
    import torch
    from torch.utils.data import DataLoader

    from pksampler.datasets import ImageFolderDataset, ShardedDataset, ToUint8, train_preset
    from pksampler.train.runtime.device import DeviceSetup
    from pksampler.train.runtime.loader import TrainLoader

    if case == "floor":
        listing = ImageFolderDataset(folder)
        loader = DataLoader(_FloorImages(listing.paths, listing.labels), batch_sampler=batches, num_workers=workers,
                            persistent_workers=True)
        return loader, lambda: [w.pid for w in loader._iterator._workers], lambda: loader._iterator._shutdown_workers()
    if case == "before":
        dataset = ImageFolderDataset(folder, transform=train_preset(TRAIN_SIZE), decode_size=round(TRAIN_SIZE * 8 / 7))
        loader = DataLoader(dataset, batch_sampler=batches, num_workers=workers, persistent_workers=True)
        return loader, lambda: [w.pid for w in loader._iterator._workers], lambda: loader._iterator._shutdown_workers()
    make = ImageFolderDataset if case == "folder" else ShardedDataset
    dataset = make(folder if case == "folder" else shards, transform=ToUint8(ship), decode_size=TRAIN_SIZE)
    train = TrainLoader(dataset, batches, lambda images, keys, epoch: images,
                        workers=workers, setup=DeviceSetup(torch.device("cpu"), "fp32"))
    return train.loader, train.worker_pids, train.close


def pipeline_seconds(case: str, folder: Path, shards: Path, batches: list[list[int]], workers: int, ship: int
                     ) -> tuple[float, float]:
    """(worker CPU seconds per image, images per wall second) over one epoch after a warm-up epoch."""
    loader, pids, close = _loader(case, folder, shards, batches, workers, ship)
    for _ in loader:  # epoch 0: start the workers, warm the page cache
        pass
    before = {pid: process_cpu_seconds(pid) for pid in pids()}
    started, images = time.perf_counter(), 0
    for batch in loader:
        images += len(batch[0]) if isinstance(batch, (list, tuple)) else len(batch)
    wall = time.perf_counter() - started
    after = {pid: process_cpu_seconds(pid) for pid in pids()}
    assert after.keys() == before.keys(), "a worker was replaced during the measurement"
    close()
    return sum(after[p] - before[p] for p in after) / images, images / wall


def augment_seconds(batches: int, repeats: int = 3) -> float:
    """Process CPU seconds per image of BatchAugment on a uint8 batch of P x K images, on this CPU."""
    import torch

    from pksampler.datasets import BatchAugment

    torch.set_num_threads(1)
    augment = BatchAugment(TRAIN_SIZE, seed=0)
    images = torch.randint(0, 256, (P * K, 3, TRAIN_SIZE, TRAIN_SIZE), dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for step in range(batches):
            augment(images, np.arange(step * P * K, (step + 1) * P * K), 0)
        best = min(best, (time.process_time() - started) / (batches * P * K))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1200, help="JPEGs to generate")
    parser.add_argument("--per-class", type=int, default=8)
    parser.add_argument("--min-side", type=int, default=440)
    parser.add_argument("--max-side", type=int, default=560)
    parser.add_argument("--batches", type=int, default=8, help="P x K batches per epoch of each case")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--ship-size", type=int, default=TRAIN_SIZE, help="side of the uint8 squares the workers ship")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the data here (default: a temp dir)")
    args = parser.parse_args()
    run_in_workdir(parser, args, run)


def run(args: argparse.Namespace, work: Path) -> None:
    from pksampler import DistributedBalancedBatchSampler
    from pksampler.datasets import ImageFolderDataset
    from pksampler.datasets.pack import pack

    folder, shards = work / "folder", work / "shards"
    generate(folder, args.images, args.per_class, args.min_side, args.max_side)
    if not (shards / "manifest.json").is_file():
        pack(folder, shards, workers=2, shard_size="64MB")
    paths_of = ImageFolderDataset(folder)
    packed = json.loads((shards / "manifest.json").read_text())["num_samples"]
    if packed != len(paths_of):
        sys.exit(f"{shards} holds {packed} images, {folder} {len(paths_of)}: use a fresh --workdir")
    sampler = DistributedBalancedBatchSampler(paths_of.labels, P, K, num_replicas=1, rank=0, seed=0)
    batches = [list(map(int, b)) for b, _ in zip(sampler, range(args.batches))]
    paths = [paths_of.paths[i] for b in batches for i in b]
    cases = ["floor", "before", "folder", "shards"]
    rows: dict[str, list[tuple[float, float]]] = {c: [] for c in cases}  # (CPU s per image, images/s)
    floors = []
    for repeat in range(args.repeats):
        floors.append(floor_seconds(paths))
        for case in cases[repeat % len(cases):] + cases[:repeat % len(cases)]:
            rows[case].append(pipeline_seconds(case, folder, shards, batches, args.workers, args.ship_size))
        print(f"repeat {repeat}: floor in this process {floors[-1] * 1e3:.2f} ms/img; " + "; ".join(
            f"{c} {rows[c][-1][0] * 1e3:.2f} ms/img ({rows[c][-1][1]:.0f} img/s)" for c in cases), flush=True)
    _report(args, paths, cases, rows, floors)


def _spread(values: list[float], unit: float = 1.0, digits: int = 2) -> str:
    """``median [min-max]`` of ``values`` times ``unit``."""
    v = np.asarray(values) * unit
    return f"{np.median(v):.{digits}f} [{v.min():.{digits}f}-{v.max():.{digits}f}]"


def _report(args: argparse.Namespace, paths: list[str], cases: list[str], rows: dict, floors: list[float]) -> None:
    sizes = [Path(p).stat().st_size for p in paths]
    print(f"\n{len(paths)} JPEGs per epoch ({args.min_side}-{args.max_side} px, quality 90, "
          f"{np.mean(sizes) / 1000:.0f} kB mean), train size {TRAIN_SIZE} (shipped at {args.ship_size}), "
          f"P={P} K={K}, {args.workers} workers, {args.repeats} repeats; median [min-max] over repeats")
    print(f"floor in this process (draft decode + one resize): {_spread(floors, 1e3)} ms/img")
    worker_floor = [r[0] for r in rows["floor"]]
    print(f"floor in the workers (the same, returning the label): {_spread(worker_floor, 1e3)} ms/img")
    for case in cases[1:]:
        cpu = [r[0] for r in rows[case]]
        print(f"{case:7s} worker CPU {_spread(cpu, 1e3)} ms/img; per floor in this process "
              f"{_spread([c / f for c, f in zip(cpu, floors)])}x, per floor in the workers "
              f"{_spread([c / f for c, f in zip(cpu, worker_floor)])}x; {_spread([r[1] for r in rows[case]], 1, 0)} img/s")
    cpu_ratio = [s[0] / f[0] for s, f in zip(rows["shards"], rows["folder"])]
    rate_ratio = [s[1] / f[1] for s, f in zip(rows["shards"], rows["folder"])]
    print(f"shards / folder: CPU per image {_spread(cpu_ratio)}x (lower is better), images/s {_spread(rate_ratio)}x")
    print(f"device augmentation on this CPU (BatchAugment, one thread): {augment_seconds(2) * 1e3:.2f} ms/img")


if __name__ == "__main__":
    main()

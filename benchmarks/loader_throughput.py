"""Loader throughput: image folder vs packed shards vs shards with draft decoding, and per-rank shard reads.

Run: .venv/bin/python benchmarks/loader_throughput.py [--images 100000] [--workdir DIR]
     .venv/bin/python benchmarks/loader_throughput.py --simulate 10000000 --world 256

1. Writes ``--images`` JPEGs (quality 90) of the synthetic product generator as an image folder:
   each image is rendered at 128 px by ``render_product`` and resized (bicubic) to a side drawn
   in [--min-side, --max-side] (default 256-512), since rendering at full size costs ~0.15 s an
   image. Then packs the folder into shards (``pksampler.datasets.pack``). Data lives in a
   temporary folder, or in ``--workdir`` (kept, and reused by the next run), never in the repo.
2. Read + decode alone (``dataset.load(i)``, no transform, one process) over the sampler's
   index stream, in interleaved rounds of 100 images per case; the median rate per case.
   Then the full pipeline: reads one epoch's first ``--batches`` P x K batches (balanced batch sampler, W=1, P=32, K=4)
   through a DataLoader with 2 workers and the training transform at 224 px, for: the folder,
   the shards, the shards with ``decode_size=224`` (Pillow draft mode), and the folder with
   draft mode. Runs are interleaved and repeated; the medians are reported, with each
   case's ratio to the folder measured in the same run. The page cache is warm for every case
   (the files were just written), so this compares open+read+decode, not cold-disk seeks.
3. For W=16 ranks (P=8, K=4), counts per rank and epoch: images read, distinct shards opened
   and bytes read from shards.

With ``--simulate N`` no image is written: a synthetic class-contiguous index of N images
(``--image-bytes`` each, ``--per-class`` per class, 512 MB shards) is planned and the per-rank
reads of one epoch at ``--world`` ranks are counted from the real sampler plan.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

P_THROUGHPUT, K = 32, 4
P_RANKS, WORLD_RANKS = 8, 16
TRAIN_SIZE = 224


def _render_class(task: tuple[Path, int, int, int, int, int]) -> int:
    """Write the JPEGs of one class (worker process)."""
    from PIL import Image

    from pksampler.datasets import render_product
    from pksampler.files import atomic_write_bytes

    root, cls, per_class, min_side, max_side, seed = task
    rng = np.random.default_rng([seed, cls])
    folder = root / f"class_{cls:06d}"
    for view in range(per_class):
        target = folder / f"{view:05d}.jpg"
        if target.is_file():
            continue
        side = int(rng.integers(min_side, max_side + 1))
        image = render_product(cls, view, image_size=128, seed=seed).resize((side, side), Image.BICUBIC)
        stream = io.BytesIO()
        image.save(stream, format="JPEG", quality=90)
        atomic_write_bytes(target, stream.getvalue())
    return per_class


def generate(root: Path, images: int, per_class: int, min_side: int, max_side: int, seed: int = 0) -> None:
    classes = max(images // per_class, 1)
    tasks = [(root, c, per_class, min_side, max_side, seed) for c in range(classes)]
    started, done = time.perf_counter(), 0
    with multiprocessing.get_context("fork").Pool(2) as pool:
        for count in pool.imap_unordered(_render_class, tasks, chunksize=4):
            done += count
            if done % max(images // 10, 1) < per_class:
                print(f"  generated {done}/{classes * per_class} JPEGs ({done / (time.perf_counter() - started):.0f}/s)",
                      file=sys.stderr, flush=True)


def throughput(dataset, batches: int, workers: int) -> float:
    """Images/s through a DataLoader over the first ``batches`` P x K batches (after the first batch)."""
    from torch.utils.data import DataLoader

    from pksampler import DistributedBalancedBatchSampler

    sampler = DistributedBalancedBatchSampler(dataset.labels, P_THROUGHPUT, K, num_replicas=1, rank=0, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=workers, prefetch_factor=4)
    count, started = 0, None
    for step, (images, _) in enumerate(loader):
        if step == 0:
            started = time.perf_counter()  # worker start-up excluded
            continue
        count += images.shape[0]
        if step >= batches:
            break
    return count / (time.perf_counter() - started)


def per_rank_reads(labels: np.ndarray, shard_of: np.ndarray, sizes: np.ndarray, world: int, p: int,
                   ranks: int | None = None) -> dict:
    """Images, distinct shards and bytes each rank reads in epoch 0 (min / median / max over ranks).

    Uses the sampler's pure plan (group the labels once, lay out the epoch once,
    slice per rank): exactly the batches DistributedBalancedBatchSampler yields.
    ``ranks`` limits the count to the first ranks (the plan is symmetric).
    """
    from pksampler.samplers import epoch_layout, group_labels, rank_batches

    index = group_labels(labels)
    layout = epoch_layout(index, world * p, K, seed=0, epoch=0)
    rows = []
    for rank in range(world if ranks is None else min(ranks, world)):
        chunks = rank_batches(layout, index, p, K, rank).reshape(-1, K)
        indices = chunks.reshape(-1)
        chunk_shards = shard_of[chunks]
        per_chunk = 1 + (np.diff(np.sort(chunk_shards, axis=1), axis=1) != 0).sum(axis=1)
        rows.append((indices.size, np.unique(shard_of[indices]).size, int(sizes[indices].sum()), per_chunk.mean()))
    table = np.asarray(rows, dtype=np.float64)
    return {name: (table[:, i].min(), float(np.median(table[:, i])), table[:, i].max())
            for i, name in enumerate(("images", "shards", "bytes", "shards_per_chunk"))}


def _report_ranks(stats: dict, world: int, total_shards: int) -> None:
    images, shards, size, per_chunk = (stats[k] for k in ("images", "shards", "bytes", "shards_per_chunk"))
    print(f"per rank, epoch 0, W={world}: {images[1]:.0f} images; distinct shards min/median/max "
          f"{shards[0]:.0f}/{shards[1]:.0f}/{shards[2]:.0f} of {total_shards}; bytes median "
          f"{size[1] / 2**20:.1f} MiB (max {size[2] / 2**20:.1f}); shards touched per K-chunk {per_chunk[1]:.2f}")


def simulate(n: int, per_class: int, image_bytes: int, world: int, p: int) -> None:
    """Per-rank reads at scale from a planned index (no images)."""
    from pksampler.datasets.pack import plan_shards

    labels = np.repeat(np.arange(n // per_class, dtype=np.int64), per_class)
    sizes = np.full(labels.size, image_bytes, dtype=np.int64)
    starts = plan_shards(labels, sizes, 512 * 10**6)
    shard_of = (np.searchsorted(starts, np.arange(labels.size), side="right") - 1).astype(np.int32)
    started = time.perf_counter()
    stats = per_rank_reads(labels, shard_of, sizes, world, p, ranks=8)
    print(f"simulated {labels.size} images of {image_bytes} B, {labels.size // per_class} classes, "
          f"{starts.size - 1} shards of 512 MB (P={p}, K={K}; ranks 0-7 counted; {time.perf_counter() - started:.0f} s)")
    _report_ranks(stats, world, starts.size - 1)


def read_decode_rates(cases: dict, indices: np.ndarray, rounds: int, per_round: int) -> dict[str, float]:
    """Images/s of ``load(i)`` (read + decode, no transform) in this process: median over interleaved rounds.

    Each round times the next ``per_round`` indices of the sampler's stream for
    every case, in a rotating order, so load on a shared machine hits every
    case alike; the median over rounds discards the disturbed ones.
    """
    datasets = {name: make() for name, make in cases.items()}
    rates: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for round_ in range(rounds):
        chunk = indices[(round_ * per_round) % indices.size:][:per_round].tolist()
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            load = datasets[name].load
            started = time.perf_counter()
            for index in chunk:
                load(index)
            rates[name].append(len(chunk) / (time.perf_counter() - started))
    return {name: statistics.median(values) for name, values in rates.items()}


def measure_all(folder: Path, shards: Path, batches: int, repeats: int, workers: int) -> dict[str, list[float]]:
    from pksampler.datasets import ImageFolderDataset, ShardedDataset, train_preset

    transform = train_preset(TRAIN_SIZE)
    cases = {
        "folder": lambda: ImageFolderDataset(folder, transform=transform),
        "shards": lambda: ShardedDataset(shards, transform=transform),
        "shards+draft": lambda: ShardedDataset(shards, transform=transform, decode_size=TRAIN_SIZE),
        "folder+draft": lambda: ImageFolderDataset(folder, transform=transform, decode_size=TRAIN_SIZE),
    }
    from pksampler import DistributedBalancedBatchSampler

    labels = np.asarray(cases["shards"]().labels)
    stream = np.concatenate([np.asarray(b) for b in DistributedBalancedBatchSampler(
        labels, P_THROUGHPUT, K, num_replicas=1, rank=0, seed=0)])
    decode = read_decode_rates(cases, stream, rounds=max(3 * repeats, 9), per_round=100)
    for name, rate in decode.items():
        print(f"read+decode  {name:13s} {rate:7.0f} images/s  ({rate / decode['folder']:.2f}x folder)")
    results: dict[str, list[float]] = {name: [] for name in cases}
    for repeat in range(repeats):
        order = list(cases)[repeat % len(cases):] + list(cases)[:repeat % len(cases)]
        for name in order:
            rate = throughput(cases[name](), batches, workers)
            results[name].append(rate)
            print(f"  repeat {repeat}: {name:13s} {rate:7.0f} images/s", file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=100_000, help="JPEGs to generate (default 1e5)")
    parser.add_argument("--per-class", type=int, default=20)
    parser.add_argument("--min-side", type=int, default=256)
    parser.add_argument("--max-side", type=int, default=512)
    parser.add_argument("--batches", type=int, default=40, help="P x K batches timed per case and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--shard-size", default="512MB", help="packer shard size (small sets: use less)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the data here (default: a temp dir)")
    parser.add_argument("--simulate", type=int, default=0, help="only count per-rank reads for N planned images")
    parser.add_argument("--world", type=int, default=256, help="ranks for --simulate")
    parser.add_argument("--image-bytes", type=int, default=100_000, help="image size for --simulate")
    args = parser.parse_args()
    if args.simulate:
        simulate(args.simulate, args.per_class, args.image_bytes, args.world, P_RANKS)
        return
    run_in_workdir(parser, args, run)



def run_in_workdir(parser: argparse.ArgumentParser, args: argparse.Namespace, run) -> None:
    """``run(args, work)`` in ``--workdir`` (default: a temporary folder), refusing one inside the repository."""
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        repo = Path(__file__).resolve().parents[1]
        if repo in work.resolve().parents or work.resolve() == repo:
            parser.error(f"--workdir {work} is inside the repository; use a folder outside it")
        run(args, work)

def run(args: argparse.Namespace, work: Path) -> None:
    from pksampler.datasets import ShardedDataset
    from pksampler.datasets.pack import pack

    folder, shards = work / "folder", work / "shards"
    started = time.perf_counter()
    generate(folder, args.images, args.per_class, args.min_side, args.max_side)
    print(f"generated the folder in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    started = time.perf_counter()
    manifest = pack(folder, shards, workers=2, shard_size=args.shard_size)
    print(f"packed {manifest['num_samples']} images into {len(manifest['shards'])} shard(s) in "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    total_bytes = sum(s["bytes"] for s in manifest["shards"])
    results = measure_all(folder, shards, args.batches, args.repeats, args.workers)
    median = {name: statistics.median(rates) for name, rates in results.items()}
    print(f"{manifest['num_samples']} JPEGs, {args.min_side}-{args.max_side} px, quality 90, "
          f"{total_bytes / manifest['num_samples'] / 1000:.0f} kB mean, shards of {args.shard_size}; train size {TRAIN_SIZE}; "
          f"P={P_THROUGHPUT} K={K}; {args.workers} DataLoader workers; {args.batches} batches x {args.repeats} repeats")
    for name, rate in median.items():
        print(f"{name:13s} {rate:7.0f} images/s  ({rate / median['folder']:.2f}x folder)")
    dataset = ShardedDataset(shards)
    if dataset.num_classes < WORLD_RANKS * P_RANKS:
        print(f"per-rank reads at W={WORLD_RANKS} need {WORLD_RANKS * P_RANKS} classes, the set has "
              f"{dataset.num_classes}: skipped (use more --images or fewer --per-class)")
        return
    stats = per_rank_reads(np.asarray(dataset.labels), np.asarray(dataset.index["shard"]),
                           np.asarray(dataset.index["size"], dtype=np.int64), WORLD_RANKS, P_RANKS)
    _report_ranks(stats, WORLD_RANKS, len(manifest["shards"]))


if __name__ == "__main__":
    main()

"""Reading packed shards from a real SeaweedFS on loopback against the local tar reader, in the same run.

Packs ``--classes`` x ``--per-class`` random-noise PNGs of about 50 KiB
(incompressible; the benchmark reads bytes, it does not decode), uploads them with :func:`pksampler.datasets.upload.upload`, then reads
P x K batches (K adjacent samples of a class per chunk) through
``ShardedDataset.__getitems__``'s prefetch from the store and from the local
folder. Reports samples/s, client CPU per GET (process CPU time / GETs) and
the time from the server answering to the first batch.

Then one epoch of the shard-local plan (``locality="shard"``, P x K, window
``--window``), read from the store by the coalescing reader and through the
node-local block cache (``block_cache``, blocks of ``--block-kib``): GETs per
sample and samples/s of each.

Command::

    python benchmarks/objectstore_read.py --classes 200 --per-class 8 --batches 40
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from objectstore_server import SeaweedServer  # noqa: E402

from pksampler import DistributedBalancedBatchSampler  # noqa: E402
from pksampler.datasets import ShardedDataset  # noqa: E402
from pksampler.datasets.pack import pack  # noqa: E402
from pksampler.datasets.upload import upload  # noqa: E402


def _make_folder(root: Path, classes: int, per_class: int, size: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"c{c:05d}").mkdir(parents=True)
        for v in range(per_class):
            side = int((size / 3) ** 0.5)  # noise PNG: about ``size`` bytes, incompressible
            Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(root / f"c{c:05d}" / f"{v:03d}.png")


def _batches(labels: np.ndarray, p: int, k: int, count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng((seed, 1))
    starts = np.flatnonzero(np.r_[True, labels[1:] != labels[:-1]])
    return [[int(s) + j for s in rng.choice(starts, p, replace=False) for j in range(k)] for _ in range(count)]


def _read(dataset: ShardedDataset, batches: list[list[int]]) -> tuple[float, float, float]:
    """(seconds, CPU seconds, seconds to the first batch) to read every batch's bytes."""
    wall, cpu = time.perf_counter(), time.process_time()
    first = None
    for batch in batches:
        dataset.prefetch(batch)
        for i in batch:
            dataset.read_bytes(i)
        first = first if first is not None else time.perf_counter() - wall
    return time.perf_counter() - wall, time.process_time() - cpu, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=200)
    parser.add_argument("--per-class", type=int, default=8)
    parser.add_argument("--size", type=int, default=50 * 1024)
    parser.add_argument("--p", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=4096)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _make_folder(tmp / "folder", args.classes, args.per_class, args.size, 0)
        pack(tmp / "folder", tmp / "shards", shard_size="16MB")
        server = SeaweedServer(tmp / "seaweed")
        answered = server.start()
        try:
            os.environ.update(server.environment())
            upload(tmp / "shards", "s3://bench/shards")
            local = ShardedDataset(tmp / "shards")
            batches = _batches(np.asarray(local.labels), args.p, args.k, args.batches, 0)
            samples = sum(len(b) for b in batches)
            l_wall, l_cpu, _ = _read(local, batches)
            opened = time.perf_counter()
            remote = ShardedDataset("s3://bench/shards")  # fetches manifest, index, labels into the node cache
            open_s = time.perf_counter() - opened
            r_wall, r_cpu, r_first = _read(remote, batches)
            gets, _ = remote.store.counts()
            plan = DistributedBalancedBatchSampler(local.labels, samples_per_class=args.k, classes_per_step=args.p,
                                                   num_replicas=1, rank=0, seed=0, locality="shard",
                                                   shard_ids=local.shard_ids, window=args.window)
            epoch = [list(b) for b in plan]
            cached = ShardedDataset("s3://bench/shards", block_cache=256 << 20, block_size=args.block_kib << 10,
                                    cache_dir=tmp / "blocks")
            shard_rows = {}
            for name, dataset in (("coalesced", remote), ("block cache", cached)):
                before = dataset.store.counts()[0]
                wall, _, _ = _read(dataset, epoch)
                shard_rows[name] = (dataset.store.counts()[0] - before, wall)
        finally:
            server.stop()
    print(f"server answered after {answered:.2f} s; {samples} samples in {len(batches)} batches of "
          f"{args.p}x{args.k}, {args.size // 1024} KiB each")
    print(f"local tar : {samples / l_wall:9.0f} samples/s, {l_cpu / samples * 1e3:.3f} ms CPU per sample")
    print(f"seaweedfs : {samples / r_wall:9.0f} samples/s, {gets} GETs, {r_cpu / max(gets, 1) * 1e3:.3f} ms CPU per GET, "
          f"first batch {open_s + r_first:.3f} s after opening s3:// (open {open_s:.3f} s)")
    print(f"ratio     : {(samples / r_wall) / (samples / l_wall):.3f} of the local reader's samples/s")
    read = sum(len(b) for b in epoch)
    print(f"shard-local plan, one epoch ({len(epoch)} batches, {read} samples, window {args.window}):")
    for name, (epoch_gets, wall) in shard_rows.items():
        print(f"  {name:11s}: {epoch_gets:6d} GETs ({epoch_gets / read:.3f} per sample), {read / wall:7.0f} samples/s")
    print(f"  GETs, coalesced / block cache: {shard_rows['coalesced'][0] / max(shard_rows['block cache'][0], 1):.1f}x")


if __name__ == "__main__":
    main()

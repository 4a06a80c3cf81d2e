"""Shards read from SeaweedFS on loopback against the same shards on local disk, in one run.

Run: .venv/bin/python benchmarks/objectstore_read.py [--images 2000] [--kib 50] [--workdir DIR]

Writes ``--images`` JPEG-sized payloads of about ``--kib`` KiB (random bytes
behind a real JPEG header are not decodable, so the images are real JPEGs of
noise at the size that gives that many bytes), packs them, starts ``weed
mini`` on free ports (tests/objectstore_server.py), uploads the pack, then
reads every sample in the shard-local plan's batch order (P×K = 32×4, one
process, bytes only, no decode) from disk and from the server:

* samples/s of each reader (and the ratio);
* client CPU per GET: the process's CPU seconds over the GETs the reader made;
* seconds from the server answering to the first batch's bytes (cold cache).

Goals: ≥ 1,000 samples/s from the server, ≤ 1 ms CPU per GET, first batch ≤ 2 s.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def make_images(folder: Path, count: int, kib: int, classes: int = 100) -> None:
    side = int((kib * 1024 / 0.95) ** 0.5)  # a noise JPEG at quality 90 takes about 0.95 bytes per pixel
    generator = np.random.default_rng(0)
    for index in range(count):
        path = folder / f"c{index % classes:04d}" / f"{index:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = generator.integers(0, 256, (side, side, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        path.write_bytes(buffer.getvalue())


def batches(dataset) -> list[list[int]]:
    from pksampler import DistributedBalancedBatchSampler

    sampler = DistributedBalancedBatchSampler(dataset.labels, samples_per_class=4, classes_per_step=32,
                                              num_replicas=1, rank=0, seed=0, locality="shard",
                                              shard_ids=dataset.shard_ids)
    return [list(batch) for batch in sampler]


def read_all(dataset, plan: list[list[int]]) -> tuple[float, float, int]:
    """(seconds, CPU seconds, samples) to read every batch's bytes."""
    started, cpu = time.perf_counter(), time.process_time()
    samples = 0
    for batch in plan:
        dataset.prefetch(batch)
        samples += sum(len(dataset.read_bytes(i)) > 0 for i in batch)
    return time.perf_counter() - started, time.process_time() - cpu, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--kib", type=int, default=50)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    from objectstore_server import SeaweedServer

    from pksampler.datasets import ShardedDataset
    from pksampler.datasets.pack import pack
    from pksampler.datasets.upload import upload

    work = args.workdir or Path(tempfile.mkdtemp(prefix="objectstore_read_"))
    folder, shards = work / "images", work / "shards"
    if not (shards / "manifest.json").is_file():
        make_images(folder, args.images, args.kib)
        pack(folder, shards, shard_size="16MB")
    server = SeaweedServer(work / "seaweed")
    answered = server.start()
    os.environ.update(server.environment(), PKSAMPLER_CACHE=str(work / "cache"))
    try:
        url = "s3://bench/shards"
        upload(shards, url)
        local = ShardedDataset(shards)
        plan = batches(local)
        began = time.perf_counter()
        remote = ShardedDataset(url)
        remote.prefetch(plan[0])
        first = time.perf_counter() - began
        gets_before = remote.store.counts()[0]
        remote_time, remote_cpu, count = read_all(remote, plan)
        gets = remote.store.counts()[0] - gets_before
        local_time, _, _ = read_all(local, plan)
        size = float(np.mean(local.index["size"]))
        print(f"{count} samples of {size / 1024:.1f} KiB in {len(local.shard_names)} shards, "
              f"{len(plan)} batches of 128 (shard-local plan); server answered after {answered:.2f} s")
        print(f"local tar reader: {count / local_time:8.0f} samples/s")
        print(f"SeaweedFS       : {count / remote_time:8.0f} samples/s ({local_time / remote_time:.2f}x the local "
              f"reader), {gets} GETs ({count / max(gets, 1):.1f} samples per GET), "
              f"{1000 * remote_cpu / max(gets, 1):.2f} ms client CPU per GET")
        print(f"first batch: {first:.2f} s after the server answered (manifest, index, labels, one batch)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()

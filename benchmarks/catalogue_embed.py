"""Catalogue embedding throughput: the catalogue path against the trainer's own evaluation path, and -np 2.

On one image folder (``--images`` synthetic product PNGs at 64 px) and one
checkpoint (the demo network with seeded weights, 40 px crops), in one run:

1. reference: the trainer's held-out embedding
   (:func:`pksampler.train.evaluation.heldout.embed`: uint8 workers + the
   device's centre crop, batch 128, no worker processes, one process);
2. the catalogue embedder in one process with the same settings (batch 128,
   ``--workers 0``): the issue's bound is >= 0.9x of (1);
3. the catalogue embedder under ``horovodrun -np 2`` (``--workers 0``), the
   same files written (checked).

Images per second for each (best of three interleaved runs, two for -np 2),
and the ratios. This machine's 2 cores are shared
with other jobs: read the ratios, not the absolute numbers.

Usage::

    python benchmarks/catalogue_embed.py [--images 3000]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from catalogue_fixtures import make_checkpoint, render_folder  # noqa: E402

from pksampler.datasets import CenterView, ImageFolderDataset, LabelledSubset, ToUint8  # noqa: E402
from pksampler.train.catalogue.embed import EmbedOptions, embed_catalogue  # noqa: E402
from pksampler.train.catalogue.model import load_model  # noqa: E402
from pksampler.train.catalogue.parts import read_manifest, read_part  # noqa: E402
from pksampler.train.evaluation.heldout import embed  # noqa: E402
from pksampler.train.runtime.distributed import Backend  # noqa: E402

BATCH = 128


def reference(checkpoint: Path, data: Path) -> float:
    model = load_model(checkpoint)
    dataset = ImageFolderDataset(data, decode_size=model.input_size)
    items = LabelledSubset(dataset, np.arange(len(dataset)), transform=ToUint8(model.input_size))
    start = time.perf_counter()
    embed(model.network, items, Backend(), batch_size=BATCH, view=CenterView(model.image_size))
    return len(dataset) / (time.perf_counter() - start)


def catalogue_one(checkpoint: Path, data: Path, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    manifest = embed_catalogue(checkpoint, str(data), out, Backend(),
                               options=EmbedOptions(batch_size=BATCH, workers=0, part_size=1024, progress_every=1e9))
    return manifest["count"] / (time.perf_counter() - start)


def catalogue_ranks(checkpoint: Path, data: Path, out: Path) -> float:
    """Images per second of the ranks' own embedding (sum of images / slowest rank's time), from the job's line."""
    shutil.rmtree(out, ignore_errors=True)
    command = [str(Path(sys.executable).parent / "horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable,
               str(ROOT / "train" / "embed_catalogue.py"), "--checkpoint", str(checkpoint), "--data", str(data),
               "--out", str(out), "--batch-size", str(BATCH), "--workers", "0", "--part-size", "1024"]
    output = subprocess.run(command, capture_output=True, text=True, check=True,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}).stdout
    return float(re.search(r"this job embedded at (\d+) img/s", output).group(1))


def same_parts(a: Path, b: Path) -> bool:
    ma, mb = read_manifest(a), read_manifest(b)
    return ma["parts"] == mb["parts"] and all(
        np.array_equal(read_part(a, e["part"])[0], read_part(b, e["part"])[0]) for e in ma["parts"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--folder", type=Path, default=Path("workspace/bench-catalogue-embed"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per process, as each rank has under -np 2
    classes = max(1, args.images // 10)
    data = render_folder(args.folder / f"images-{classes * 10}", classes=classes, per_class=10, image_size=64)
    checkpoint = make_checkpoint(args.folder / "best.pt", image_size=40, embedding_dim=64)
    # interleaved, best of three: a busy machine and first-call costs slow both paths alike
    refs, ones, twos = [], [], []
    for _ in range(3):
        refs.append(reference(checkpoint, data))
        ones.append(catalogue_one(checkpoint, data, args.folder / "one"))
    for _ in range(2):
        twos.append(catalogue_ranks(checkpoint, data, args.folder / "two"))
    ref, one, two = max(refs), max(ones), max(twos)
    print(f"images: {classes * 10}, batch {BATCH}, one thread per process; runs (img/s): evaluation path "
          f"{[round(r) for r in refs]}, catalogue {[round(r) for r in ones]}, -np 2 {[round(r) for r in twos]}")
    print(f"| trainer's evaluation path, 1 process | {ref:.0f} img/s | 1.00 |")
    print(f"| catalogue embedder, 1 process | {one:.0f} img/s | {one / ref:.2f} |")
    print(f"| catalogue embedder, horovodrun -np 2 | {two:.0f} img/s | {two / ref:.2f} ({two / one:.2f}x one process) |")
    print(f"the -np 2 parts equal the one-process parts: {same_parts(args.folder / 'one', args.folder / 'two')}")


if __name__ == "__main__":
    main()

"""ImageFolderDataset's scan against a plain os.walk + stat listing.

Run: .venv/bin/python benchmarks/folder_scan.py [--files 1000000] [--classes 10000]

Creates empty ``.jpg`` files (scanning never opens an image, so content does
not matter) in a temporary folder, then times building the dataset (labels,
classes, paths) against ``os.walk`` with one ``os.stat`` per file, the usual
naive listing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--classes", type=int, default=10_000)
    args = parser.parse_args()
    from pksampler.datasets import ImageFolderDataset

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        per_class = args.files // args.classes
        for c in range(args.classes):
            folder = root / f"class_{c:06d}"
            folder.mkdir()
            for i in range(per_class):
                open(folder / f"{i:05d}.jpg", "wb").close()
        print(f"created {per_class * args.classes} files in {args.classes} folders in {time.perf_counter() - started:.1f} s",
              file=sys.stderr)
        started = time.perf_counter()
        dataset = ImageFolderDataset(root)
        scan = time.perf_counter() - started
        started = time.perf_counter()
        count = 0
        for directory, _, files in os.walk(root):
            for name in files:
                os.stat(os.path.join(directory, name))
                count += 1
        naive = time.perf_counter() - started
    print(f"ImageFolderDataset scan: {len(dataset)} files, {len(dataset.classes)} classes in {scan:.2f} s")
    print(f"os.walk + stat listing:  {count} files in {naive:.2f} s  (scan / listing = {scan / naive:.2f})")


if __name__ == "__main__":
    main()

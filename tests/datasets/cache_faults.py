"""Run by test_block_cache_safety.py inside ``unshare -rm`` (a mount namespace of its own, no root needed):
reads a pack through block caches on a full tmpfs, on a read-only tmpfs and in a folder deleted mid-run, and
prints one JSON line: per case, whether every sample matched the local shards and the warnings raised."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from pksampler.datasets import ShardedDataset

BLOCK = 64 << 10


def mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)


def read_all(url: str, folder: Path, *, vanish_after: int | None = None) -> tuple[list[bytes], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remote = ShardedDataset(url, block_cache="16MB", block_size=BLOCK, cache_dir=folder)
        out = []
        for i in range(len(remote)):
            if i == vanish_after:
                shutil.rmtree(folder / "pksampler-blocks-v1")
            out.append(remote.read_bytes(i))
    return out, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def main(local: str, url: str, work: str) -> None:
    work_path = Path(work)
    want = [ShardedDataset(local).read_bytes(i) for i in range(len(ShardedDataset(local)))]
    mount_tmpfs(work_path / "full", "size=160k")
    mount_tmpfs(work_path / "readonly", "ro,size=1m")
    report = {}
    for case, folder, vanish in (("full", work_path / "full", None), ("readonly", work_path / "readonly", None),
                                 ("vanished", work_path / "vanished", len(want) // 2)):
        got, messages = read_all(url, folder, vanish_after=vanish)
        report[case] = {"same": got == want, "warnings": messages,
                        "locks_again": (folder / "pksampler-blocks-v1" / "locks").is_dir()}
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])

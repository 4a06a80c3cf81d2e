"""Upload a packed shard folder to an S3-compatible store: ``python -m pksampler.datasets.upload DIR s3://bucket/prefix``.

The shards go first, then ``index.npy`` and ``labels.npy``, and
``manifest.json`` last: a reader that finds the manifest finds everything it
names (the same rule the packer follows on disk). The uploaded manifest adds
each shard's ETag as the store returned it: readers send it with every
ranged GET (``If-Match``), so a shard replaced on the store is refused by the
server, never read. Credentials and endpoint come
from ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL`` and
``AWS_REGION``; none is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .objectstore import ObjectStore, ObjectStoreError
from .sharded import INDEX_FILE, LABELS_FILE, MANIFEST

__all__ = ["upload"]


def upload(folder: str | Path, url: str, *, progress: bool = False) -> int:
    """Copy the pack in ``folder`` to ``url``; returns the bytes sent."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"upload: no {MANIFEST} in {folder}: pack it first (python -m pksampler.datasets.pack)")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    names = [entry["name"] for entry in manifest["shards"]] + [INDEX_FILE, LABELS_FILE]
    store, sent = ObjectStore(url), 0
    for number, name in enumerate(names, 1):
        data = (folder / name).read_bytes()
        etag = store.put(name, data)
        if number <= len(manifest["shards"]) and etag:
            manifest["shards"][number - 1]["etag"] = etag  # every ranged GET of the shard then sends If-Match
        sent += len(data)
        if progress:
            print(f"upload: {number}/{len(names) + 1} {name} ({len(data):,} bytes)", file=sys.stderr, flush=True)
    data = (json.dumps(manifest, indent=1) + "\n").encode("utf-8")
    store.put(MANIFEST, data)
    if progress:
        print(f"upload: {len(names) + 1}/{len(names) + 1} {MANIFEST} ({len(data):,} bytes, with the shards' ETags)",
              file=sys.stderr, flush=True)
    return sent + len(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a folder written by python -m pksampler.datasets.pack")
    parser.add_argument("url", help="s3://bucket/prefix")
    args = parser.parse_args(argv)
    try:
        sent = upload(args.folder, args.url, progress=True)
    except (ObjectStoreError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"upload: {sent:,} bytes to {args.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Open a catalogue's images from one location string: a folder, a list file, packed shards or ``s3://``.

One check of the location, in one place (the null object is the plain
folder): ``s3://...`` and a folder holding ``manifest.json`` are packed
shards, a regular file is a list file, any other folder an image folder
(``<class>/<image>``). Items are numbered as the dataset numbers them; that
number is the item's global id in the catalogue.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from pksampler.datasets import ImageFolderDataset, ImageLoadError, ListFileDataset, ShardedDataset
from pksampler.datasets.base import LabelledDataset
from pksampler.datasets.objectstore import OutageError
from pksampler.locations import is_remote

from pksampler.train.errors import ConfigError

__all__ = ["SOURCE_KINDS", "item_fingerprints", "item_names", "open_source", "source_fingerprint", "source_kind"]

#: the kinds of catalogue location, as :func:`source_kind` names them
SOURCE_KINDS = ("folder", "list", "shards")


def source_kind(location: str) -> str:
    """``folder``, ``list`` or ``shards`` for ``location``; a ConfigError naming it when it is none of them."""
    if is_remote(location):
        return "shards"
    path = Path(location)
    if path.is_file():
        return "list"
    if path.is_dir():
        return "shards" if (path / "manifest.json").is_file() else "folder"
    raise ConfigError(f"--data: {location!r} is neither a folder, a list file nor an s3:// location (it does not "
                      "exist)")


def open_source(location: str, *, decode_size: int | None = None, outage_seconds: float | None = None
                ) -> LabelledDataset:
    """The dataset at ``location`` with bad images raised (the caller skips and counts them), never replaced.

    ``outage_seconds`` bounds how long an ``s3://`` store that does not answer
    is retried (``--outage-seconds``; the dataset's default when None).
    """
    kind = source_kind(location)
    try:
        if kind == "shards":
            return ShardedDataset(location, on_bad="raise", decode_size=decode_size,
                                  outage_seconds=outage_seconds if is_remote(location) else None)
        if kind == "list":
            return ListFileDataset(location, on_bad="raise", decode_size=decode_size)
        return ImageFolderDataset(location, on_bad="raise", decode_size=decode_size)
    except OutageError as error:
        if outage_seconds is None:  # the dataset's own budget: its message names it
            raise ConfigError(f"--data: {error}") from None
        raise ConfigError(f"--data: {error.failure}; the store failed for {error.seconds:.0f} s, past "
                          f"--outage-seconds {outage_seconds:g}") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"--data: {location!r} ({kind}): {error}") from None


def item_names(dataset: LabelledDataset) -> list[str]:
    """Each item's name, its identity from one version of the catalogue to the next: the file's path relative to
    the source's root (folders, list files), else the dataset's own description (a shard member)."""
    paths, root = getattr(dataset, "paths", None), getattr(dataset, "root", None)
    if paths is not None and root is not None:
        return [os.path.relpath(p, root) for p in paths]
    if paths is not None:
        return [str(p) for p in paths]
    return [dataset.describe(i) for i in range(len(dataset))]


def _item_bytes(dataset: LabelledDataset, index: int) -> bytes:
    reader = getattr(dataset, "read_bytes", None)
    if reader is not None:
        return reader(index)
    with open(dataset.paths[index], "rb") as stream:
        return stream.read()


def _shard_fingerprints(dataset: LabelledDataset, indices: np.ndarray) -> np.ndarray | None:
    """Packed shards whose manifest records each shard's SHA-256: a member's fingerprint is that of (its shard's
    digest, offset, size), content-addressed without reading a byte (an object store needs no GET per item)."""
    manifest, index = getattr(dataset, "manifest", None), getattr(dataset, "index", None)
    if not isinstance(manifest, dict) or index is None:
        return None
    digests = [shard.get("sha256") for shard in manifest.get("shards", ())]
    if not digests or None in digests:
        return None
    records = index[np.asarray(indices, dtype=np.int64)]
    keys = (f"{digests[int(s)]}:{int(o)}:{int(n)}".encode() for s, o, n in
            zip(records["shard"], records["offset"], records["size"]))
    return np.fromiter((int.from_bytes(hashlib.sha256(k).digest()[:8], "little", signed=True) for k in keys),
                       dtype=np.int64, count=len(records))


def item_fingerprints(dataset: LabelledDataset, indices: np.ndarray) -> np.ndarray:
    """int64 content fingerprints (the first 8 bytes of SHA-256 of each item's stored bytes) of ``indices``.

    An item whose image changed gets another fingerprint, so the next
    version embeds it again; one that cannot be read gets 0 (the embedder
    then names it as a bad image). Packed shards with recorded digests are
    not read at all (:func:`_shard_fingerprints`).
    """
    shards = _shard_fingerprints(dataset, indices)
    if shards is not None:
        return shards
    out = np.zeros(len(indices), dtype=np.int64)
    for row, index in enumerate(np.asarray(indices, dtype=np.int64).tolist()):
        try:
            data = _item_bytes(dataset, index)
        except (OSError, ValueError, ImageLoadError):
            continue
        out[row] = np.frombuffer(hashlib.sha256(data).digest()[:8], dtype=np.int64)[0]
    return out


def source_fingerprint(dataset: LabelledDataset) -> str:
    """A digest of what ``dataset`` lists: its items (shard manifest, or file paths) and labels, in order.

    Two sources with the same fingerprint number the same items the same way,
    so parts embedded from one are parts of the other; anything else (another
    folder, an added or removed image, a relabelled one) changes it.
    """
    digest = hashlib.sha256()
    manifest = getattr(dataset, "manifest", None)
    paths = getattr(dataset, "paths", None)
    if isinstance(manifest, dict):
        digest.update(b"shards\0" + json.dumps(manifest, sort_keys=True, default=str).encode())
    elif paths is not None:
        # relative to the source's root: the same folder spelt another way (relative, absolute) is the same source
        root = getattr(dataset, "root", None)
        names = (os.path.relpath(p, root) for p in paths) if root is not None else (str(p) for p in paths)
        digest.update(b"files\0" + "\0".join(names).encode("utf-8", "surrogateescape"))
    else:
        digest.update(b"items\0" + "\0".join(dataset.describe(i) for i in range(len(dataset))).encode())
    digest.update(b"\0labels\0" + np.ascontiguousarray(np.asarray(dataset.labels, dtype=np.int64)).tobytes())
    return digest.hexdigest()

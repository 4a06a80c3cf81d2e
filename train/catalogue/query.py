"""Search the catalogue with query images: top-k as JSON lines, and a result gallery PNG like the trainer's.

1. Query images (files, or folders searched recursively for image files) are
   decoded and prepared as the catalogue was (:mod:`.model`), embedded by the
   checkpoint's model; the index refuses a model whose digest differs from
   the catalogue's.
2. faiss searches at the index's certified ``nprobe``; each query becomes one
   JSON line ``{"query", "results": [{"rank", "id", "path", "class",
   "similarity"}]}`` (the path is the catalogue's own name for the item: a
   file, or ``shard#member`` for packed shards, as its version's item table
   recorded it when it was embedded). A query image that cannot be decoded
   is named and written as ``{"query", "error"}``. A catalogue embedded
   before item tables existed names results from the source's listing, and
   is refused when that listing changed since.
3. The gallery (:func:`~pksampler.train.evaluation.render.save_gallery_png`)
   shows the first queries and their neighbours; a frame is green when the
   neighbour's class is the query's folder name, red otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from pksampler.datasets import ImageLoadError, load_rgb
from pksampler.datasets._image import IMAGE_EXTENSIONS
from pksampler.files import atomic_write_text

from pksampler.train.catalogue.index import load_index
from pksampler.train.catalogue.model import LoadedModel, load_model
from pksampler.train.catalogue.parts import make_out_folder, read_manifest
from pksampler.train.catalogue.sources import item_names, open_source, source_fingerprint
from pksampler.train.catalogue.versions import ItemNames
from pksampler.train.errors import ConfigError
from pksampler.train.evaluation.render import save_gallery_png

__all__ = ["query_catalogue", "query_paths"]


def query_paths(items: Sequence[str | Path]) -> list[Path]:
    """The image files named by ``items``: files as given, folders searched recursively (sorted)."""
    found: list[Path] = []
    for item in map(Path, items):
        if item.is_dir():
            found += sorted(p for p in item.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
        elif item.is_file():
            found.append(item)
        else:
            raise ConfigError(f"images: {str(item)!r} is neither an image file nor a folder")
    if not found:
        raise ConfigError(f"images: {[str(i) for i in items]} hold no image files ({sorted(IMAGE_EXTENSIONS)})")
    return found


def _embed_queries(model: LoadedModel, paths: list[Path], batch_size: int = 64
                   ) -> tuple[np.ndarray, list[Image.Image | None], list[str | None]]:
    """Embeddings of the readable queries, each query's image (None if unreadable) and error (None if fine)."""
    serving, transform = model.serving(), model.worker_transform()
    images, errors, tensors = [], [], []
    for path in paths:
        try:
            image = load_rgb(path, draft_size=model.input_size)
        except ImageLoadError as error:
            print(f"pksampler: query image skipped: {error}", file=sys.stderr, flush=True)
            images.append(None)
            errors.append(str(error))
            continue
        images.append(image)
        errors.append(None)
        tensors.append(transform(image))
    parts = []
    with torch.no_grad():
        for start in range(0, len(tensors), batch_size):
            parts.append(serving(torch.stack(tensors[start:start + batch_size])).numpy())
    embeddings = np.concatenate(parts) if parts else np.zeros((0, model.embedding_dim), dtype=np.float32)
    return embeddings, images, errors


class _Catalogue:
    """Each result's name and class, and its image for the gallery: from the item tables, the image found by name
    in the source as it is now; or, for a catalogue without tables, from the listing as embedded."""

    def __init__(self, metadata: dict[str, Any]) -> None:
        manifest = read_manifest(metadata["catalogue"])
        self.dataset = open_source(metadata["source"]["location"], decode_size=96)
        if manifest.get("versions") and all(v.get("items") or not v.get("count") for v in manifest["versions"]):
            self.names: ItemNames | None = ItemNames(metadata["catalogue"], manifest)
            self._index = {name: i for i, name in enumerate(item_names(self.dataset))}
        else:
            self.names = None
            _check_listing(self.dataset, metadata["source"])

    def __call__(self, item: int) -> tuple[str, str]:
        """``(path, class)`` of id ``item``: a file under the source's root, or a shard member."""
        if self.names is not None:
            name, label = self.names(item)
            root = getattr(self.dataset, "root", None)
            return (str(Path(root) / name) if root is not None and getattr(self.dataset, "paths", None) is not None
                    else name), label
        return self.dataset.describe(item), self.dataset.classes[int(self.dataset.labels[item])]

    def classes(self) -> set[str]:
        return set(self.dataset.classes)

    def tile(self, item: int) -> Any:
        where = item if self.names is None else self._index.get(self.names(item)[0])
        try:
            if where is not None:
                return self.dataset.load(where)
        except ImageLoadError:
            pass
        return Image.new("RGB", (32, 32), (128, 128, 128))


def _gallery(path: Path, catalogue: _Catalogue, rows: list[dict[str, Any]], images: list[Image.Image],
             title: str) -> Path:
    """The PNG of ``rows`` (results with ids and classes) next to their query ``images``."""
    neighbours = [[catalogue.tile(r["id"]) for r in row["results"]] for row in rows]
    correct = np.array([[r["class"] == row["query_class"] for r in row["results"]] for row in rows], dtype=bool)
    similarities = np.array([[r["similarity"] for r in row["results"]] for row in rows], dtype=np.float64)
    return save_gallery_png(path, images, neighbours, correct, similarities=similarities, title=title)


def _check_listing(dataset: Any, source: dict[str, Any]) -> None:
    """A catalogue without item tables: its ids are positions in the listing as embedded, so a source whose listing
    changed since (an image added or removed) would give every later result another file's name (or none)."""
    now, then = source_fingerprint(dataset), str(source.get("digest"))
    if now != then:
        raise ConfigError(f"--index: {source['location']} changed since it was embedded (its listing's digest "
                          f"{now[:12]}, the catalogue's {then[:12]}: images added, removed, renamed or relabelled), "
                          "so result ids would name other files; embed the catalogue again "
                          "(train/embed_catalogue.py) and rebuild the index")


def query_catalogue(index_folder: str | Path, items: Sequence[str | Path], out: str | Path, *,
                    checkpoint: str | Path, k: int = 10, gallery_rows: int = 8) -> list[dict[str, Any]]:
    """Search ``items`` (image files or folders); write ``out/results.jsonl`` and ``out/gallery.png``.

    Returns the JSON lines as dicts (one per query, in the order of the paths).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"--k: must be a positive int, got {k!r}")
    out = make_out_folder(out)  # before any work: a file in the way is one line, not a traceback at the end
    searcher = load_index(index_folder)
    metadata = searcher.metadata
    model = load_model(checkpoint)
    if model.digest != metadata["model"]["digest"]:
        raise ConfigError(f"--checkpoint: {checkpoint} is not the model the catalogue was embedded with (digest "
                          f"{model.digest[:12]}, the index's {metadata['model']['digest'][:12]}: "
                          f"{metadata['model']['checkpoint']})")
    paths = query_paths(items)
    embeddings, images, errors = _embed_queries(model, paths)
    k = min(k, metadata["count"])
    similarities, ids = searcher.search(embeddings, k) if len(embeddings) else (np.zeros((0, k)), np.zeros((0, k)))
    catalogue = _Catalogue(metadata)
    classes = catalogue.classes()
    lines, found = [], iter(zip(similarities.tolist(), ids.tolist()))
    for path, error in zip(paths, errors):
        if error is not None:
            lines.append({"query": str(path), "error": error})
            continue
        row_d, row_i = next(found)
        named = [(r, int(i), catalogue(int(i)), d) for r, (d, i) in enumerate(zip(row_d, row_i)) if i >= 0]
        lines.append({"query": str(path), "query_class": path.parent.name if path.parent.name in classes else None,
                      "results": [{"rank": r + 1, "id": i, "path": name, "class": label,
                                   "similarity": round(float(d), 6)} for r, i, (name, label), d in named]})
    atomic_write_text(out / "results.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
    shown = [(line, image) for line, image in zip(lines, images) if image is not None][:gallery_rows]
    if shown:
        title = (f"catalogue search: top {k} of {metadata['count']} images ({metadata['kind']}"
                 + (f", nprobe {metadata['nprobe']}" if metadata.get("nprobe") else "") + ")")
        _gallery(out / "gallery.png", catalogue, [line for line, _ in shown], [image for _, image in shown], title)
    return lines

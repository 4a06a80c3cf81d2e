"""A checkpoint and a folder of real image files for the catalogue tests, made in a second or two."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pksampler.datasets import SyntheticProducts
from pksampler.train.catalogue.parts import PartPlan, write_manifest, write_part
from pksampler.train.config.load import build_config
from pksampler.train.engine.checkpoint import save_checkpoint
from pksampler.train.modeling.model import build_model


def make_checkpoint(path: Path, *, image_size: int = 24, embedding_dim: int = 16, seed: int = 0,
                    neck: str = "none") -> Path:
    """A training checkpoint (model tensors and config) of a small demo network with seeded random weights
    (a ``batch`` neck with running statistics a training would have left)."""
    config = build_config({"data": {"image_size": image_size},
                           "model": {"width": 8, "depth": [1, 1], "embedding_dim": embedding_dim, "neck": neck}})
    torch.manual_seed(seed)
    model = build_model(config.model, image_size=image_size)
    if neck == "batch":
        model.neck.running_mean.normal_(0.0, 0.1)
        model.neck.running_var.uniform_(0.01, 0.05)
    save_checkpoint(path, {"format": 2, "config": config.to_dict(), "model": model.state_dict()})
    return path


def render_folder(root: Path, *, classes: int, per_class: int, image_size: int = 40) -> Path:
    """``root/<class>/<view>.png``: real PNG files of the synthetic products."""
    SyntheticProducts(classes, per_class, image_size=image_size, root=root)
    return root


def clustered(count: int, dim: int, *, classes: int, seed: int = 0) -> np.ndarray:
    """L2-normalised vectors around ``classes`` centres: the shape of a product catalogue's embeddings."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, dim)).astype(np.float32)
    x = centres[rng.integers(0, classes, count)] + 0.35 * rng.standard_normal((count, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def fake_catalogue(folder, vectors: np.ndarray, *, part_size: int, missing: tuple[int, ...] = ()):
    """Parts and a manifest as the embedder writes them; ``missing`` ids are left out (bad images)."""
    plan = PartPlan(len(vectors), part_size)
    entries = []
    for part in range(plan.num_parts):
        start, stop = plan.bounds(part)
        ids = np.array([i for i in range(start, stop) if i not in missing], dtype=np.int64)
        write_part(folder, part, vectors[ids], ids, {"first": start, "stop": stop, "count": len(ids), "bad": [],
                                                     "model_digest": "d" * 64})
        entries.append({"part": part, "count": len(ids), "first": start, "stop": stop})
    write_manifest(folder, {"model": {"digest": "d" * 64, "checkpoint": "none"},
                            "source": {"location": str(folder), "kind": "folder", "images": len(vectors)},
                            "plan": {"total": plan.total, "part_size": part_size, "parts": plan.num_parts},
                            "dim": vectors.shape[1], "count": sum(e["count"] for e in entries), "bad": len(missing),
                            "bad_ids": list(missing), "parts": entries})
    return folder


def versioned_catalogue(folder, versions: list[tuple[np.ndarray, list[int]]], *, part_size: int,
                        digest: str = "d" * 64):
    """A catalogue of several versions as the embedder lays it out: version ``v`` adds its vectors under the next
    ids (version 1's parts at the top, later ones in ``versions/000v``) and removes the ids it lists."""
    from pksampler.train.catalogue.parts import version_folder

    entries, top_parts, next_id, count = [], [], 0, 0
    for number, (vectors, removed) in enumerate(versions, start=1):
        plan = PartPlan(len(vectors), part_size, first_id=next_id)
        parts = []
        for part in range(plan.num_parts):
            ids, (start, stop) = plan.ids(part), plan.bounds(part)
            write_part(version_folder(folder, number), part, vectors[start:stop], ids,
                       {"first": int(ids[0]), "stop": int(ids[-1]) + 1, "count": len(ids), "bad": [],
                        "model_digest": digest})
            parts.append({"part": part, "count": len(ids), "first": int(ids[0]), "stop": int(ids[-1]) + 1})
        entry = {"version": number, "added": len(vectors), "changed": 0, "removed": list(removed), "items": None,
                 "count": len(vectors), "model_digest": digest}
        if number == 1:
            top_parts, top_plan = parts, {"total": plan.total, "part_size": part_size, "parts": plan.num_parts}
        else:
            entry.update(plan={"first_id": next_id, "total": plan.total, "part_size": part_size}, parts=parts)
        entries.append(entry)
        next_id, count = next_id + len(vectors), count + len(vectors) - len(removed)
    write_manifest(folder, {"model": {"digest": digest, "checkpoint": "none"},
                            "source": {"location": str(folder), "kind": "folder", "images": count},
                            "plan": top_plan, "dim": versions[0][0].shape[1], "count": count, "embedded": next_id,
                            "bad": 0, "bad_ids": [], "next_id": next_id, "parts": top_parts, "versions": entries})
    return folder

"""A catalogue that grows by 1 %: updating its index in place against rebuilding it, in time and in recall.

A synthetic catalogue of ``--count`` x ``--dim`` L2-normalised vectors
(products of 50 views around a centre, as ``benchmarks/catalogue_index.py``
makes them) is written as the embedder's version 1 and indexed
(``ivfflat``, the defaults of ``train/build_index.py`` otherwise). Version 2
adds ``--growth`` of new products' views under new ids and removes as many
random ids. Then, in this process, with faiss on ``--threads`` threads:

* **update**: :func:`~pksampler.train.catalogue.update.grow_index` on the
  version-1 index (reads the new part, checks drift, writes the delta);
* **rebuild**: :func:`~pksampler.train.catalogue.index.build_index` of
  version 2 into another folder (trains the quantiser, adds every vector,
  certifies, writes the file); its ``build_seconds`` (train and add only)
  is reported too;
* **load**: :func:`~pksampler.train.catalogue.index.load_index` of each
  (the updated one merges its delta);
* **recall** against exact search over the live vectors, for ``--queries``
  new views of random live products, both indexes at the same nprobes (each
  build's certified one, and 64): Recall@10 (the exact nearest neighbour is among
  the first ten, the certificate's definition) and 10-recall@10 (the share
  of the exact ten found).

Usage::

    python benchmarks/catalogue_growth.py                       # 10^6 x 64, +1 % -1 %
    python benchmarks/catalogue_growth.py --count 100000        # a quick look
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import faiss
import numpy as np

from pksampler.train.catalogue.index import IndexOptions, build_index, load_index
from pksampler.train.catalogue.parts import PartPlan, version_folder, write_manifest, write_part
from pksampler.train.catalogue.update import grow_index

PART_SIZE = 65536
VIEWS = 50


def _views(centres: np.ndarray, products: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    x = centres[products] + 0.5 * rng.standard_normal((len(products), centres.shape[1]), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _write_version(folder: Path, number: int, vectors: np.ndarray, first_id: int) -> dict:
    """One version's parts, as the embedder writes them; returns its manifest entry."""
    plan = PartPlan(len(vectors), PART_SIZE, first_id=first_id)
    parts = []
    for part in range(plan.num_parts):
        ids, (start, stop) = plan.ids(part), plan.bounds(part)
        record = {"first": int(ids[0]), "stop": int(ids[-1]) + 1, "count": len(ids), "bad": [],
                  "model_digest": "synthetic"}
        write_part(version_folder(folder, number), part, vectors[start:stop], ids, record)
        parts.append({k: record[k] for k in ("first", "stop", "count")} | {"part": part})
    return {"version": number, "added": len(vectors), "changed": 0, "removed": [], "items": None,
            "count": len(vectors), "model_digest": "synthetic", "parts": parts,
            "plan": {"first_id": first_id, "total": plan.total, "part_size": PART_SIZE}}


def generate(folder: Path, count: int, dim: int, growth: float, seed: int = 0
             ) -> tuple[np.ndarray, np.ndarray, int]:
    """Version 1's ``count`` vectors; returns the product centres, each id's product (version 2's ids included:
    what new views are drawn around) and how many vectors version 2 adds."""
    products = max(1, count // VIEWS)
    extra = max(1, round(count * growth))
    centres = np.random.default_rng([seed, 0]).standard_normal((products + extra // VIEWS + 1, dim),
                                                               dtype=np.float32)
    owner = np.concatenate([np.arange(count) // VIEWS % products, products + np.arange(extra) // VIEWS])
    rng = np.random.default_rng([seed, 1])
    first = _write_version(folder, 1, _views(centres, owner[:count], rng), 0)
    manifest = {"model": {"digest": "synthetic", "checkpoint": "none"},
                "source": {"location": "synthetic", "kind": "synthetic", "images": count},
                "plan": {"total": count, "part_size": PART_SIZE, "parts": len(first["parts"])}, "dim": dim,
                "count": count, "embedded": count, "bad": 0, "bad_ids": [], "next_id": count,
                "parts": first.pop("parts"), "versions": [{**first, "plan": None}]}
    write_manifest(folder, manifest)
    return centres, owner, extra


def _grow(folder: Path, centres: np.ndarray, owner: np.ndarray, count: int, extra: int, seed: int) -> np.ndarray:
    """Version 2: ``extra`` new views under new ids, as many random version-1 ids removed; returns those ids."""
    rng = np.random.default_rng([seed, 2])
    removed = np.sort(rng.choice(count, size=extra, replace=False))
    entry = _write_version(folder, 2, _views(centres, owner[count:], rng), count)
    entry["removed"] = removed.tolist()
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.update(count=count, embedded=count + extra, next_id=count + extra,
                    versions=[*manifest["versions"], entry])
    write_manifest(folder, {k: v for k, v in manifest.items() if k not in ("format", "version")})
    return removed


def _recall(index: faiss.Index, nprobe: int, queries: np.ndarray, exact: np.ndarray) -> dict:
    faiss.extract_index_ivf(index).nprobe = nprobe
    _, found = index.search(queries, 10)
    first = float(np.mean([exact[q, 0] in found[q] for q in range(len(queries))]))
    overlap = float(np.mean([len(set(exact[q]) & set(found[q])) / 10 for q in range(len(queries))]))
    return {"nprobe": nprobe, "recall_at_10": first, "ten_recall_at_10": overlap}


def _live(catalogue: Path) -> tuple[np.ndarray, np.ndarray]:
    from pksampler.train.catalogue.parts import iter_parts, read_manifest

    found = [(np.asarray(e), np.asarray(i)) for _, e, i in iter_parts(catalogue, read_manifest(catalogue))]
    return np.concatenate([e for e, _ in found]), np.concatenate([i for _, i in found])


def run(work: Path, count: int, dim: int, growth: float, queries: int, threads: int, seed: int = 0) -> dict:
    faiss.omp_set_num_threads(threads)
    shutil.rmtree(work, ignore_errors=True)
    catalogue = work / "catalogue"
    centres, owner, extra = generate(catalogue, count, dim, growth, seed)
    options = IndexOptions(kind="ivfflat", seed=seed)
    base = grow_index(catalogue, work / "updated", options=options)
    removed = _grow(catalogue, centres, owner, count, extra, seed)
    started = time.perf_counter()
    updated = grow_index(catalogue, work / "updated", options=options)
    update_seconds = time.perf_counter() - started
    started = time.perf_counter()
    rebuilt = build_index(catalogue, work / "rebuilt", options=options)
    rebuild_seconds = time.perf_counter() - started
    loads = {}
    for name in ("updated", "rebuilt"):
        started = time.perf_counter()
        loads[name] = (load_index(work / name), time.perf_counter() - started)
    vectors, ids = _live(catalogue)
    rng = np.random.default_rng([seed, 3])
    picked = owner[ids[rng.choice(len(ids), size=queries, replace=False)]]
    query = _views(centres, picked, rng)
    _, local = faiss.knn(query, vectors, 10, metric=faiss.METRIC_INNER_PRODUCT)
    exact = ids[local]
    nprobes = sorted({base["nprobe"], rebuilt["nprobe"], 64})
    recall = {name: [_recall(searcher.index, nprobe, query, exact) for nprobe in nprobes]
              for name, (searcher, _) in loads.items()}
    return {"count": count, "dim": dim, "added": extra, "removed": len(removed), "threads": threads,
            "nlist": base["nlist"], "certified_nprobe_v1": base["nprobe"], "certified_nprobe_rebuilt": rebuilt["nprobe"],
            "how": updated["history"][-1]["how"], "live": updated["count"],
            "index_holds": int(loads["updated"][0].index.ntotal),
            "base_build_seconds": base["history"][0]["seconds"], "update_seconds": round(update_seconds, 3),
            "rebuild_seconds": round(rebuild_seconds, 3), "rebuild_build_seconds": rebuilt["build_seconds"],
            "update_share_of_rebuild": update_seconds / rebuild_seconds,
            "update_share_of_rebuild_build_only": update_seconds / rebuilt["build_seconds"],
            "load_seconds": {name: round(seconds, 3) for name, (_, seconds) in loads.items()},
            "drift_ratio": updated["last_drift"]["ratio"], "recall": recall}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--growth", type=float, default=0.01, help="share added, and removed, by version 2")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/pksampler-catalogue-growth"))
    args = parser.parse_args(argv)
    result = run(args.work, args.count, args.dim, args.growth, args.queries, args.threads)
    print(json.dumps(result, indent=1))
    shutil.rmtree(args.work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()

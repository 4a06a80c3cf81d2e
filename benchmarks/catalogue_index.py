"""The catalogue index at scale: build time, peak memory, certified recall and single-query latency.

A synthetic catalogue of ``--count`` x ``--dim`` L2-normalised vectors
(``--count / 50`` products, 50 views each, scattered around each product's
centre, like a product-recognition embedding) is written as the embedder's
parts (:mod:`pksampler.train.catalogue.parts`, 65,536 rows each). A fresh
process then builds the index with the defaults of ``train/build_index.py``
(:func:`~pksampler.train.catalogue.index.build_index`) and reports:

* build time (training the quantiser, adding every part), and the time of one
  plain pass over the parts in the same process (the reference: the ratio is
  the build's cost in reads of the catalogue);
* peak RSS of the building process (``ru_maxrss``), against the 8 GiB target;
* the certificate: Recall@1 and Recall@10 against exact search on sampled
  catalogue vectors (self excluded), at the nprobe the builder chose;
* single-query latency (one thread, one query at a time, median and p99), and
  the exact scan of the same queries over the parts as the reference.

Usage::

    flock /tmp/pksampler-heavy.lock python benchmarks/catalogue_index.py               # 10^7 x 128
    flock /tmp/pksampler-heavy.lock python benchmarks/catalogue_index.py --kind ivfpq   # codes + re-rank from the parts
    python benchmarks/catalogue_index.py --count 200000                                   # a quick look
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pksampler.train.catalogue.parts import PartPlan, write_manifest, write_part

PART_SIZE = 65536
VIEWS = 50


def generate(folder: Path, count: int, dim: int, seed: int = 0) -> None:
    """The synthetic catalogue's parts and manifest (skipped when a manifest of this size exists)."""
    manifest = folder / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text())["count"] == count:
        return
    plan = PartPlan(count, PART_SIZE)
    products = max(1, count // VIEWS)
    centres = np.random.default_rng([seed, 0]).standard_normal((products, dim), dtype=np.float32)
    entries = []
    for part in range(plan.num_parts):
        start, stop = plan.bounds(part)
        rng = np.random.default_rng([seed, 1, part])
        ids = np.arange(start, stop, dtype=np.int64)
        x = centres[ids // VIEWS % products] + 0.5 * rng.standard_normal((stop - start, dim), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        write_part(folder, part, x, ids, {"first": start, "stop": stop, "count": stop - start, "bad": []})
        entries.append({"part": part, "count": stop - start, "first": start, "stop": stop})
    write_manifest(folder, {"model": {"digest": "synthetic", "checkpoint": "none"},
                            "source": {"location": "synthetic", "kind": "synthetic", "images": count},
                            "plan": {"total": count, "part_size": PART_SIZE, "parts": plan.num_parts},
                            "dim": dim, "count": count, "bad": 0, "bad_ids": [], "parts": entries})


def build_and_measure(catalogue: Path, out: Path, latency_queries: int, kind: str) -> dict:
    """In this (fresh) process: a pass over the parts, the build, then single-query latencies."""
    import faiss

    from pksampler.train.catalogue.index import IndexOptions, build_index, load_index
    from pksampler.train.catalogue.parts import iter_parts, read_manifest

    manifest = read_manifest(catalogue)
    started = time.perf_counter()
    total = sum(len(ids) for _, _, ids in iter_parts(catalogue, manifest, mmap=False))  # reads every byte
    read_seconds = time.perf_counter() - started
    meta = build_index(catalogue, out, options=IndexOptions(kind=kind))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del meta
    searcher = load_index(out)
    meta = searcher.metadata
    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(7)
    queries = rng.standard_normal((latency_queries, manifest["dim"]), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    times = []
    for q in queries:
        t = time.perf_counter()
        searcher.search(q[None], 10)
        times.append(time.perf_counter() - t)
    scan = queries[:5]
    t = time.perf_counter()
    for _, embeddings, _ in iter_parts(catalogue, manifest):
        faiss.knn(scan, np.ascontiguousarray(embeddings), 10, metric=faiss.METRIC_INNER_PRODUCT)
    exact_ms = 1000 * (time.perf_counter() - t) / len(scan)
    return {"count": int(total), "dim": manifest["dim"], "kind": meta["kind"], "nlist": meta["nlist"],
            "nprobe": meta["nprobe"], "build_seconds": meta["build_seconds"], "read_seconds": round(read_seconds, 2),
            "peak_rss_gib": round(peak / 2**30, 2), "index_gib": round(meta["index_bytes"] / 2**30, 2),
            "recall_at_1": meta["certificate"]["recall_at_1"], "recall_at_10": meta["certificate"]["recall_at_10"],
            "se_recall_at_1": meta["certificate"]["se_recall_at_1"], "certificate_queries": meta["certificate"]["queries"],
            "latency_ms_median": round(1000 * float(np.median(times)), 3),
            "latency_ms_p99": round(1000 * float(np.percentile(times, 99)), 3),
            "exact_scan_ms_per_query": round(exact_ms, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--folder", type=Path, default=Path("workspace/bench-catalogue-index"))
    parser.add_argument("--latency-queries", type=int, default=200)
    parser.add_argument("--kind", default="auto", help="the index kind (default: build_index.py's default)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    catalogue = args.folder / f"catalogue-{args.count}x{args.dim}"
    out = args.folder / f"index-{args.count}x{args.dim}-{args.kind}"
    if args.child:
        print(json.dumps(build_and_measure(catalogue, out, args.latency_queries, args.kind)))
        return
    started = time.perf_counter()
    generate(catalogue, args.count, args.dim)
    print(f"catalogue: {args.count} x {args.dim} in {catalogue} ({time.perf_counter() - started:.0f} s)", flush=True)
    child = subprocess.run([sys.executable, __file__, "--child", "--count", str(args.count), "--dim", str(args.dim),
                            "--folder", str(args.folder), "--latency-queries", str(args.latency_queries),
                            "--kind", args.kind],
                           capture_output=True, text=True, check=True)
    result = json.loads(child.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))
    print(f"| {result['count']:,} x {result['dim']} | {result['kind']} (nlist {result['nlist']}, nprobe "
          f"{result['nprobe']}) | {result['build_seconds']:.0f} s ({result['build_seconds'] / result['read_seconds']:.1f}"
          f"x one read of the parts) | {result['peak_rss_gib']} GiB | {result['recall_at_1']:.4f} ± "
          f"{result['se_recall_at_1']:.4f} | {result['recall_at_10']:.4f} | {result['latency_ms_median']} ms (p99 "
          f"{result['latency_ms_p99']}; exact scan {result['exact_scan_ms_per_query']} ms) |")


if __name__ == "__main__":
    main()

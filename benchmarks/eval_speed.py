"""retrieval_metrics against the bare faiss search it is built on.

Run: .venv/bin/python benchmarks/eval_speed.py [--num 100000] [--dim 128] [--per-class 10]

The query set is its own gallery (the usual held-out-classes protocol), with
``num / per_class`` classes of ``per_class`` clustered items each. The
reference is one ``IndexFlatIP.search`` of all queries for the number of
neighbours MAP@R needs (max R + 1 for the query itself). Reported: both
times, their ratio (target <= 1.3) and the peak memory each adds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import measure  # noqa: E402


def clustered_embeddings(num: int, dim: int, per_class: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = np.arange(num) // per_class
    centres = rng.normal(size=(labels.max() + 1, dim)).astype(np.float32)
    x = centres[labels] + 2.0 * rng.normal(size=(num, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--per-class", type=int, default=10)
    args = parser.parse_args()

    import faiss

    from pksampler.train.evaluation.metrics import retrieval_metrics

    x, labels = clustered_embeddings(args.num, args.dim, args.per_class)
    k = max(10, args.per_class - 1) + 1

    def bare() -> tuple:
        index = faiss.IndexFlatIP(args.dim)
        index.add(x)
        return index.search(x, k)

    bare_seconds, bare_peak = measure(bare, repeats=1)
    ours_seconds, ours_peak = measure(lambda: retrieval_metrics(x, labels), repeats=1)
    metrics = retrieval_metrics(x[:2000], labels[:2000])
    mib = 2**20
    print(f"{args.num} queries x {args.num} gallery x {args.dim}-d, {args.per_class} per class, faiss threads {faiss.omp_get_max_threads()}")
    print(f"  bare faiss search (k={k})     {bare_seconds:8.2f} s  {bare_peak / mib:8.1f} MiB")
    print(f"  retrieval_metrics            {ours_seconds:8.2f} s  {ours_peak / mib:8.1f} MiB")
    print(f"  ratio                        {ours_seconds / bare_seconds:8.3f}   (target <= 1.3)")
    print(f"  (sanity, first 2000: recall@1 {metrics['recall_at_1']:.3f}, MAP@R {metrics['map_at_r']:.3f})")


if __name__ == "__main__":
    main()

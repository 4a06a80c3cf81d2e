"""Gallery-sharded exact evaluation against one bare faiss.knn over the whole gallery, in one run.

Run (the full size; it needs about 6 GiB in the first process, so take the
shared lock on a shared machine):

    flock /tmp/pksampler-heavy.lock .venv/bin/python benchmarks/sharded_eval.py \
        --num 10000000 --dim 128 --per-class 10 --queries 10000 --np 2

The gallery: ``num / per_class`` classes of ``per_class`` items, unit
vectors around a class centre, classes in families of 100 around a family
centre. Item i's vector comes from a counter-based
generator (Philox) keyed by the seed and the block holding i, so every rank
generates only its own contiguous share and W = 1 and W = 2 see the same
gallery; no rank ever builds it whole.

In this one run:

1. **reference**: the whole gallery built in this process, one bare
   ``faiss.knn`` of the queries over it for the k that MAP@R needs
   (``--np`` faiss threads: the cores the ranks get);
2. **W = 1**: :func:`sharded_retrieval` in this process over the same array (one faiss thread);
3. **W = np**: ``torchrun --nproc-per-node np`` ranks (gloo, one thread
   each), each generating and searching its share.

With ``--ivf`` (e.g. ``--num 1000000 --ivf --queries 10000``): the
approximate mode on the self-gallery protocol (every item a query) on
``--np`` ranks, with its built-in exact check on ``--queries`` sampled
queries; printed: the wall time and the Recall@1 and MAP@R gaps to exact.

``--metric cosine`` (default ``ip``) measures the cosine path, which
normalises the shard block by block while it searches.

Printed: wall time of each (the ranks': the slowest rank's call), the ratio
W = np / reference (target <= 1.15), peak RSS per rank (target <= 3.0 GiB at
10^7 x 128), bytes each rank received against Q·d·4 + W·Q·k·12, and whether
the W = 1 and W = np metrics are bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

#: items generated per block of the counter-based generator (a multiple of every --per-class used)
BLOCK = 40_960


#: classes that share a family centre (real catalogues have families of similar products)
CLASSES_PER_FAMILY = 100


def _unit(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((rows, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def block_vectors(block: int, *, num: int, dim: int, per_class: int, seed: int) -> np.ndarray:
    """Items ``[block * BLOCK, ...)``: the same bits on every rank that generates this block.

    Item = family direction + 0.7 x class direction + 1.2 x noise (each unit-norm
    in expectation), normalised: classes of similar items inside families of
    similar classes, the structure an IVF's coarse quantizer finds in real
    embeddings (isotropic data has none).
    """
    start, stop = block * BLOCK, min((block + 1) * BLOCK, num)
    rng = np.random.Generator(np.random.Philox(key=seed, counter=[block, 0, 0, 0]))
    classes = np.arange(start // per_class, -(-stop // per_class))
    families = np.unique(classes // CLASSES_PER_FAMILY)
    family_rng = [np.random.Generator(np.random.Philox(key=seed, counter=[f, 1, 0, 0])) for f in families]
    family = np.concatenate([_unit(r, 1, dim) for r in family_rng])
    centres = family[np.searchsorted(families, classes // CLASSES_PER_FAMILY)] + 0.7 * _unit(rng, classes.size, dim)
    x = np.repeat(centres, per_class, axis=0)[:stop - start]
    x += (1.2 / np.sqrt(dim)) * rng.standard_normal(x.shape, dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def shard(rank: int, size: int, *, num: int, dim: int, per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s contiguous run of blocks and their global ids (labels are ``id // per_class``)."""
    blocks = -(-num // BLOCK)
    first, last = blocks * rank // size, blocks * (rank + 1) // size
    ids = np.arange(first * BLOCK, min(last * BLOCK, num), dtype=np.int64)
    out = np.empty((ids.size, dim), dtype=np.float32)
    for block in range(first, last):
        rows = slice(block * BLOCK - first * BLOCK, min((block + 1) * BLOCK, num) - first * BLOCK)
        out[rows] = block_vectors(block, num=num, dim=dim, per_class=per_class, seed=seed)
    return out, ids


def query_ids(num: int, per_class: int, queries: int) -> np.ndarray:
    from pksampler.train.evaluation import stratified_queries

    return stratified_queries(np.arange(num, dtype=np.int64) // per_class, queries, seed=0)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def rank_main(args: argparse.Namespace) -> None:
    """One torchrun rank: its share, one sharded_retrieval, one JSON line."""
    import datetime

    import torch.distributed as dist

    from pksampler.train.evaluation import sharded_retrieval

    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    rank, size = dist.get_rank(), dist.get_world_size()
    # The query sample first: drawing it over 10^7 global labels takes ~0.4 GiB for a moment, which must
    # not stack on the resident shard.
    if args.ivf:  # the self-gallery protocol: every item a query, checked exactly on a sample
        options = {"index": "ivf", "nprobe": args.nprobe, "check_queries": args.queries}
    else:
        options = {"query_ids": query_ids(args.num, args.per_class, args.queries)}
    x, ids = shard(rank, size, num=args.num, dim=args.dim, per_class=args.per_class, seed=args.seed)
    dist.barrier()
    start = time.perf_counter()
    result = sharded_retrieval(x, ids // args.per_class, ids, metric=args.metric, **options)
    wall = time.perf_counter() - start
    line = "RANK " + json.dumps({"rank": rank, "wall_s": wall, "peak_rss_gib": peak_rss_gib(),
                                 "bytes": result.bytes_received, "metrics": result.metrics})
    os.write(1, (line + "\n").encode())  # one write: the ranks share the launcher's pipe
    dist.destroy_process_group()


def reference_and_w1(args: argparse.Namespace) -> dict:
    """The whole gallery here: one bare faiss.knn (the reference) and the W = 1 sharded run."""
    import faiss

    from pksampler.train.evaluation import sharded_retrieval

    queries = query_ids(args.num, args.per_class, args.queries)
    x, ids = shard(0, 1, num=args.num, dim=args.dim, per_class=args.per_class, seed=args.seed)
    k = max(10, args.per_class - 1)
    faiss.omp_set_num_threads(args.bare_threads or args.np)
    faiss.knn(x[queries[:64]], x[:BLOCK], k + 1, metric=faiss.METRIC_INNER_PRODUCT)  # warm-up: BLAS, threads
    start = time.perf_counter()
    faiss.knn(x[queries], x, k + 1, metric=faiss.METRIC_INNER_PRODUCT)
    bare = time.perf_counter() - start
    faiss.omp_set_num_threads(1)
    start = time.perf_counter()
    one = sharded_retrieval(x, ids // args.per_class, ids, query_ids=queries, metric=args.metric)
    return {"bare_s": bare, "w1_s": time.perf_counter() - start, "metrics": one.metrics, "k": k}


def launch_ranks(args: argparse.Namespace) -> list[dict]:
    # The ranks read their arguments from the environment: torchrun's own parser would take --num etc.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.np),
               "--master-port", str(args.port), __file__]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDED_EVAL_RANK_ARGS": json.dumps(vars(args))}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("RANK ")]
    if done.returncode != 0 or len(lines) != args.np:
        sys.exit(f"the ranks failed (status {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return sorted(lines, key=lambda line: line["rank"])


def report_ivf(args: argparse.Namespace, ranks: list[dict]) -> None:
    metrics = ranks[0]["metrics"]
    same = all(rank["metrics"] == metrics for rank in ranks)
    print(f"IVF self-gallery: {args.num:,} x {args.dim} fp32, every item a query, "
          f"{args.num // args.per_class:,} classes of {args.per_class}; nprobe {args.nprobe}, W = {args.np}")
    print(f"wall time (slowest rank, IVF search + exact check on {metrics['ivf_check_queries']:,} queries): "
          f"{max(rank['wall_s'] for rank in ranks):.1f} s; ranks agree: {same}")
    print(f"Recall@1 {metrics['recall_at_1']:.4f}, MAP@R {metrics['map_at_r']:.4f}; gap to exact on the sample: "
          f"Recall@1 {100 * metrics['ivf_gap_recall_at_1']:+.2f} pp, MAP@R {100 * metrics['ivf_gap_map_at_r']:+.2f} pp")
    for rank in ranks:
        print(f"  rank {rank['rank']}: {rank['wall_s']:.1f} s, peak RSS {rank['peak_rss_gib']:.2f} GiB, "
              f"received {rank['bytes'] / 1e6:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--per-class", type=int, default=10)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("--ivf", action="store_true",
                        help="the approximate mode on a self-gallery (every item a query); --queries: its exact check")
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--ranks-only", action="store_true",
                        help="only the W = --np ranks (their memory and time), without the two references")
    parser.add_argument("--metric", choices=("ip", "cosine", "l2"), default="ip",
                        help="the evaluation's metric (the gallery's rows are unit vectors; cosine normalises anyway)")
    parser.add_argument("--bare-threads", type=int, default=None,
                        help="faiss threads of the reference search and the W = 1 run (default: --np)")
    if "SHARDED_EVAL_RANK_ARGS" in os.environ:
        rank_main(argparse.Namespace(**json.loads(os.environ["SHARDED_EVAL_RANK_ARGS"])))
        return
    args = parser.parse_args()
    if args.num % args.per_class or BLOCK % args.per_class:
        sys.exit(f"--num and {BLOCK} must be multiples of --per-class, got --num {args.num} "
                 f"--per-class {args.per_class}")
    if args.ivf:
        report_ivf(args, launch_ranks(args))
        return
    if args.ranks_only:
        for rank in launch_ranks(args):
            print(f"rank {rank['rank']}: {rank['wall_s']:.1f} s, peak RSS {rank['peak_rss_gib']:.2f} GiB, "
                  f"received {rank['bytes'] / 1e6:.1f} MB, Recall@1 {rank['metrics']['recall_at_1']:.4f}")
        return
    here = reference_and_w1(args)
    ranks = launch_ranks(args)
    wall = max(rank["wall_s"] for rank in ranks)
    q, d, w, k = args.queries, args.dim, args.np, here["k"]
    print(f"gallery {args.num:,} x {d} fp32 ({args.num * d * 4 / 2**30:.2f} GiB), {q:,} queries, "
          f"{args.num // args.per_class:,} classes of {args.per_class}; k = {k}")
    print(f"bare faiss.knn, whole gallery, {args.bare_threads or w} threads: {here['bare_s']:.1f} s")
    print(f"sharded_retrieval, W = 1 (one process, 1 thread): {here['w1_s']:.1f} s")
    print(f"sharded_retrieval, W = {w} (torchrun ranks): {wall:.1f} s = {wall / here['bare_s']:.2f}x the bare search")
    for rank in ranks:
        print(f"  rank {rank['rank']}: {rank['wall_s']:.1f} s, peak RSS {rank['peak_rss_gib']:.2f} GiB "
              f"(its share {args.num // w * d * 4 / 2**30:.2f} GiB), received {rank['bytes'] / 1e6:.1f} MB")
    print(f"bytes bound Q·d·4 + W·Q·k·12 = {(q * d * 4 + w * q * k * 12) / 1e6:.1f} MB")
    same = all(rank["metrics"] == json.loads(json.dumps(here["metrics"])) for rank in ranks)
    print(f"metrics at W = 1 and W = {w} bit-identical: {same}; Recall@1 {here['metrics']['recall_at_1']:.4f} "
          f"± {here['metrics']['recall_at_1_se']:.4f}, MAP@R {here['metrics']['map_at_r']:.4f}")


if __name__ == "__main__":
    main()

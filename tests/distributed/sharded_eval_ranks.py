"""Real ranks (horovodrun or torchrun) run sharded_retrieval on their shares; each prints what it got.

Run by tests/distributed/test_sharded_eval.py, which compares every rank's
line with one process's :func:`evaluate_retrieval` on the whole gallery.
Each rank holds a random share of a clustered gallery (global id = row).

Printed per rank: ``SHARDED-ALL rank r {json}`` (every item a query),
``SHARDED-SAMPLED rank r {json}`` (a stratified sample of queries),
``SHARDED-IVF rank r {json}`` (the approximate mode, with its exact check) and
``MISMATCH-RAISED rank r`` when the ranks pass different query ids.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def gallery(seed: int = 5, classes: int = 40, dim: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """Classes of 1 to 40 items around their centres, with some exact duplicates (ties)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 40, size=classes)
    labels = np.repeat(np.arange(classes) * 3 + 1, sizes)
    centres = rng.normal(size=(classes, dim))
    x = centres[np.repeat(np.arange(classes), sizes)] + 0.9 * rng.normal(size=(labels.size, dim))
    copies = rng.choice(labels.size, size=labels.size // 10, replace=False)
    x[copies] = x[rng.choice(labels.size, size=copies.size)]
    return x.astype(np.float32), labels


SHOWN = [0, 50, 333]
SAMPLED = 200


def start_runtime() -> tuple[int, int]:
    if "--horovod" in sys.argv:
        import horovod.torch as hvd

        hvd.init()
        return hvd.rank(), hvd.size()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def say(text: str) -> None:
    """One write per line: the ranks share the launcher's pipe, and print() may split a line in two writes."""
    os.write(1, (text + "\n").encode())


def line(tag: str, rank: int, result) -> str:
    return f"{tag} rank {rank} " + json.dumps({"metrics": result.metrics, "neighbours": result.neighbours.tolist(),
                                               "queries": int(result.query_ids.size),
                                               "bytes": result.bytes_received})


def stop_runtime() -> None:
    """Close torchrun's process group: a Gloo group left to the interpreter's exit may abort it
    ("terminate called without an active exception", SIGABRT) while its threads still run."""
    if "--horovod" in sys.argv:
        return
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    rank, size = start_runtime()
    from pksampler.train.evaluation import sharded_retrieval, stratified_queries

    x, labels = gallery()
    owner = np.random.default_rng(11).integers(0, size, size=labels.size)
    mine = np.flatnonzero(owner == rank)
    result = sharded_retrieval(x[mine], labels[mine], mine, neighbour_ids=SHOWN, num_neighbours=6,
                               max_neighbours_per_chunk=500)
    say(line("SHARDED-ALL", rank, result))
    queries = stratified_queries(labels, SAMPLED, seed=2)
    result = sharded_retrieval(x[mine], labels[mine], mine, query_ids=queries)
    say(line("SHARDED-SAMPLED", rank, result))
    result = sharded_retrieval(x[mine], labels[mine], mine, index="ivf", nlist=8, nprobe=3, check_queries=300)
    say(line("SHARDED-IVF", rank, result))
    try:
        sharded_retrieval(x[mine], labels[mine], mine, query_ids=[rank])
    except ValueError as error:
        if "different query_ids" in str(error):
            say(f"MISMATCH-RAISED rank {rank}")
    stop_runtime()


if __name__ == "__main__":
    main()

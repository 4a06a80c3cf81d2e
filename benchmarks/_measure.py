"""Timing and peak-memory helpers for the benchmark scripts."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (Linux)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * _PAGE


def _watch(done: threading.Event, peak: list[int]) -> None:
    while not done.is_set():
        peak[0] = max(peak[0], rss_bytes())
        time.sleep(0.0002)


def measure(function: Callable[[], Any], repeats: int = 3) -> tuple[float, int]:
    """Best wall time over ``repeats`` runs and the peak RSS added by one run.

    The peak is sampled every 0.2 ms by a thread, so it sees numpy and torch
    allocations alike (tracemalloc does not see torch's).
    """
    best = float("inf")
    peak_added = 0
    for _ in range(repeats):
        baseline = rss_bytes()
        peak = [baseline]
        done = threading.Event()

        watcher = threading.Thread(target=_watch, args=(done, peak), daemon=True)
        watcher.start()
        start = time.perf_counter()
        result = function()
        elapsed = time.perf_counter() - start
        peak[0] = max(peak[0], rss_bytes())
        done.set()
        watcher.join()
        del result
        best = min(best, elapsed)
        peak_added = max(peak_added, peak[0] - baseline)
    return best, peak_added


def steady_steps(workspace: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The step records of a run's metrics.jsonl at the end of its first quarter and at its end: the span past
    start-up and the first steps, over which the throughput benchmarks measure."""
    records = [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    return steps[len(steps) // 4], steps[-1]


def images_per_second(workspace: Path) -> float:
    """Global images per second of a run over :func:`steady_steps`."""
    warm, last = steady_steps(workspace)
    return (last["global_step"] - warm["global_step"]) * last["global_batch"] / (last["time"] - warm["time"])


def stepped_head(classes: int):
    """A Horovod rank's share of a ``classes`` × 128 fp32 ArcFace head after one step of 128 normalised embeddings
    a rank (SGD, momentum 0.9, decay 5e-4): ``(backend, loss_fn)`` for the head benchmarks run under
    horovodrun (its momentum holds values, as a trained head's would)."""
    import torch
    from torch.nn import functional as F

    from pksampler.train.losses.headed import HeadedLoss
    from pksampler.train.modeling.sharded_head import ShardedMarginHead
    from pksampler.train.runtime.distributed import HorovodBackend
    from pksampler.train.solver.sparse_rows import SparseRowSGD

    torch.set_num_threads(1)
    backend = HorovodBackend("cpu", "fp32")
    head = ShardedMarginHead(classes, 128, backend, negatives=8192, seed=0)
    rows = SparseRowSGD(head, momentum=0.9, weight_decay=5e-4)
    loss_fn = HeadedLoss(torch.nn.Identity(), head, pair_weight=0.0)
    generator = torch.Generator().manual_seed(backend.rank)
    mine = F.normalize(torch.randn(128, 128, generator=generator), dim=1).requires_grad_(True)
    labels = torch.randint(0, classes, (128,), generator=generator)
    loss_fn(backend.allgather(mine), backend.allgather(labels)).backward()
    rows.step(0.1)
    return backend, loss_fn

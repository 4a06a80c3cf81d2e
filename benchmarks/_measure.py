"""Timing and peak-memory helpers for the benchmark scripts."""

from __future__ import annotations

import os
import threading
import time
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

"""retrieval_metrics on a collapsed model (massive exact ties) against the untied case.

Run: .venv/bin/python benchmarks/eval_ties.py [--num 10000 100000] [--dim 128] [--per-class 10]

A collapsed model maps every image to the same embedding, so every gallery
item ties with every other and the exact ranking (ties by gallery index, the
query itself left out) cannot come from faiss alone. For each N the script
times, in the same process, the same labels with:

* ``untied`` (the reference): clustered random embeddings, as in eval_speed.py;
* ``collapsed``: all N embeddings identical;
* ``half``: half of the items collapsed onto one point, half clustered.

and prints each time and its ratio to ``untied`` (target <= 2). Each case
runs ``--repeats`` times and the best time is kept; the results are checked
to be exact (collapsed: every metric is what the label counts predict).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import measure  # noqa: E402
from eval_speed import clustered_embeddings  # noqa: E402


def collapsed_expectation(labels: np.ndarray) -> float:
    """Recall@1 of a collapsed model: query i's first neighbour is item 0 (item 1 for i = 0)."""
    first = np.where(np.arange(labels.size) == 0, 1, 0)
    return float((labels[first] == labels).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, nargs="+", default=[10_000])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--per-class", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import faiss

    from pksampler.train.evaluation.metrics import retrieval_metrics

    print(f"faiss threads {faiss.omp_get_max_threads()}, {args.dim}-d, {args.per_class} per class, "
          f"best of {args.repeats}")
    print(f"{'N':>8} {'case':>10} {'seconds':>9} {'vs untied':>10} {'recall@1':>9}")
    for num in args.num:
        untied, labels = clustered_embeddings(num, args.dim, args.per_class)
        collapsed = np.tile(untied[:1], (num, 1))
        half = untied.copy()
        half[::2] = untied[0]
        reference = None
        for name, x in (("untied", untied), ("collapsed", collapsed), ("half", half)):
            results: list[dict] = []
            seconds, _ = measure(lambda x=x: results.append(retrieval_metrics(x, labels)), repeats=args.repeats)
            recall = results[-1]["recall_at_1"]
            if name == "collapsed" and recall != collapsed_expectation(labels):
                raise SystemExit(f"collapsed recall@1 {recall} != expected {collapsed_expectation(labels)}")
            reference = seconds if reference is None else reference
            print(f"{num:>8} {name:>10} {seconds:>9.3f} {seconds / reference:>9.2f}x {recall:>9.3f}", flush=True)


if __name__ == "__main__":
    main()

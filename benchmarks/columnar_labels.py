"""Reading a Hugging Face dataset's label column for the sampler, against the row-by-row reads people write.

Run: .venv/bin/python benchmarks/columnar_labels.py [--rows 1000000]

A ``datasets.Dataset`` with an integer ``label`` column (plus a text column),
shuffled and then filtered (an indices mapping over the Arrow table, as after
``shuffle``/``select``/``filter``). Timed, in one run, and reported as
ratios against ``np.asarray(ds["label"])`` (one Python object per row, the
natural spelling the sampler used to need):

* ``labels=ds["label"]`` read by the sampler (the Arrow column, one numpy
  gather by the indices mapping);
* ``ds["label"][:]`` (datasets' own formatting to a Python list);

and each read is checked equal to the row-by-row labels.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def hf_datasets():
    """Hugging Face ``datasets``, not the repository's ``datasets/`` folder (run from the root)."""
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT]
    import datasets

    return datasets


def timed(function):
    start = time.perf_counter()
    value = function()
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    rows = parser.parse_args().rows
    datasets = hf_datasets()
    datasets.disable_progress_bars()
    from pksampler.samplers._labels import extract_labels

    rng = np.random.default_rng(0)
    ds = datasets.Dataset.from_dict({"label": rng.integers(0, rows // 20, rows), "text": ["x"] * rows})
    ds = ds.shuffle(seed=1).filter(lambda batch: [i % 10 != 0 for i in batch["label"]], batched=True)
    reference, t_reference = timed(lambda: np.asarray(ds["label"]))
    ours, t_ours = timed(lambda: extract_labels(ds["label"], owner="bench"))
    listed, t_list = timed(lambda: np.asarray(ds["label"][:]))
    assert np.array_equal(ours, reference) and np.array_equal(listed, reference)
    print(f"rows after filter: {len(ds):,}")
    print(f"np.asarray(ds['label'])      {t_reference:8.3f} s  (reference)")
    print(f"sampler labels=ds['label']   {t_ours:8.3f} s  ratio {t_ours / t_reference:.4f}")
    print(f"ds['label'][:]               {t_list:8.3f} s  ratio {t_list / t_reference:.4f}")


if __name__ == "__main__":
    main()

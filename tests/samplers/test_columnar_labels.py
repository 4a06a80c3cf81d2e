"""Labels from columnar sources: Hugging Face ``Dataset``/``Column``, pyarrow arrays, pandas.

Each is compared with the labels read row by row, after ``shuffle``,
``select`` and ``filter`` too (they leave an indices mapping over the Arrow
table, which a reader of the raw table would get wrong).
"""

from __future__ import annotations

import numpy as np
import pytest

import pyarrow as pa
from hf_datasets import import_hf_datasets

from pksampler.samplers import DistributedBalancedBatchSampler
from pksampler.samplers._labels import extract_labels

datasets = import_hf_datasets()


def _dataset(n: int = 600, classes: int = 30) -> "datasets.Dataset":
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict({"label": rng.integers(0, classes, n).tolist(), "text": [str(i) for i in range(n)]})


@pytest.mark.parametrize("transform", ["none", "shuffle", "select", "filter", "shuffle+select"])
def test_a_dataset_and_its_column_give_the_labels_in_row_order(transform):
    ds = _dataset()
    if "shuffle" in transform:
        ds = ds.shuffle(seed=3)
    if "select" in transform:
        ds = ds.select(range(100, 500, 2))
    if transform == "filter":
        ds = ds.filter(lambda row: int(row["text"]) % 3 != 0)
    truth = np.array([row["label"] for row in ds])  # row by row: the reference
    for source in (ds, ds["label"]):
        got = extract_labels(source, owner="test")
        np.testing.assert_array_equal(got, truth)
    sampler = DistributedBalancedBatchSampler(ds["label"], 2, 2, num_replicas=2, rank=1)
    for batch in sampler:
        assert np.unique(truth[batch]).size == 2


def test_pyarrow_arrays_pandas_and_numpy_protocols_are_read_whole():
    values = np.arange(40) % 8
    chunked = pa.chunked_array([values[:15], values[15:]])
    for source in (pa.array(values), chunked, chunked.to_pandas(), pa.array(values.astype(str))):
        got = extract_labels(source, owner="test")
        assert got.shape == (40,) and [str(v) for v in got] == [str(v) for v in values]


def test_missing_labels_and_datasets_without_a_label_column_are_refused():
    with pytest.raises(ValueError, match=r"test\(labels=\) has 1 missing \(null\) labels, the first at index 2"):
        extract_labels(pa.array([1, 2, None, 1]), owner="test")
    ds = datasets.Dataset.from_dict({"y": [0, 1, 0, 1]})
    with pytest.raises(TypeError, match=r"columns \['y'\] but no 'label' or 'labels' column: pass "
                                        r"labels=dataset\['<your label column>'\]"):
        extract_labels(ds, owner="test")
    np.testing.assert_array_equal(extract_labels(ds["y"], owner="test"), [0, 1, 0, 1])
    with pytest.raises(TypeError, match="load it without streaming=True"):
        extract_labels(ds.rename_column("y", "label").to_iterable_dataset(), owner="test")


def test_a_dataset_dict_is_refused_naming_its_splits_and_the_fix():
    ds = _dataset(40, 5)
    splits = datasets.DatasetDict({"train": ds, "test": ds.select(range(10))})
    for source in (splits, datasets.IterableDatasetDict({"train": ds.to_iterable_dataset()})):
        with pytest.raises(TypeError) as caught:
            DistributedBalancedBatchSampler(source, 2, 2, num_replicas=1, rank=0)
        message = str(caught.value)
        assert "of splits ['train'" in message and "pass one split, e.g. labels=ds['train']" in message
        assert "no 'label' or 'labels' column" not in message


def test_pandas_missing_values_are_refused_naming_labels_and_the_position():
    import pandas as pd

    sources = {"string": pd.Series(["a", "b", pd.NA, "a"], dtype="string"),
               "Int64": pd.Series([1, 2, pd.NA, 1], dtype="Int64"),
               "object": pd.Series(["a", "b", pd.NA, "a"], dtype=object),
               "category": pd.Series(["a", "b", None, "a"], dtype="category")}
    for name, labels in sources.items():
        what = r"a missing label \(<NA>\)" if name in ("string", "object") else r".*"  # numeric NA reads as NaN
        with pytest.raises(ValueError, match=rf"^DistributedBalancedBatchSampler\(labels=\) has {what} at index 2"):
            DistributedBalancedBatchSampler(labels, 1, 1, num_replicas=1, rank=0)
        with pytest.raises(ValueError, match=r"at index 2"):
            extract_labels(labels, owner="test")

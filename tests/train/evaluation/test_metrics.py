"""Retrieval metrics against a brute-force numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pksampler.train.evaluation.metrics import evaluate_retrieval, knn_search, retrieval_metrics
from pksampler.train.evaluation.metrics import _normalise


def reference_metrics(query, query_labels, gallery=None, gallery_labels=None, ks=(1, 5, 10), metric="cosine"):
    """Full distance matrix, ranking by (distance, gallery index); the definitions written out."""
    query = np.asarray(query, dtype=np.float32)
    self_gallery = gallery is None
    gallery = query if self_gallery else np.asarray(gallery, dtype=np.float32)
    gallery_labels = np.asarray(query_labels if self_gallery else gallery_labels)
    if metric == "cosine":
        query, gallery = _normalise(query), _normalise(gallery)
    q, g = query.astype(np.float64), gallery.astype(np.float64)
    dist = ((q[:, None] - g[None]) ** 2).sum(-1) if metric == "l2" else -(q @ g.T)
    out = {f"recall_at_{k}": [] for k in ks}
    out.update(precision_at_1=[], r_precision=[], map_at_r=[])
    excluded = 0
    for i in range(len(query)):
        candidates = np.arange(len(gallery))
        if self_gallery:
            candidates = candidates[candidates != i]
        order = candidates[np.lexsort((candidates, dist[i, candidates]))]
        hit = gallery_labels[order] == query_labels[i]
        r = int(hit.sum())
        if r == 0:
            excluded += 1
            continue
        for k in ks:
            out[f"recall_at_{k}"].append(hit[:k].any())
        out["precision_at_1"].append(hit[0])
        out["r_precision"].append(hit[:r].sum() / r)
        precisions = np.cumsum(hit[:r]) / np.arange(1, r + 1)
        out["map_at_r"].append((precisions * hit[:r]).sum() / r)
    result = {name: float(np.mean(values)) for name, values in out.items()}
    result["num_excluded"] = excluded
    result["num_queries"] = len(query) - excluded
    return result


def assert_same(got, want):
    assert set(want) <= set(got)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, abs=1e-9), (name, got[name], value)


def test_random_embeddings_with_duplicates_match_reference():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 8)).astype(np.float32)
    labels = rng.integers(0, 20, 300)
    x[50:60] = x[40:50]  # exact duplicates (ties), some across classes
    labels[50:55] = labels[40:45]
    assert_same(retrieval_metrics(x, labels), reference_metrics(x, labels))
    assert_same(retrieval_metrics(x, labels, metric="l2"), reference_metrics(x, labels, metric="l2"))


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_massive_exact_ties_match_reference(metric):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 3, size=(400, 3)).astype(np.float32)  # 27 distinct points: ties everywhere
    labels = rng.integers(0, 6, 400)
    assert_same(retrieval_metrics(x, labels, metric=metric), reference_metrics(x, labels, metric=metric))
    g, gl = x[:150], labels[:150]
    assert_same(
        retrieval_metrics(x[150:], labels[150:], g, gl, metric=metric, ks=(1, 3)),
        reference_metrics(x[150:], labels[150:], g, gl, metric=metric, ks=(1, 3)),
    )


def test_chunked_and_unchunked_are_identical():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 4, size=(500, 4)).astype(np.float32)
    labels = rng.integers(0, 8, 500)
    whole = retrieval_metrics(x, labels, metric="l2")
    for chunk, budget in ((7, 1 << 24), (4096, 200), (1, 1)):
        assert retrieval_metrics(x, labels, metric="l2", chunk_size=chunk, max_neighbours_per_chunk=budget) == whole


def test_map_at_r_hand_computed():
    # 1-D embeddings: gallery item j lies at distance j + 1 from the query at 0.
    gallery = np.arange(1, 13, dtype=np.float32)[:, None]
    hits = np.array([1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1])  # R = 4; correct at ranks 1 and 3 within the top R
    gallery_labels = np.where(hits == 1, 7, 8)
    result = retrieval_metrics(np.zeros((1, 1), np.float32), [7], gallery, gallery_labels, metric="l2", ks=(1, 2))
    assert result["map_at_r"] == pytest.approx((1 / 1 + 2 / 3) / 4)
    assert result["r_precision"] == pytest.approx(2 / 4)
    assert result["precision_at_1"] == 1.0 and result["recall_at_2"] == 1.0
    # the paper's example: R = 10, correct at ranks 1 and 3 -> (1 + 2/3) / 10
    hits = np.array([1, 0, 1, 0, 0, 0, 0, 0, 0, 0] + [1] * 8)
    result = retrieval_metrics(np.zeros((1, 1), np.float32), [1], np.arange(1, 19, dtype=np.float32)[:, None],
                               hits, metric="l2")
    assert result["map_at_r"] == pytest.approx((1 + 2 / 3) / 10)


def test_self_excluded_by_index_duplicates_count_and_singletons_are_excluded():
    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=np.float32)
    labels = np.array([0, 0, 1, 2])  # rows 0 and 1 are exact duplicates of one class
    result = retrieval_metrics(x, labels, ks=(1,))
    assert result["num_excluded"] == 2  # classes 1 and 2 have no other item
    assert result["num_queries"] == 2
    assert result["recall_at_1"] == 1.0 and result["map_at_r"] == 1.0


def test_torch_input_and_knn_search():
    x = torch.randn(50, 6, generator=torch.Generator().manual_seed(3))
    labels = torch.arange(50) % 5
    assert retrieval_metrics(x, labels) == retrieval_metrics(x.numpy(), labels.numpy())
    d, i = knn_search(x.numpy(), x.numpy(), 3, exclude_self=True)
    assert i.shape == (50, 3) and not (i == np.arange(50)[:, None]).any()
    assert (np.diff(d, axis=1) >= 0).all()
    d, i = knn_search(x.numpy()[:2], x.numpy()[:3], 5, metric="l2")
    assert (i[:, 3:] == -1).all() and np.isinf(d[:, 3:]).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"query": np.full((3, 2), np.nan)}, ValueError, r"query=\) contains NaN or Inf \(first in row 0\)"),
        ({"query": np.zeros(3)}, ValueError, r"query=\) must be 2-D, got shape \(3,\)"),
        ({"query_labels": [0, 1]}, ValueError, r"query_labels=\) must be 1-D with one label per row of query \(3\)"),
        ({"metric": "hamming"}, ValueError, r"metric=\) must be one of \['cosine', 'l2', 'ip'\], got 'hamming'"),
        ({"ks": (0,)}, ValueError, r"ks=\) must be positive ints"),
        ({"gallery": np.zeros((2, 5)), "gallery_labels": [0, 1]}, ValueError, r"dimension 2 but gallery has 5"),
        ({"gallery": np.zeros((2, 2))}, ValueError, r"gallery_labels=\) is required"),
        ({"query": np.array([["a", "b"]] * 3)}, TypeError, r"must be numeric"),
    ],
)
def test_bad_input(kwargs, error, match):
    args = {"query": np.eye(3, 2, dtype=np.float32), "query_labels": [0, 0, 1]}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        retrieval_metrics(**args)


def reference_ranking(query, gallery, metric="cosine", exclude_self=False):
    """Every query's full gallery ranking by (float64 distance, index), self dropped if asked."""
    query, gallery = np.asarray(query, np.float32), np.asarray(gallery, np.float32)
    if metric == "cosine":
        query, gallery = _normalise(query), _normalise(gallery)
    q, g = query.astype(np.float64), gallery.astype(np.float64)
    dist = ((q[:, None] - g[None]) ** 2).sum(-1) if metric == "l2" else -(q @ g.T)
    rankings = []
    for i in range(len(q)):
        candidates = np.arange(len(g))
        if exclude_self:
            candidates = candidates[candidates != i]
        rankings.append(candidates[np.lexsort((candidates, dist[i, candidates]))])
    return rankings


@pytest.mark.parametrize("metric", ["cosine", "l2", "ip"])
def test_collapsed_model_all_embeddings_equal_match_reference(metric):
    x = np.tile(np.float32([[0.6, -0.8, 0.0]]), (300, 1))
    labels = np.random.default_rng(4).integers(0, 12, 300)
    assert_same(retrieval_metrics(x, labels, metric=metric), reference_metrics(x, labels, metric=metric))
    # every neighbour list is the lowest gallery indices, the query itself skipped
    _, ids = knn_search(x, x, 7, metric=metric, exclude_self=True)
    assert (ids[0] == np.arange(1, 8)).all() and (ids[5] == [0, 1, 2, 3, 4, 6, 7]).all()
    assert (ids[299] == np.arange(7)).all()


def test_sparse_tie_groups_need_several_scan_blocks(monkeypatch):
    # Three distinct points; the copies of point 0 sit every 97th index, so the
    # items tied with a query at point 0 are spread over the whole gallery.
    monkeypatch.setattr("pksampler.train.evaluation.metrics._TIE_BUDGET", 64)  # many small row/column steps
    n = 2000
    points = np.float32([[0, 0], [5, 0], [0, 7]])
    kind = np.where(np.arange(n) % 97 == 0, 0, 1 + np.arange(n) % 2)
    x = points[kind]
    labels = np.arange(n) % 5
    queries = np.flatnonzero(kind == 0)
    for metric in ("l2", "ip"):
        want = reference_ranking(x[queries], x, metric)
        _, ids = knn_search(x[queries], x, 12, metric=metric)
        assert all((got == w[:12]).all() for got, w in zip(ids, want))
    assert_same(retrieval_metrics(x, labels, metric="l2", ks=(1, 5)),
                reference_metrics(x, labels, metric="l2", ks=(1, 5)))


def test_ties_crossing_the_cut_with_a_separate_gallery():
    rng = np.random.default_rng(5)
    gallery = np.concatenate([rng.normal(size=(200, 4)), np.tile(rng.normal(size=(1, 4)), (300, 1))])
    gallery = gallery[rng.permutation(500)].astype(np.float32)
    query = np.concatenate([gallery[:40], gallery[:40] + 1e-3]).astype(np.float32)
    g_labels, q_labels = rng.integers(0, 7, 500), rng.integers(0, 7, 80)
    for metric in ("cosine", "l2"):
        assert_same(retrieval_metrics(query, q_labels, gallery, g_labels, metric=metric, ks=(1, 10)),
                    reference_metrics(query, q_labels, gallery, g_labels, metric=metric, ks=(1, 10)))


def test_evaluate_retrieval_returns_the_neighbours_of_requested_rows():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(120, 5)).astype(np.float32)
    x[60:70] = x[0]  # ties
    labels = rng.integers(0, 10, 120)
    labels[119] = 99  # a singleton class: excluded from the metrics, still shown
    rows = np.array([119, 0, 65, 3])
    result = evaluate_retrieval(x, labels, neighbour_rows=rows, num_neighbours=6)
    assert result.metrics == retrieval_metrics(x, labels)
    assert result.metrics["num_excluded"] == 1
    assert (result.rows == rows).all() and result.neighbours.shape == (4, 6)
    want = reference_ranking(x, x, exclude_self=True)
    for row, got in zip(rows, result.neighbours):
        assert (got == want[row][:6]).all()
    normalised = _normalise(x)
    cosine = np.einsum("rd,rkd->rk", normalised[rows], normalised[result.neighbours])
    assert result.similarities == pytest.approx(cosine, abs=1e-5)
    assert (np.diff(result.similarities, axis=1) <= 1e-6).all()  # nearest first
    with pytest.raises(ValueError, match=r"neighbour_rows=\) must lie in \[0, 120\), got values from 0 to 120"):
        evaluate_retrieval(x, labels, neighbour_rows=[0, 120])
    empty = evaluate_retrieval(x, labels)
    assert empty.neighbours.shape == (0, 5) and empty.rows.size == 0


def test_as_numpy_is_the_shared_coercion():
    from pksampler.arrays import as_numpy

    out = as_numpy(torch.ones(2, 3, requires_grad=True), name="f(x=)", dtype=np.float32, ndim=2)
    assert out.dtype == np.float32 and out.flags.c_contiguous
    with pytest.raises(ValueError, match=r"f\(x=\) must be 2-D, got shape \(3,\)"):
        as_numpy(np.zeros(3), name="f(x=)", ndim=2)
    with pytest.raises(ValueError, match=r"f\(x=\) must be non-empty, got shape \(0, 2\)"):
        as_numpy(np.zeros((0, 2)), name="f(x=)", non_empty=True)
    with pytest.raises(ValueError, match=r"contains NaN or Inf \(first in row 1\)"):
        as_numpy([[0.0], [np.inf]], name="f(x=)", finite=True)
    with pytest.raises(TypeError, match=r"f\(x=\) must be numeric \(float or signed int or unsigned int\)"):
        as_numpy(["a"], name="f(x=)")

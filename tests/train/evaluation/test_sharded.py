"""Gallery-sharded evaluation in one process: W ranks as threads, the metrics the same at every W.

Each "rank" is a thread calling :func:`sharded_retrieval` with its share of
the gallery; their collectives meet at a barrier. The same checks run under
real launchers in tests/distributed/test_sharded_eval.py.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from thread_ranks import Group as _Group, ThreadRank

from pksampler.world import World
from pksampler.train.evaluation import evaluate_retrieval, recall_standard_error, sharded_retrieval, stratified_queries
from pksampler.train.evaluation.shard_search import merge_topk, search_shard


def run_ranks(world: int, embeddings: np.ndarray, labels: np.ndarray, *, seed: int = 0, per_rank=None, **options):
    """``sharded_retrieval`` on ``world`` thread-ranks, each holding a random share (global id = row)."""
    owner = np.random.default_rng(seed).integers(0, world, size=labels.size)
    group = _Group(world)

    def rank_call(rank: int):
        mine = np.flatnonzero(owner == rank)[::-1]  # any order: the function sorts by id
        extra = {} if per_rank is None else per_rank(rank)
        return sharded_retrieval(embeddings[mine], labels[mine], mine, collectives=ThreadRank(group, rank),
                                 **options, **extra)

    with ThreadPoolExecutor(world) as pool:
        return [future.result() for future in [pool.submit(rank_call, rank) for rank in range(world)]]


def clustered(seed: int = 0, classes: int = 30, dim: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """Classes of 1 to 40 items around their centres, with some exact duplicates (ties)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 40, size=classes)
    labels = np.repeat(np.arange(classes) * 7 + 3, sizes)
    centres = rng.normal(size=(classes, dim))
    x = centres[np.repeat(np.arange(classes), sizes)] + 0.9 * rng.normal(size=(labels.size, dim))
    copies = rng.choice(labels.size, size=labels.size // 10, replace=False)
    x[copies] = x[rng.choice(labels.size, size=copies.size)]
    return x.astype(np.float32), labels


def same_result(a, b) -> None:
    assert a.metrics == b.metrics
    np.testing.assert_array_equal(a.query_ids, b.query_ids)
    np.testing.assert_array_equal(a.neighbours, b.neighbours)
    np.testing.assert_array_equal(a.distances, b.distances)


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_metrics_are_bit_identical_at_w_1_2_3_and_equal_evaluate_retrieval(metric):
    x, labels = clustered()
    shown = np.array([0, 17, 100, labels.size - 1])
    results = {w: run_ranks(w, x, labels, metric=metric, neighbour_ids=shown, num_neighbours=6,
                            max_neighbours_per_chunk=400) for w in (1, 2, 3)}
    reference = evaluate_retrieval(x, labels, metric=metric, neighbour_rows=shown, num_neighbours=6)
    first = results[1][0]
    for w, ranks in results.items():
        for result in ranks:  # every rank of every W: the same result
            same_result(result, first)
    assert {k: first.metrics[k] for k in reference.metrics} == reference.metrics
    np.testing.assert_array_equal(first.neighbours, reference.neighbours)
    assert first.metrics["num_excluded"] > 0  # singleton classes have no relevant item
    assert 0 < first.metrics["recall_at_1_se"] < 0.05
    assert first.bytes_received == 0 and results[2][0].bytes_received > 0


def test_a_collapsed_model_ties_everywhere_and_ranks_by_global_id_at_every_w():
    labels = np.repeat(np.arange(20), 15)
    x = np.ones((labels.size, 8), dtype=np.float32)
    reference = evaluate_retrieval(x, labels, neighbour_rows=[5], num_neighbours=4)
    for w in (1, 2, 3):
        result = run_ranks(w, x, labels, neighbour_ids=[5], num_neighbours=4, seed=w)[0]
        assert {k: result.metrics[k] for k in reference.metrics} == reference.metrics
        assert result.neighbours.tolist() == [[0, 1, 2, 3]] == reference.neighbours.tolist()


def test_sampled_queries_are_stratified_the_same_at_every_w_and_reported_with_their_standard_error():
    x, labels = clustered(seed=1, classes=40)
    queries = stratified_queries(labels, 150, seed=4)
    assert queries.size == 150 and np.array_equal(queries, stratified_queries(labels, 150, seed=4))
    assert not np.array_equal(queries, stratified_queries(labels, 150, seed=5))
    classes, sizes = np.unique(labels, return_counts=True)
    taken = np.array([(labels[queries] == c).sum() for c in classes])
    share = 150 * sizes / labels.size
    assert ((taken >= np.floor(share)) & (taken <= np.ceil(share))).all()
    assert np.array_equal(stratified_queries(labels, labels.size, seed=4), np.arange(labels.size))
    results = [run_ranks(w, x, labels, query_ids=queries, seed=w)[w - 1] for w in (1, 2, 3)]
    for result in results[1:]:
        same_result(result, results[0])
    np.testing.assert_array_equal(results[0].query_ids, queries)
    p, q = results[0].metrics["recall_at_1"], results[0].metrics["num_queries"]
    assert results[0].metrics["recall_at_1_se"] == recall_standard_error(p, q)
    assert results[0].metrics["recall_at_1_se"] == pytest.approx(np.sqrt(p * (1 - p) / q), rel=0.05)


def test_the_recall_standard_error_stays_positive_for_one_query_and_is_the_wald_one_for_many():
    """p = 1 on one query is not a recall known exactly; at Q = 10^4, p = 0.5 it is 0.5 pp (√(p(1−p)/Q))."""
    assert 0.15 < recall_standard_error(1.0, 1) < 0.5
    assert 0.15 < recall_standard_error(0.0, 1) < 0.5
    assert recall_standard_error(1.0, 10) > 0 and recall_standard_error(0.0, 10_000) > 0
    assert round(recall_standard_error(0.5, 10_000), 4) == 0.0050
    assert recall_standard_error(0.5, 10_000) == pytest.approx(0.005, rel=1e-3)
    assert recall_standard_error(0.8, 100_000) == pytest.approx(np.sqrt(0.8 * 0.2 / 100_000), rel=1e-3)
    assert np.isnan(recall_standard_error(0.5, 0)) and np.isnan(recall_standard_error(float("nan"), 5))
    x, labels = clustered(seed=1, classes=40)
    one = run_ranks(2, x, labels, query_ids=[int(np.flatnonzero(labels == labels[0])[1])])[0].metrics
    assert one["num_queries"] == 1 and one["recall_at_1_se"] > 0.15


def test_shard_lists_merge_to_the_whole_gallery_list():
    """The pure halves: search_shard per shard, then merge_topk, equal one search over the whole gallery."""
    x, labels = clustered(seed=2)
    ids = np.arange(labels.size)
    whole = search_shard(x, ids, x, ids, 9, metric="l2")
    for w in (2, 3):
        parts = [search_shard(x, ids, x[ids % w == r], ids[ids % w == r], 9, metric="l2") for r in range(w)]
        merged = merge_topk([p[0] for p in parts], [p[1] for p in parts], 9)
        np.testing.assert_array_equal(merged[1], whole[1])
        np.testing.assert_array_equal(merged[0], whole[0])


def rank_errors(world: int, x: np.ndarray, labels: np.ndarray, per_rank) -> list[str]:
    """Each thread-rank's error message (every rank must raise, none may hang)."""
    def call(rank: int):
        try:
            owner = np.random.default_rng(0).integers(0, world, size=labels.size)
            mine = np.flatnonzero(owner == rank)
            sharded_retrieval(x[mine], labels[mine], mine, collectives=ThreadRank(group, rank), **per_rank(rank))
        except ValueError as error:
            return str(error)
        return "no error"

    group = _Group(world)
    with ThreadPoolExecutor(world) as pool:
        return [future.result() for future in [pool.submit(call, rank) for rank in range(world)]]


def test_ranks_that_disagree_or_lose_a_query_fail_on_every_rank_naming_it():
    x, labels = clustered(seed=3, classes=6)
    for message in rank_errors(2, x, labels, lambda rank: {"query_ids": [rank, 3]}):
        assert "the ranks passed different query_ids" in message
    for message in rank_errors(3, x, labels, lambda rank: {"query_ids": [0, labels.size + 5]}):
        assert "query_ids=) names 2 ids but the ranks hold 1 of them" in message
    with pytest.raises(ValueError, match=r"sharded_retrieval\(labels=\) must hold one value per row"):
        sharded_retrieval(x, labels[:-1], np.arange(labels.size))
    with pytest.raises(ValueError, match=r"sharded_retrieval\(ids=\) must be unique"):
        sharded_retrieval(x[:3], labels[:3], [4, 4, 5])
    with pytest.raises(ValueError, match=r"metric=\) must be one of"):
        sharded_retrieval(x, labels, np.arange(labels.size), metric="hamming")
    with pytest.raises(ValueError, match=r"neighbour_ids=\) must be query ids; \[7\] are not"):
        sharded_retrieval(x, labels, np.arange(labels.size), query_ids=[1, 2], neighbour_ids=[7])


def shard_errors(world: int, shard) -> list[str]:
    """Each thread-rank's error for the shard ``shard(rank)`` gives it: (embeddings, labels, ids, options)."""
    def call(rank: int):
        embeddings, labels, ids, options = shard(rank)
        try:
            sharded_retrieval(embeddings, labels, ids, collectives=ThreadRank(group, rank), **options)
        except (ValueError, TypeError) as error:
            return f"{type(error).__name__}: {error}"
        return "no error"

    group = _Group(world)
    with ThreadPoolExecutor(world) as pool:
        return [future.result() for future in [pool.submit(call, rank) for rank in range(world)]]


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_on_one_rank_raises_the_same_error_naming_that_rank_on_every_rank(world):
    """Before: the bad rank raised alone and the others were left in the agreement collective."""
    x, labels = clustered(seed=3, classes=6)
    ids = np.arange(labels.size)

    def broken(damage):
        def shard(rank: int):
            mine = ids % world == rank
            e, l, i = x[mine].copy(), labels[mine], ids[mine].copy()
            return damage(e, l, i) if rank == 1 else (e, l, i, {})
        return shard

    def nan(e, l, i):
        e[2, 1] = np.nan
        return e, l, i, {}

    def repeat(e, l, i):
        i[1] = i[0]
        return e, l, i, {}

    cases = {
        nan: r"ValueError: sharded_retrieval: rank 1 of \d: sharded_retrieval\(embeddings=\) must be finite, "
             r"got nan in row 2, column 1$",
        repeat: r"ValueError: sharded_retrieval: rank 1 of \d: sharded_retrieval\(ids=\) must be unique global ids, "
                r"got \d+ twice$",
        (lambda e, l, i: (e, l[:-1], i, {})): r"ValueError: sharded_retrieval: rank 1 of \d: "
                                               r"sharded_retrieval\(labels=\) must hold one value per row of "
                                               r"embeddings= \(\d+\), got \d+$",
        (lambda e, l, i: (e, l, i, {"ks": (0,)})): r"ValueError: sharded_retrieval: rank 1 of \d: "
                                                    r"sharded_retrieval\(ks=\) must be positive ints, got \(0,\)$",
        (lambda e, l, i: (e, l.astype(np.float32), i, {})): r"TypeError: sharded_retrieval: rank 1 of \d: "
                                                             r"sharded_retrieval\(labels=\) must be numeric",
    }
    for damage, pattern in cases.items():
        messages = shard_errors(world, broken(damage))
        assert len(set(messages)) == 1, messages
        assert re.search(pattern, messages[0]), messages[0]
        assert f"of {world}:" in messages[0]
    both = shard_errors(world, lambda rank: (x[:3], labels[:3], [0, 0, 1], {"ks": (0,)} if rank else {}))
    assert len(set(both)) == 1 and "rank 0 of" in both[0] and "(ranks [1" in both[0]


def test_errors_name_sharded_retrieval_and_the_argument_the_user_got_wrong():
    x, labels = clustered(seed=3, classes=6)
    with pytest.raises(ValueError, match=r"^sharded_retrieval\(ks=\) must be positive ints, got \(0,\)$"):
        sharded_retrieval(x, labels, np.arange(labels.size), ks=(0,))
    same = shard_errors(2, lambda rank: (x, labels, np.arange(labels.size), {"ks": (0,)}))
    assert same == ["ValueError: sharded_retrieval: on every rank: sharded_retrieval(ks=) must be positive ints, "
                    "got (0,)"] * 2
    with pytest.raises(ValueError, match=r"sharded_retrieval\(nprobe=\) must be a positive int, got 0"):
        sharded_retrieval(x, labels, np.arange(labels.size), index="ivf", nprobe=0)
    # the same global id on two ranks, query_ids= not passed: ids= is at fault, and the ranks are named
    half = labels.size // 2

    def overlap(rank: int):
        ids = np.arange(half + 1) if rank == 0 else np.arange(half, 2 * half)  # id `half` on both ranks
        return x[ids], labels[ids], ids, {}

    messages = shard_errors(2, overlap)
    assert len(set(messages)) == 1, messages
    assert re.fullmatch(rf"ValueError: sharded_retrieval\(ids=\) must be unique over all ranks, got global id "
                        rf"{half} on ranks 0 and 1", messages[0]), messages[0]
    assert "query_ids" not in messages[0]


class _Items(torch.utils.data.Dataset):
    """``count`` held-out items: a fixed vector and a label each."""

    def __init__(self, count: int) -> None:
        self.x = torch.from_numpy(np.random.default_rng(0).normal(size=(count, 4)).astype(np.float32))
        self.labels = np.zeros(count, dtype=np.int64)  # one class: every item is a query when there are two

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, index: int):
        return self.x[index], int(self.labels[index])


@pytest.mark.parametrize("world, count", [(2, 1), (3, 2), (3, 0)])
def test_a_rank_without_held_out_items_embeds_an_empty_share_of_the_models_dimension(world, count):
    """Fewer held-out items than ranks: the empty rank has (0, D), and the evaluation runs on every rank."""
    from pksampler.train.evaluation.heldout import embed_share
    from pksampler.train.runtime.distributed import Backend

    class ThreadBackend(Backend):
        def __init__(self, group: _Group, rank: int) -> None:
            super().__init__()
            self.group = group
            self.set_world(World(rank=rank, size=group.size))

        def allgather(self, tensor, sizes=None):
            return torch.cat(self.group.exchange(self.rank, tensor.clone()))

        def allreduce_sum(self, tensor):
            return torch.stack(self.group.exchange(self.rank, tensor.clone())).sum(dim=0)

        def allgather_numpy(self, row):
            return np.stack(self.group.exchange(self.rank, np.asarray(row).copy()))

    torch.manual_seed(0)
    model, items, group = torch.nn.Linear(4, 8), _Items(count), _Group(world)

    def rank_call(rank: int):
        backend = ThreadBackend(group, rank)
        local, mine = embed_share(model, items, backend)
        return local, sharded_retrieval(local, items.labels[mine], mine, collectives=backend)

    with ThreadPoolExecutor(world) as pool:
        results = [future.result() for future in [pool.submit(rank_call, rank) for rank in range(world)]]
    shapes = [local.shape for local, _ in results]
    expected_dim = 8 if count else 0
    assert shapes == [(len(range(rank, count, world)), expected_dim) for rank in range(world)]
    assert all(local.dtype == np.float32 for local, _ in results)
    metrics = [result.metrics for _, result in results]
    queries = count if count > 1 else 0
    assert all(m["num_queries"] == queries and m["num_excluded"] == count - queries for m in metrics)
    if queries:
        assert metrics[0]["recall_at_1"] == 1.0
    assert all(str(m) == str(metrics[0]) for m in metrics)


def test_the_ivf_mode_is_close_to_exact_and_reports_its_own_gap_on_an_exact_sample():
    x, labels = clustered(seed=6, classes=60, dim=16)
    exact = run_ranks(1, x, labels)[0]
    for w in (1, 2):
        approx = run_ranks(w, x, labels, index="ivf", nlist=8, nprobe=3, check_queries=300, seed=w)
        assert all(r.metrics == approx[0].metrics for r in approx)
        metrics = approx[0].metrics
        assert abs(metrics["recall_at_1"] - exact.metrics["recall_at_1"]) < 0.03
        assert abs(metrics["map_at_r"] - exact.metrics["map_at_r"]) < 0.03
        assert metrics["ivf_check_queries"] > 250 and abs(metrics["ivf_gap_recall_at_1"]) < 0.05
    every_list = run_ranks(2, x, labels, index="ivf", nlist=8, nprobe=8, check_queries=10_000)[0].metrics
    assert every_list["ivf_gap_recall_at_1"] == 0.0 and every_list["ivf_gap_map_at_r"] == 0.0


def test_a_launched_rank_without_a_runtime_is_told_to_start_one(monkeypatch):
    x, labels = clustered(seed=3, classes=6)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"launcher started 2 ranks but neither Horovod nor torch.distributed"):
        sharded_retrieval(x, labels, np.arange(labels.size))


@pytest.mark.parametrize("world", [1, 2])
def test_global_ids_past_the_encodable_range_are_refused_on_every_rank_and_the_last_one_still_scores(world):
    """A neighbour travels as 2·id + hit in int64: an id of 2**62 once dropped every neighbour (all metrics 0)."""
    x, labels = clustered(seed=5, classes=8)
    rows = np.arange(labels.size)
    reference = run_ranks(world, x, labels)[0].metrics

    def shard(base: int):
        def rank_share(rank: int):
            mine = rows % world == rank
            return x[mine], labels[mine], base + rows[mine], {}
        return rank_share

    last = shard(2**62 - labels.size)  # the largest id is 2**62 - 1: still encodable
    group = _Group(world)
    with ThreadPoolExecutor(world) as pool:
        results = [f.result() for f in [pool.submit(lambda r: sharded_retrieval(
            *last(r)[:3], collectives=ThreadRank(group, r)), rank) for rank in range(world)]]
    assert all(result.metrics == reference for result in results) and reference["recall_at_1"] > 0.5
    for bad in (2**62 - labels.size + 1, np.uint64(2**63)):
        messages = shard_errors(world, lambda rank, bad=bad: (*shard(0)(rank)[:2],
                                                              np.asarray(shard(0)(rank)[2], dtype=np.uint64) + bad,
                                                              {}))
        assert len(set(messages)) == 1, messages
        found = re.search(r"sharded_retrieval\(ids=\) must be global ids below 2\*\*62 = 4611686018427387904 "
                          r"\(a neighbour travels as 2·id \+ hit in int64\), got (\d+)\b", messages[0])
        assert found and int(bad) <= int(found.group(1)) < int(bad) + labels.size, messages[0]


def test_cosine_search_holds_one_block_beside_the_callers_shard_not_a_normalised_copy(monkeypatch):
    """Before: the cosine metric kept a whole normalised copy of the shard, so a rank peaked near twice its share."""
    import tracemalloc

    from pksampler.train.evaluation import sharded

    monkeypatch.setattr(sharded, "_BLOCK_BYTES", 1 << 20, raising=False)
    rng = np.random.default_rng(7)
    labels = np.repeat(np.arange(2_000), 50)
    x = rng.standard_normal((labels.size, 64), dtype=np.float32)  # 25.6 MB, not normalised
    queries = stratified_queries(labels, 40, seed=0)
    sharded_retrieval(x[:500], labels[:500], np.arange(500))  # first-call costs (faiss, lazy imports) apart
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        result = sharded_retrieval(x, labels, np.arange(labels.size), query_ids=queries)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert result.metrics["num_queries"] == 40
    assert peak < 0.25 * x.nbytes, f"peak {peak / 1e6:.1f} MB beside a {x.nbytes / 1e6:.1f} MB shard"


@pytest.mark.parametrize("index", ["flat", "ivf"])
def test_a_shard_normalised_block_by_block_gives_the_same_bits_as_one_block(monkeypatch, index):
    from pksampler.train.evaluation import sharded

    x, labels = clustered(seed=8)
    options = dict(metric="cosine", neighbour_ids=[0, 9, 50], num_neighbours=6, index=index, nlist=6, nprobe=2,
                   check_queries=200)
    whole = {w: run_ranks(w, x, labels, **options) for w in (1, 2)}
    monkeypatch.setattr(sharded, "_BLOCK_BYTES", 7 * x.shape[1] * 4)  # blocks of 7 rows
    for w, reference in whole.items():
        for blocked, one in zip(run_ranks(w, x, labels, **options), reference):
            same_result(blocked, one)
    if index == "flat":
        reference = evaluate_retrieval(x, labels, metric="cosine", neighbour_rows=[0, 9, 50], num_neighbours=6)
        assert {k: whole[2][0].metrics[k] for k in reference.metrics} == reference.metrics

"""Retrieval evaluation of a gallery split over the ranks: each rank searches its own share, no rank holds the gallery.

:func:`sharded_retrieval` is the public entry point, for the trainer and for
users' own loops (pytorch-metric-learning, OML or plain torch): every rank
passes its share of the embeddings with their labels and global ids, and
every rank gets the same metrics, under Horovod, torch.distributed or one
process.

1. The query ids and labels (every item, or a given set of global ids) are
   all-gathered; the query vectors travel chunk by chunk, each rank sending
   the ones it holds: Q·d·4·(W−1)/W bytes per rank in all.
2. R per query (its class's size over the whole gallery, minus itself) is an
   all-reduce of each rank's counts.
3. Queries are taken in chunks ordered by R, so a chunk asks for about the k
   it needs. Each rank searches its shard exactly (:func:`.shard_search.search_shard`)
   or with its IVF (:mod:`.ivf`), the W top-k lists are all-gathered (float64
   distance and int64 id+hit: 16 bytes per neighbour) and merged on
   (distance, global id).
4. Every rank scores the merged lists the same way, so the metrics agree bit
   for bit, and (exact search) they do not depend on W: the merge is a total order.

Memory per rank, beyond the interpreter: the caller's shard (N/W · d · 4
bytes, never copied when it is float32 and C-contiguous), one chunk of
queries and one chunk's lists. With cosine the shard is normalised 16 MiB at
a time during the search (:func:`.shard_search.search_unit_blocks`), not
copied whole; ``index="ivf"`` adds the index's own copy of the shard.
Measured at 2,000,000 × 64 on 2 ranks, cosine: 0.52 / 0.53 GiB peak RSS per
rank (0.24 GiB share, the same as ``metric="ip"``), 0.79 GiB in one process. Every rank works during the search, so a collective
timeout only fires on a real stall.

Example::

    result = sharded_retrieval(my_embeddings, my_labels, my_global_ids)
    result.metrics["recall_at_1"], result.metrics["map_at_r"]
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from pksampler.agree import gather_outcomes
from pksampler.arrays import as_numpy
from pksampler.comm import Collectives, started_collectives
from pksampler.train.evaluation.metrics import _check_options, _score
from pksampler.train.evaluation.ivf import (IVF_POINTS_PER_LIST, build_ivf, default_nlist, ivf_search, sample_mask,
                                             train_centroids)
from pksampler.train.evaluation.queries import recall_standard_error, stratified_queries
from pksampler.train.evaluation.shard_search import merge_topk, search_shard, search_unit_blocks, unit_rows

__all__ = ["ShardedResult", "sharded_retrieval"]

#: global ids stay below this: a neighbour travels as ``2 * id + hit`` in an int64
_ID_LIMIT = 1 << 62

#: rows checked at once (bounds the temporary copies for a multi-GB shard)
_ROW_BLOCK = 1 << 16

#: bytes of the shard normalised at once under cosine (the one copy held beside the caller's shard)
_BLOCK_BYTES = 1 << 24


@dataclass(frozen=True)
class ShardedResult:
    """What :func:`sharded_retrieval` found (the same on every rank).

    Attributes:
        metrics: ``recall_at_{k}``, ``recall_at_1_se`` (Wilson half-width / 1.96, about √(p(1−p)/Q)), ``precision_at_1``,
            ``r_precision``, ``map_at_r``, ``num_queries`` (queries with R > 0), ``num_excluded``.
        query_ids: global ids of the queries, increasing.
        rows: the global ids whose neighbours were kept (``neighbour_ids=``), in the given order.
        neighbours: ``(len(rows), num_neighbours)`` global ids, nearest first; ``-1`` pads.
        distances: same shape, float64, smaller is nearer; ``inf`` pads.
        metric: the metric used.
        bytes_received: bytes this rank received from the others (queries, counts and top-k lists).
        query_labels: the queries' labels, in ``query_ids`` order.
        per_query: each metric per query (``query_ids`` order; NaN for a query with R = 0).
    """

    metrics: dict[str, float]
    query_ids: np.ndarray
    rows: np.ndarray
    neighbours: np.ndarray
    distances: np.ndarray
    metric: str
    bytes_received: int
    query_labels: np.ndarray = field(default=None, repr=False)
    per_query: dict[str, np.ndarray] = field(default=None, repr=False)

    @property
    def similarities(self) -> np.ndarray:
        """Cosine similarity (or inner product) of each neighbour; ``-distance`` for l2, NaN pads."""
        values = -self.distances
        return np.where(np.isfinite(values), values, np.nan)


def _prepare_shard(embeddings: Any, labels: Any, ids: Any, metric: str):
    """The shard as float32 rows sorted by global id (as given: cosine normalises block by block), labels, ids."""
    shard = as_numpy(embeddings, name="sharded_retrieval(embeddings=)", dtype=np.float32, ndim=2)
    for start in range(0, shard.shape[0], _ROW_BLOCK):
        block = shard[start:start + _ROW_BLOCK]
        if not np.isfinite(block).all():
            row, column = (int(v[0]) for v in np.nonzero(~np.isfinite(block)))
            raise ValueError(f"sharded_retrieval(embeddings=) must be finite, got {block[row, column]} in row "
                             f"{start + row}, column {column}")
    count = shard.shape[0]
    labels = as_numpy(labels, name="sharded_retrieval(labels=)", kinds="iu", ndim=1).astype(np.int64, copy=False)
    ids = as_numpy(ids, name="sharded_retrieval(ids=)", kinds="iu", ndim=1)
    if ids.size and ids.max() >= _ID_LIMIT:  # before int64: a uint64 past 2**63 would wrap negative
        raise ValueError(f"sharded_retrieval(ids=) must be global ids below 2**62 = {_ID_LIMIT} (a neighbour "
                         f"travels as 2·id + hit in int64), got {int(ids.max())}")
    ids = ids.astype(np.int64, copy=False)
    for name, value in (("labels", labels), ("ids", ids)):
        if value.size != count:
            raise ValueError(f"sharded_retrieval({name}=) must hold one value per row of embeddings= ({count}), "
                             f"got {value.size}")
    if count and ids.min() < 0:
        raise ValueError(f"sharded_retrieval(ids=) must be global ids >= 0, got {int(ids.min())}")
    if count > 1 and not (np.diff(ids) > 0).all():
        order = np.argsort(ids, kind="stable")
        ids, labels, shard = ids[order], labels[order], shard[order]
        if not (np.diff(ids) > 0).all():
            repeated = int(ids[1:][np.diff(ids) == 0][0])
            raise ValueError(f"sharded_retrieval(ids=) must be unique global ids, got {repeated} twice")
    return shard, labels, ids


def _searched(rows: np.ndarray, metric: str) -> np.ndarray:
    """Rows taken from the shard (a copy) as the search sees them: normalised for cosine."""
    return unit_rows(rows) if metric == "cosine" else rows


def _block_rows(dim: int) -> int:
    """Rows of one normalised block of the shard under cosine: ``_BLOCK_BYTES`` of float32."""
    return max(1, _BLOCK_BYTES // (4 * max(dim, 1)))


def _fingerprint(*values: Any) -> int:
    digest = hashlib.sha256(repr(values).encode())
    return int.from_bytes(digest.digest()[:7], "little")


#: the error types a rank's bad input may raise, coded 1, 2, ... in the agreement row
_ERRORS = (ValueError, TypeError)


def _agree(collectives: Collectives, error: Exception | None, query_ids: np.ndarray | None,
           neighbour_ids: np.ndarray | None, dim: int, **options) -> None:
    """Raise on every rank (not hang) when a rank's input was bad or the ranks passed different options.

    Every rank validates its input first and reports its error (or none) and
    its options' fingerprints in one :func:`pksampler.agree.gather_outcomes`,
    so a rank with bad input and the ranks without all raise the same
    ValueError, naming the rank.
    """
    names = ["query_ids", "neighbour_ids", "embedding dimension", *options]
    mine = [0] * len(names)
    if error is None:
        mine = [_fingerprint(None if query_ids is None else query_ids.tobytes()),
                _fingerprint(None if neighbour_ids is None else neighbour_ids.tobytes()), dim,
                *(_fingerprint(value) for value in options.values())]
    outcomes = gather_outcomes(collectives, error, mine, kinds=_ERRORS)
    failed = outcomes.failed
    if failed:
        first = failed[0]
        kind, message = outcomes.kinds[first], outcomes.messages[first]
        if collectives.size == 1:
            raise kind(message)
        if len(failed) == collectives.size and len(set(outcomes.messages)) == 1:
            raise kind(f"sharded_retrieval: on every rank: {message}")
        others = f" (ranks {failed[1:]} also failed)" if len(failed) > 1 else ""
        raise kind(f"sharded_retrieval: rank {first} of {collectives.size}: {message}{others}")
    differ = outcomes.differing(names)
    if differ:
        raise ValueError(f"sharded_retrieval: the ranks passed different {', '.join(differ)}; every rank must pass "
                         "the same options and query ids (each rank passes only its own embeddings, labels and ids)")


def _gather(collectives, array: np.ndarray) -> tuple[np.ndarray, int]:
    """Every rank's rows of ``array`` (rank order) and the bytes that came from the others."""
    gathered = collectives.allgather(torch.from_numpy(np.ascontiguousarray(array))).cpu().numpy()
    return gathered, gathered.nbytes - array.nbytes


def _gather_queries(collectives, labels, ids, query_ids):
    """Every query's label and id on every rank, by increasing id: (labels, ids, bytes received).

    The vectors travel later, chunk by chunk (:func:`_chunk_vectors`), so a
    rank never holds more than one chunk of other ranks' rows.
    """
    mine = np.ones(ids.size, dtype=bool) if query_ids is None else np.isin(ids, query_ids)
    query_labels, moved_l = _gather(collectives, labels[mine])
    found, moved_i = _gather(collectives, ids[mine])
    order = np.argsort(found, kind="stable")
    _check_unique(collectives, found, order, int(mine.sum()))
    found = found[order]
    expected = found.size if query_ids is None else query_ids.size
    if found.size != expected:
        raise ValueError(f"sharded_retrieval(query_ids=) names {expected} ids but the ranks hold {found.size} of them"
                         ": every query id must be in exactly one rank's ids=")
    return query_labels[order], found, moved_l + moved_i


def _check_unique(collectives, found: np.ndarray, order: np.ndarray, count: int) -> None:
    """Raise on every rank when a gathered (query) id came from two ranks: ``ids=`` must be unique over all ranks.

    Each rank's ids are unique already (:func:`_prepare_shard`), so a repeat
    here is the same global id on two ranks. With ``query_ids=None`` every id
    is gathered, so this checks all of them.
    """
    ordered = found[order]
    repeats = np.flatnonzero(np.diff(ordered) == 0)
    if not repeats.size:
        return
    counts = collectives.allgather_numpy(np.array([count], dtype=np.int64))[:, 0]
    owner = np.repeat(np.arange(counts.size), counts)  # rank of each gathered row (rank-major)
    first = int(repeats[0])
    ranks = sorted({int(owner[order[first]]), int(owner[order[first + 1]])})
    raise ValueError(f"sharded_retrieval(ids=) must be unique over all ranks, got global id {int(ordered[first])} "
                     f"on ranks {ranks[0]} and {ranks[-1]}" + (f" ({repeats.size} repeated ids)" if repeats.size > 1
                                                              else ""))


def _chunk_vectors(collectives, shard: np.ndarray, ids: np.ndarray, chunk_ids: np.ndarray,
                   metric: str) -> tuple[np.ndarray, int]:
    """The vectors of ``chunk_ids`` (increasing) on every rank: each rank sends the ones it holds."""
    mine = np.isin(ids, chunk_ids)
    rows, moved = _gather(collectives, _searched(shard[mine], metric))
    found, moved_i = _gather(collectives, ids[mine])
    return rows[np.argsort(found, kind="stable")], moved + moved_i


def _relevant(collectives, labels: np.ndarray, query_labels: np.ndarray) -> np.ndarray:
    """R per query: items of its class over every rank's shard, itself left out."""
    classes, counts = np.unique(labels, return_counts=True)
    local = np.zeros(query_labels.size, dtype=np.int64)
    if classes.size:
        position = np.minimum(np.searchsorted(classes, query_labels), classes.size - 1)
        local = np.where(classes[position] == query_labels, counts[position], 0)
    total = collectives.allreduce_sum(torch.from_numpy(local.astype(np.int64))).cpu().numpy()
    return total.astype(np.int64) - 1


def _chunks(need: np.ndarray, searched: np.ndarray, budget: int, chunk_size: int):
    """Query rows in order of need (k), each chunk bounded by ``budget`` neighbours; the same on every rank."""
    ordered = searched[np.argsort(need[searched], kind="stable")]
    start = 0
    while start < ordered.size:
        end_need = int(need[ordered[min(start + chunk_size, ordered.size) - 1]])
        rows = max(1, min(chunk_size, budget // max(end_need, 1)))
        yield np.sort(ordered[start:start + rows])
        start += rows


def _search_chunk(collectives, search: Callable, queries, query_ids, query_labels, labels, ids, k):
    """One chunk: this rank's search, all-gather of the W lists, merge; returns (dist, ids, hits, bytes).

    Each neighbour travels as its distance and ``2 * id + hit``: ordering by
    that code is ordering by id (ids are unique), so the merge keeps the hit
    flag that only the rank holding the item can compute.
    """
    dist, found = search(queries, query_ids, k)
    position = np.minimum(np.searchsorted(ids, found), max(ids.size - 1, 0))
    hit = (found >= 0) & (labels[position] == query_labels[:, None]) if ids.size else np.zeros(found.shape, bool)
    code = np.where(found >= 0, found * 2 + hit, -1)
    all_dist, moved_d = _gather(collectives, dist)
    all_code, moved_c = _gather(collectives, code)
    merged_dist, merged_code = merge_topk(np.split(all_dist, collectives.size),
                                          np.split(all_code, collectives.size), k)
    merged_ids = np.where(merged_code >= 0, merged_code >> 1, -1)
    return merged_dist, merged_ids, (merged_code >= 0) & (merged_code & 1).astype(bool), moved_d + moved_c


def _query_set(value: Any, name: str) -> np.ndarray | None:
    if value is None:
        return None
    found = as_numpy(value, name=f"sharded_retrieval({name}=)", kinds="iu", ndim=1).astype(np.int64, copy=False)
    return np.unique(found) if name == "query_ids" else found


@dataclass(frozen=True)
class _Plan:
    """What one evaluation pass searches: the options every rank agreed on."""

    ks: tuple[int, ...]
    num_neighbours: int
    chunk_size: int
    budget: int


def sharded_retrieval(
    embeddings: Any, labels: Any, ids: Any, *,
    query_ids: Any = None, ks: Sequence[int] = (1, 5, 10), metric: str = "cosine",
    neighbour_ids: Any = None, num_neighbours: int = 5,
    index: str = "flat", nlist: int | None = None, nprobe: int = 16, check_queries: int = 2000, seed: int = 0,
    chunk_size: int | None = None, max_neighbours_per_chunk: int = 1 << 22,
    collectives: Collectives | None = None,
) -> ShardedResult:
    """Recall@k, precision@1, R-precision and MAP@R of a gallery spread over the ranks, searched where it lies.

    The self-gallery protocol (as SOP is scored): every gallery item may be a
    query, and a query's own item is left out of its list (by global id).
    Call it on every rank at once.

    Args:
        embeddings: this rank's ``(n, d)`` rows (numpy or torch; ``n`` may be 0, with ``d`` columns).
        labels: ``(n,)`` integer labels of those rows.
        ids: ``(n,)`` global ids of those rows, unique over all ranks, in ``[0, 2**62)``; ties rank by them.
        query_ids: the global ids that are queries, the same on every rank; ``None``: every item
            (see :func:`~.queries.stratified_queries` for a sample).
        ks: the k of each ``recall_at_{k}``.
        metric: ``"cosine"`` (rows L2-normalised here), ``"ip"`` or ``"l2"`` (squared).
        neighbour_ids: query ids whose top ``num_neighbours`` are returned (a result gallery).
        num_neighbours: neighbours kept per ``neighbour_ids`` entry.
        index: ``"flat"`` (exact, tie-resolving) or ``"ivf"`` (approximate, :mod:`.ivf`; for
            10⁶ queries and more). An ``"ivf"`` evaluation also searches ``check_queries``
            sampled queries exactly and reports the gap (``ivf_gap_recall_at_1``, ``ivf_gap_map_at_r``).
        nlist, nprobe: the IVF's lists (default about √N) and lists probed per query.
        seed: keys the IVF's training sample, its k-means and the check sample.
        chunk_size: queries per search (default 4,096 exact, 2¹⁸ IVF); max_neighbours_per_chunk
            bounds queries x k per chunk.
        collectives: a :class:`pksampler.comm.Collectives` (the trainer's backend); ``None``: the runtime
            this process started (:func:`pksampler.comm.started_collectives`).

    Returns:
        A :class:`ShardedResult`, identical on every rank; with ``index="flat"`` the same for every
        split of the gallery, and with one rank its metrics equal :func:`~.metrics.evaluate_retrieval`'s.

    Raises:
        ValueError: bad arguments on any rank (every rank raises the same error, naming the rank),
            ranks that disagree on the options or query ids, a global id on two ranks (checked among
            the queries: every id with ``query_ids=None``), a query id held by no rank (raised on
            every rank).
    """
    collectives = started_collectives("sharded_retrieval") if collectives is None else collectives
    chunk_size = chunk_size if chunk_size is not None else (4096 if index == "flat" else 1 << 18)
    options = dict(ks=ks, metric=metric, num_neighbours=num_neighbours, chunk_size=chunk_size,
                   budget=max_neighbours_per_chunk, index=index, nlist=nlist, nprobe=nprobe, check=check_queries,
                   seed=seed)
    ks, query_ids, neighbour_ids, (shard, labels, ids) = _agreed_input(collectives, embeddings, labels, ids,
                                                                        query_ids, neighbour_ids, options)
    plan = _Plan(ks, num_neighbours, chunk_size, max_neighbours_per_chunk)
    exact = _exact_search(shard, ids, metric)
    if index == "flat":
        return _evaluate(collectives, shard, labels, ids, query_ids, neighbour_ids, exact, plan, metric)
    search, moved = _ivf_search(collectives, shard, ids, metric, nlist=nlist, nprobe=nprobe, seed=seed)
    result = _evaluate(collectives, shard, labels, ids, query_ids, neighbour_ids, search, plan, metric)
    return _certified(collectives, result, shard, labels, ids, exact, plan, metric, check_queries, seed, moved)


def _agreed_input(collectives: Collectives, embeddings: Any, labels: Any, ids: Any, query_ids: Any,
                  neighbour_ids: Any, options: dict[str, Any]) -> tuple[tuple[int, ...], Any, Any, tuple]:
    """This rank's checked input (ks, query ids, neighbour ids, (shard, labels, ids)) once every rank checked its own.

    Every rank validates, then the outcome travels in the agreement collective (:func:`_agree`): a bad input on
    one rank raises the same ValueError on every rank instead of leaving the others in a collective.
    """
    error, ks, query_ids, neighbour_ids, shard = _validate_locally(
        embeddings, labels, ids, query_ids=query_ids, neighbour_ids=neighbour_ids, ks=options["ks"],
        metric=options["metric"], index=options["index"], nlist=options["nlist"],
        options=dict(num_neighbours=options["num_neighbours"], chunk_size=options["chunk_size"],
                     nprobe=options["nprobe"], check_queries=options["check"],
                     max_neighbours_per_chunk=options["budget"]))
    _agree(collectives, error, query_ids, neighbour_ids, shard[0].shape[1], **{**options, "ks": ks})
    return ks, query_ids, neighbour_ids, shard


def _validate_locally(embeddings: Any, labels: Any, ids: Any, *, query_ids: Any, neighbour_ids: Any,
                      ks: Sequence[int], metric: str, index: str, nlist: int | None,
                      options: dict[str, int]) -> tuple[Exception | None, Any, Any, Any, tuple]:
    """This rank's checked arguments, or the error they raised (every rank reports it in the agreement)."""
    shard = np.zeros((0, 0), dtype=np.float32)
    try:
        if index not in ("flat", "ivf"):
            raise ValueError(f"sharded_retrieval(index=) must be 'flat' or 'ivf', got {index!r}")
        ks = _check_options(metric, ks, owner="sharded_retrieval", **options)
        if nlist is not None:
            _check_options(metric, ks, owner="sharded_retrieval", nlist=nlist)
        query_ids, neighbour_ids = _query_set(query_ids, "query_ids"), _query_set(neighbour_ids, "neighbour_ids")
        return None, ks, query_ids, neighbour_ids, _prepare_shard(embeddings, labels, ids, metric)
    except (ValueError, TypeError) as caught:
        return caught, ks, query_ids, neighbour_ids, (shard, labels, ids)


def _exact_search(shard: np.ndarray, ids: np.ndarray, metric: str) -> Callable:
    if metric == "cosine":  # the caller's rows, normalised one block at a time: the shard is not held twice
        block = _block_rows(shard.shape[1])
        return lambda queries, query_ids, k: search_unit_blocks(queries, query_ids, shard, ids, k, block_rows=block)
    return lambda queries, query_ids, k: search_shard(queries, query_ids, shard, ids, k, metric=metric)


def _ivf_search(collectives, shard, ids, metric, *, nlist, nprobe, seed) -> tuple[Callable, int]:
    """This rank's IVF over centroids trained once (rank 0) on a sample gathered from every rank."""
    total = int(collectives.allreduce_sum(torch.tensor([ids.size], dtype=torch.int64)).item())
    nlist = default_nlist(total) if nlist is None else min(nlist, max(total, 1))
    mine = sample_mask(ids, 1.25 * nlist * IVF_POINTS_PER_LIST / max(total, 1), seed=seed)  # 1.25: hash slack
    sample, moved = _gather(collectives, _searched(shard[mine], metric))
    sample_ids, moved_i = _gather(collectives, ids[mine])
    if collectives.rank == 0:
        centroids = train_centroids(sample[np.argsort(sample_ids)], nlist, metric=metric, seed=seed)
    else:
        centroids = np.zeros((0, shard.shape[1]), dtype=np.float32)
    centroids, moved_c = _gather(collectives, centroids)  # rank 0's rows only: a broadcast
    index = build_ivf(shard, ids, centroids, metric="l2" if metric == "l2" else "ip", nprobe=nprobe,
                      rows=lambda block: _searched(block, metric), block_rows=_block_rows(shard.shape[1]))
    search = lambda queries, query_ids, k: ivf_search(index, queries, query_ids, k,  # noqa: E731
                                                      metric="l2" if metric == "l2" else "ip")
    return search, moved + moved_i + moved_c


def _certified(collectives, result, shard, labels, ids, exact, plan, metric, check_queries, seed, moved):
    """The IVF result with its gap to exact search on a stratified sample of its queries."""
    sample = result.query_ids[stratified_queries(result.query_labels, check_queries, seed=seed)]
    checked = _evaluate(collectives, shard, labels, ids, sample, None, exact, plan, metric)
    metrics = dict(result.metrics)
    rows = np.searchsorted(result.query_ids, sample)
    for name in ("recall_at_1", "map_at_r"):
        approximate = result.per_query[name][rows]
        approximate = float(np.nanmean(approximate)) if np.isfinite(approximate).any() else float("nan")
        metrics[f"ivf_gap_{name}"] = approximate - checked.metrics[name]
    metrics["ivf_check_queries"] = checked.metrics["num_queries"]
    return dataclasses.replace(result, metrics=metrics,
                               bytes_received=result.bytes_received + checked.bytes_received + moved)


def _evaluate(collectives, shard, labels, ids, query_ids, neighbour_ids, search, plan: _Plan, metric: str):
    """One pass: queries by R in chunks, each searched on every rank and merged; metrics in query-id order."""
    query_labels, qids, moved = _gather_queries(collectives, labels, ids, query_ids)
    relevant = _relevant(collectives, labels, query_labels)
    moved += relevant.nbytes * (collectives.size - 1)
    wanted = _wanted_rows(neighbour_ids, qids)
    used = relevant > 0
    need = np.where(used, np.maximum(max(plan.ks), relevant), 0)
    need[wanted] = np.maximum(need[wanted], plan.num_neighbours)
    names = [f"recall_at_{k}" for k in plan.ks] + ["precision_at_1", "r_precision", "map_at_r"]
    per_query = {name: np.full(qids.size, np.nan) for name in names}
    shown_ids = np.full((qids.size if wanted.size else 0, plan.num_neighbours), -1, dtype=np.int64)
    shown_dist = np.full(shown_ids.shape, np.inf)
    for rows in _chunks(need, np.flatnonzero(need > 0), plan.budget, plan.chunk_size):
        k = int(need[rows].max())
        queries, bytes_in = _chunk_vectors(collectives, shard, ids, qids[rows], metric)
        dist, found, hits, bytes_out = _search_chunk(collectives, search, queries, qids[rows], query_labels[rows],
                                                     labels, ids, k)
        moved += bytes_in + bytes_out
        if shown_ids.size:
            shown_ids[rows] = _pad(found, plan.num_neighbours, -1)
            shown_dist[rows] = _pad(dist, plan.num_neighbours, np.inf)
        scored = used[rows]
        width = int(need[rows][scored].max()) if scored.any() else 0
        _score(per_query, rows[scored], hits[scored, :width], relevant[rows][scored], plan.ks)
    return ShardedResult(_summary(per_query, used, qids.size), qids, qids[wanted], shown_ids[wanted],
                         shown_dist[wanted], metric, int(moved), query_labels, per_query)


def _wanted_rows(neighbour_ids: np.ndarray | None, qids: np.ndarray) -> np.ndarray:
    if neighbour_ids is None or neighbour_ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    rows = np.minimum(np.searchsorted(qids, neighbour_ids), max(qids.size - 1, 0))
    missing = neighbour_ids[(qids.size == 0) | (qids[rows] != neighbour_ids)]
    if missing.size:
        raise ValueError(f"sharded_retrieval(neighbour_ids=) must be query ids; {missing[:5].tolist()} are not")
    return rows


def _pad(values: np.ndarray, width: int, fill: Any) -> np.ndarray:
    if values.shape[1] >= width:
        return values[:, :width]
    return np.pad(values, ((0, 0), (0, width - values.shape[1])), constant_values=fill)


def _summary(per_query: dict[str, np.ndarray], used: np.ndarray, total: int) -> dict[str, float]:
    """Means in query-id order (the same at every W), the count, and Recall@1's standard error."""
    count = int(used.sum())
    metrics: dict[str, float] = {}
    for name, values in per_query.items():
        metrics[name] = float(values[used].mean()) if count else float("nan")
        if name == "recall_at_1":  # its standard error beside it
            metrics["recall_at_1_se"] = recall_standard_error(metrics[name], count)
    metrics["num_queries"] = count
    metrics["num_excluded"] = int(total - count)
    return metrics

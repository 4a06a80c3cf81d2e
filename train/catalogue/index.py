"""Build a faiss index from the catalogue's parts, with a recall certificate; write it atomically.

1. The kind: exact (``flat``: ``IndexFlatIP`` behind an id map) up to
   ``flat_limit`` vectors (10^6 by default), above that ``ivfflat``
   (``IndexIVFFlat``, ``nlist`` a power of two near sqrt(N)); ``ivfpq``
   on request: ``IndexIVFPQ`` codes in memory (``pq_bytes`` per vector), and
   an exact re-rank of ``refine_factor * k`` candidates with the vectors
   read from the catalogue's memory-mapped parts (:class:`~.parts.PartVectors`),
   so the index's memory is the codes', not the vectors'.
   Embeddings are L2-normalised, so inner product is cosine similarity.
2. Vectors are read one part at a time (memory-mapped): the IVF quantiser
   trains on a seeded sample of ``train_per_list`` vectors per list, then
   each part is added with its ids (``add_with_ids``).
3. The certificate: ``queries`` catalogue vectors drawn with the seed, their
   exact neighbours found part by part (``faiss.knn`` + ``ResultHeap``), the
   query itself left out. On the first half, the smallest ``nprobe`` (a
   power of two) whose Recall@1 reaches ``target`` plus two standard errors
   becomes the index's search setting; the second half certifies it: Recall@1 (the exact nearest
   neighbour comes first) and Recall@10 (it is in the top 10), with their
   standard errors. A tie in similarity counts as a hit.
4. ``index.faiss`` is streamed through a temporary file and renamed (its
   SHA-256 taken on the way); ``index.json`` (the metadata: kind, settings,
   certificate, the model's digest, the catalogue) follows the same way.
5. The index grows and shrinks in place (:mod:`.update`): added vectors
   and removed ids are kept beside the base file (:mod:`.delta`) and merged
   when it is loaded. An IVF index also writes its centroids and the mean
   squared distance of a sample of its vectors to them, the yardstick of
   the drift check.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from pksampler.datasets._image import read_regular
from pksampler.files import atomic_write_text, atomic_writer

from pksampler.train.catalogue.delta import (CENTROIDS, apply_delta, mean_sq_distance, read_delta, remove_stale,
                                             write_array)
from pksampler.train.catalogue.parts import (PartVectors, catalogue_versions, check_parts, file_sha256, iter_parts,
                                             make_out_folder, read_manifest, writing)
from pksampler.train.errors import ConfigError

__all__ = ["INDEX_FILE", "INDEX_KINDS", "METADATA_FILE", "IndexOptions", "Searcher", "build_index",
           "history_digest", "load_base", "load_index", "read_metadata", "search", "write_index", "write_metadata"]

INDEX_FILE, METADATA_FILE = "index.faiss", "index.json"
INDEX_KINDS = ("auto", "flat", "ivfflat", "ivfpq")
#: the fewest results a search asks faiss for (see :func:`search`)
MIN_SEARCH_K = 10
#: codes per PQ sub-quantizer (8 bits): its k-means needs at least this many training vectors
PQ_CENTROIDS = 256
#: catalogue vectors sampled for the drift check's yardstick
DRIFT_SAMPLE = 10_000


@dataclass(frozen=True)
class IndexOptions:
    """The index's kind and settings; the defaults are the ones the benchmark certifies."""

    kind: str = "auto"
    flat_limit: int = 1_000_000
    nlist: int | None = None
    train_per_list: int = 64
    pq_bytes: int | None = None
    refine_factor: int = 4
    queries: int = 2000
    target: float = 0.99
    seed: int = 0
    threads: int | None = None
    #: update: the new vectors' mean squared distance to their centroids may reach this multiple of the indexed
    #: ones' before the check says to retrain the coarse quantizer
    drift_limit: float = 1.2
    #: update: the delta (added + removed) may reach this share of the base index before it is merged into it
    compact_fraction: float = 0.1
    #: always build afresh (retrains an IVF index's centroids), even where an update would do
    rebuild: bool = False

    def __post_init__(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise ConfigError(f"--kind: {self.kind!r} must be one of {list(INDEX_KINDS)}")
        for name in ("flat_limit", "train_per_list", "refine_factor", "queries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be a positive int, got {value!r}")
        if self.nlist is not None and (isinstance(self.nlist, bool) or not isinstance(self.nlist, int)
                                       or self.nlist < 1):
            raise ConfigError(f"--nlist: must be a positive int, got {self.nlist!r}")
        if not 0.0 < self.target <= 1.0:
            raise ConfigError(f"--target: must lie in (0, 1], got {self.target!r}")
        if not 1.0 <= self.drift_limit:
            raise ConfigError(f"--drift-limit: must be at least 1 (a ratio of mean distances), got "
                              f"{self.drift_limit!r}")
        if not 0.0 <= self.compact_fraction <= 1.0:
            raise ConfigError(f"--compact-fraction: must lie in [0, 1], got {self.compact_fraction!r}")


def _kind(options: IndexOptions, count: int) -> str:
    if options.kind != "auto":
        return options.kind
    return "flat" if count <= options.flat_limit else "ivfflat"


def _nlist(options: IndexOptions, count: int) -> int:
    if options.nlist is not None:
        return options.nlist
    return max(1, 2 ** round(math.log2(max(math.sqrt(count), 1.0))))


def _pq_bytes(options: IndexOptions, dim: int) -> int:
    m = options.pq_bytes or max(1, dim // 4)
    if dim % m:
        raise ConfigError(f"--pq-bytes: {m} must divide the embedding size {dim}")
    return m


def _rows(catalogue: Path, manifest: dict[str, Any], positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectors and ids at sorted global row ``positions`` (rows counted over the parts in order), part by part."""
    vectors, ids, offset = [], [], 0
    for _, embeddings, part_ids in iter_parts(catalogue, manifest):
        local = positions[(positions >= offset) & (positions < offset + len(part_ids))] - offset
        if local.size:
            vectors.append(np.asarray(embeddings[local], dtype=np.float32))
            ids.append(np.asarray(part_ids[local]))
        offset += len(part_ids)
    return np.concatenate(vectors), np.concatenate(ids)


def _check_enough_vectors(kind: str, count: int) -> None:
    """8-bit PQ trains 256 centroids per sub-quantizer: fewer vectors is one line naming --kind, not faiss's error."""
    if kind == "ivfpq" and count < PQ_CENTROIDS:
        raise ConfigError(f"--kind: ivfpq needs at least {PQ_CENTROIDS} vectors to train its codebooks, the "
                          f"catalogue holds {count}; use --kind flat (exact search) or ivfflat")


def _empty_index(kind: str, dim: int, count: int, options: IndexOptions) -> faiss.Index:
    if kind == "flat":
        return faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
    quantizer = faiss.IndexFlatIP(dim)
    nlist = _nlist(options, count)
    if kind == "ivfflat":
        return faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    return faiss.IndexIVFPQ(quantizer, dim, nlist, _pq_bytes(options, dim), 8, faiss.METRIC_INNER_PRODUCT)


def _fill(index: faiss.Index, kind: str, catalogue: Path, manifest: dict[str, Any], options: IndexOptions) -> None:
    """Train (IVF) on a seeded sample, then add every part with its ids, one part at a time."""
    count = manifest["count"]
    if kind != "flat":
        ivf = faiss.extract_index_ivf(index)
        positions = _training_positions(kind, ivf.nlist, count, options)
        size = len(positions)
        sample, _ = _rows(catalogue, manifest, positions)
        if size < ivf.nlist:
            raise ConfigError(f"--nlist: {ivf.nlist} lists need at least as many vectors to train, the catalogue "
                              f"holds {count}")
        index.train(sample)
    if kind == "ivfflat":
        _add_preallocated(index, catalogue, manifest)
        return
    for _, embeddings, ids in iter_parts(catalogue, manifest):
        index.add_with_ids(np.ascontiguousarray(embeddings, dtype=np.float32), np.ascontiguousarray(ids))


def _training_positions(kind: str, nlist: int, count: int, options: IndexOptions) -> np.ndarray:
    """Sorted rows of the quantiser's seeded training sample."""
    # PQ's codebooks (256 centroids per sub-vector) want about 40 vectors per centroid as well
    size = min(count, max(nlist * options.train_per_list, 10_000 if kind == "ivfpq" else 0))
    return np.sort(np.random.default_rng([options.seed, 1]).choice(count, size=size, replace=False))


def _add_preallocated(ivf: faiss.IndexIVFFlat, catalogue: Path, manifest: dict[str, Any]) -> None:
    """IVF-Flat's lists, each allocated once at its final size, then filled part by part.

    ``add_with_ids`` grows every list by doubling its buffer, so the peak
    memory reaches up to twice the vectors' bytes (10^7 x 128 peaked near
    8 GiB for 5.1 GB of vectors). Two passes instead: assign every vector to
    its list (the quantiser's search), size the lists, then copy each part's
    vectors and ids into place in list order. The lists hold what
    ``add_with_ids`` would have put there, in the same order.
    """
    assigned = [ivf.quantizer.assign(np.ascontiguousarray(embeddings, dtype=np.float32), 1).ravel().astype(np.int32)
                for _, embeddings, _ in iter_parts(catalogue, manifest)]
    sizes = np.bincount(np.concatenate(assigned), minlength=ivf.nlist)
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    for number, size in enumerate(sizes.tolist()):
        lists.resize(number, size)
    filled = np.zeros(ivf.nlist, dtype=np.int64)
    for (_, embeddings, ids), part_lists in zip(iter_parts(catalogue, manifest), assigned):
        order = np.argsort(part_lists, kind="stable")
        vectors = np.ascontiguousarray(np.asarray(embeddings, dtype=np.float32)[order])
        row_ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64)[order])
        numbers, starts, counts = np.unique(part_lists[order], return_index=True, return_counts=True)
        for number, start, count in zip(numbers.tolist(), starts.tolist(), counts.tolist()):
            lists.update_entries(number, int(filled[number]), count, faiss.swig_ptr(row_ids[start:start + count]),
                                 faiss.swig_ptr(vectors[start:start + count].view(np.uint8)))
            filled[number] += count
    ivf.ntotal = int(sizes.sum())


def _exact(catalogue: Path, manifest: dict[str, Any], queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-``k`` (inner product) of ``queries`` over every part: ``(D, I)`` with global ids."""
    heap = faiss.ResultHeap(len(queries), k, keep_max=True)
    for _, embeddings, ids in iter_parts(catalogue, manifest):
        distances, local = faiss.knn(queries, np.ascontiguousarray(embeddings, dtype=np.float32), min(k, len(ids)),
                                     metric=faiss.METRIC_INNER_PRODUCT)
        found = np.where(local >= 0, np.asarray(ids)[np.maximum(local, 0)], -1)
        if found.shape[1] < k:
            pad = k - found.shape[1]
            distances = np.pad(distances, ((0, 0), (0, pad)), constant_values=-np.inf)
            found = np.pad(found, ((0, 0), (0, pad)), constant_values=-1)
        heap.add_result(np.ascontiguousarray(distances, dtype=np.float32), np.ascontiguousarray(found, dtype=np.int64))
    heap.finalize()
    return heap.D, heap.I


def _drop_self(distances: np.ndarray, ids: np.ndarray, own: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``k`` results of each row that are not the query's own id."""
    keep = ids != own[:, None]
    order = np.argsort(~keep, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(distances, order, 1), np.take_along_axis(ids, order, 1)


def search(index: faiss.Index, queries: np.ndarray, k: int, *, nprobe: int | None = None,
           rerank: PartVectors | None = None, refine_factor: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """``(D, I)``: the top-``k`` similarities and ids, at ``nprobe`` lists for an IVF index.

    At least :data:`MIN_SEARCH_K` results are searched and the first ``k``
    kept, so a top-1 search sees what the certificate saw. With ``rerank``,
    ``refine_factor`` times as many candidates are taken from the index and
    ordered by their exact inner product with the query.
    """
    if nprobe is not None:
        faiss.extract_index_ivf(index).nprobe = nprobe
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    wanted = max(k, MIN_SEARCH_K) * (refine_factor if rerank is not None else 1)
    distances, ids = index.search(queries, wanted)
    if rerank is not None:
        vectors = rerank(ids).reshape(*ids.shape, -1)
        distances = np.where(ids >= 0, np.einsum("qd,qkd->qk", queries, vectors), -np.inf).astype(np.float32)
        order = np.argsort(-distances, axis=1, kind="stable")
        distances, ids = np.take_along_axis(distances, order, 1), np.take_along_axis(ids, order, 1)
    return distances[:, :k], ids[:, :k]


@dataclass
class Searcher:
    """A loaded index, its metadata and, for ``ivfpq``, the re-rank over the catalogue's parts."""

    index: faiss.Index
    metadata: dict[str, Any]
    rerank: PartVectors | None = None

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return search(self.index, queries, k, rerank=self.rerank,
                      refine_factor=self.metadata["options"]["refine_factor"])


def _recalls(found_d: np.ndarray, found_i: np.ndarray, exact_d: np.ndarray, exact_i: np.ndarray) -> tuple[float, float]:
    """Recall@1 and Recall@10 of found against exact nearest neighbours; an equal similarity counts as a hit."""
    tie = np.abs(found_d - exact_d[:, :1]) <= 1e-6
    hit = (found_i == exact_i[:, :1]) | tie
    return float(hit[:, :1].any(axis=1).mean()), float(hit[:, :10].any(axis=1).mean())


def _certify(index: faiss.Index, kind: str, catalogue: Path, manifest: dict[str, Any], options: IndexOptions
             ) -> dict[str, Any]:
    """The nprobe to search with and the recall it reaches on held-apart sampled queries (see the module doc)."""
    count = manifest["count"]
    size = min(options.queries, count)
    rng = np.random.default_rng([options.seed, 2])
    positions = rng.choice(count, size=size, replace=False)
    vectors, own = _rows(catalogue, manifest, np.sort(positions))
    order = rng.permutation(size)  # the sorted rows in a random order, then split into halves
    vectors, own = vectors[order], own[order]
    k = min(10, count - 1)
    if k < 1:
        return {"queries": 0, "note": "a catalogue of one vector: nothing to certify"}
    exact_d, exact_i = _drop_self(*_exact(catalogue, manifest, vectors, k + 1), own, k)
    half = size // 2 if kind != "flat" and size >= 2 else 0
    nprobe = None
    exact_search = {"rerank": PartVectors(catalogue) if kind == "ivfpq" else None,
                    "refine_factor": options.refine_factor}
    if kind != "flat":
        nlist = faiss.extract_index_ivf(index).nlist
        # two standard errors above the target on the tuning half, so the other half meets it too
        needed = min(1.0, options.target + 2 * math.sqrt(options.target * (1 - options.target) / max(half, 1)))
        for nprobe in [2 ** e for e in range(int(math.log2(nlist)) + 1)] + [nlist]:
            d, i = _drop_self(*search(index, vectors[:half], k + 1, nprobe=nprobe, **exact_search), own[:half], k)
            if _recalls(d, i, exact_d[:half], exact_i[:half])[0] >= needed:
                break
    started = time.perf_counter()
    d, i = _drop_self(*search(index, vectors[half:], k + 1, nprobe=nprobe, **exact_search), own[half:], k)
    seconds = time.perf_counter() - started
    r1, r10 = _recalls(d, i, exact_d[half:], exact_i[half:])
    q = size - half
    return {"queries": q, "tuning_queries": half, "nprobe": nprobe, "recall_at_1": r1, "recall_at_10": r10,
            "se_recall_at_1": math.sqrt(r1 * (1 - r1) / q), "se_recall_at_10": math.sqrt(r10 * (1 - r10) / q),
            "target": options.target, "meets_target": r1 >= options.target,
            "batch_search_ms_per_query": 1000 * seconds / q,
            "protocol": "sampled catalogue vectors as queries, self excluded; Recall@k: the exact nearest "
                        "neighbour is among the first k results; equal similarity counts as a hit"}


def write_index(index: faiss.Index, path: Path) -> tuple[int, str]:
    """Stream the index into ``path`` atomically; returns its size and SHA-256.

    faiss turns an exception of the writer callback into its own RuntimeError:
    the callback's OSError (a full disk) is raised again as itself.
    """
    hasher, size, failed = hashlib.sha256(), 0, []
    with writing(path), atomic_writer(path) as stream:
        def write(chunk: bytes) -> int:
            nonlocal size
            hasher.update(chunk)
            size += len(chunk)
            try:
                stream.write(chunk)
            except OSError as error:
                failed.append(error)
                raise
            return len(chunk)

        try:
            faiss.write_index(index, faiss.PyCallbackIOWriter(write))
        except RuntimeError:
            if failed:
                raise failed[0] from None
            raise
    return size, hasher.hexdigest()


def _check_same_model(out: Path, manifest: dict[str, Any]) -> None:
    """An ``out`` that holds the index of another model is refused: a new model means a new index (its vectors
    live in another space), so the old one is never replaced by accident. An unreadable index.json is rebuilt."""
    try:
        held = read_metadata(out)
    except ConfigError:
        return
    theirs, ours = held["model"]["digest"], str(manifest["model"]["digest"])
    if theirs != ours:
        raise ConfigError(f"--out: {out} holds the index of another model (digest {theirs[:12]}, this catalogue's "
                          f"{ours[:12]}); a new model means a new index: use another --out, or delete it first")


def history_digest(manifest: dict[str, Any], upto: int) -> str:
    """A digest of the catalogue's first ``upto`` versions: an index updates only the catalogue it was built from
    (one embedded afresh into the same folder starts another history)."""
    versions = manifest.get("versions") or [{"version": 1, "count": manifest["count"]}]
    return hashlib.sha256(json.dumps(versions[:upto], sort_keys=True).encode()).hexdigest()


def _drift_base(index: faiss.Index, kind: str, catalogue: Path, manifest: dict[str, Any], out: Path,
                options: IndexOptions) -> dict[str, Any] | None:
    """An IVF index's centroids (written beside it) and the mean squared distance to them of a seeded sample of
    the catalogue's vectors that did not train them (those lie closer): what the drift check compares new vectors
    with."""
    if kind == "flat":
        return None
    ivf = faiss.extract_index_ivf(index)
    centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist)
    count = int(manifest["count"])
    unseen = np.setdiff1d(np.arange(count), _training_positions(kind, ivf.nlist, count, options))
    pool = unseen if len(unseen) else np.arange(count)
    rng = np.random.default_rng([options.seed, 3])
    sample, _ = _rows(catalogue, manifest, np.sort(rng.choice(pool, size=min(len(pool), DRIFT_SAMPLE),
                                                              replace=False)))
    return {"centroids": write_array(out, CENTROIDS, centroids), "sample": len(sample),
            "base_mean_sq_distance": mean_sq_distance(centroids, sample)}


def write_metadata(out: Path, metadata: dict[str, Any]) -> None:
    with writing(out / METADATA_FILE):
        atomic_write_text(out / METADATA_FILE, json.dumps(metadata, indent=1))


def build_index(catalogue: str | Path, out: str | Path, *, options: IndexOptions = IndexOptions()) -> dict[str, Any]:
    """Build, certify and write the index of the embedded catalogue ``catalogue`` into the folder ``out``."""
    catalogue, out = Path(catalogue), Path(out)
    manifest = read_manifest(catalogue)
    count, dim = int(manifest["count"]), int(manifest["dim"])
    if count < 1:
        raise ConfigError(f"{catalogue}: the catalogue holds no embeddings (every image was bad?)")
    if options.threads:
        faiss.omp_set_num_threads(options.threads)
    kind = _kind(options, count)
    _check_enough_vectors(kind, count)
    check_parts(catalogue, manifest)
    make_out_folder(out)
    _check_same_model(out, manifest)
    started = time.perf_counter()
    index = _empty_index(kind, dim, count, options)
    _fill(index, kind, catalogue, manifest, options)
    build_seconds = time.perf_counter() - started
    certificate = _certify(index, kind, catalogue, manifest, options)
    if certificate.get("nprobe") is not None:
        faiss.extract_index_ivf(index).nprobe = certificate["nprobe"]
    drift = _drift_base(index, kind, catalogue, manifest, out, options)
    size, digest = write_index(index, out / INDEX_FILE)
    ivf = faiss.extract_index_ivf(index) if kind != "flat" else None
    version = catalogue_versions(manifest)[-1].number
    metadata = {
        "format": "pksampler-catalogue-index", "version": 1, "kind": kind, "metric": "inner_product",
        "count": count, "dim": dim, "nlist": ivf.nlist if ivf is not None else None,
        "nprobe": certificate.get("nprobe"), "options": asdict(options),
        "certificate": certificate, "build_seconds": round(build_seconds, 3),
        "index_file": INDEX_FILE, "index_bytes": size, "index_sha256": digest,
        "catalogue": str(catalogue.resolve()), "model": manifest["model"], "source": manifest["source"],
        "catalogue_version": version, "history_digest": history_digest(manifest, version), "base_count": count,
        "delta": None, "drift": drift,
        "history": [{"version": version, "how": "built", "count": count,
                     "seconds": round(time.perf_counter() - started, 3)}],
    }
    write_metadata(out, metadata)
    remove_stale(out, metadata)
    return metadata


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_metadata(path: Path, metadata: dict[str, Any]) -> None:
    """The fields the search and the query read, with their types, or one ConfigError naming the field."""
    def bad(field: str, rule: str) -> ConfigError:
        return ConfigError(f"--index: {path}: {field} {rule}; build the index again")

    if metadata.get("kind") not in INDEX_KINDS[1:]:
        raise bad("kind", f"must be one of {list(INDEX_KINDS[1:])}, got {metadata.get('kind')!r}")
    for field in ("count", "dim"):
        if not _is_count(metadata.get(field)):
            raise bad(field, f"must be a positive int, got {metadata.get(field)!r}")
    nprobe = metadata.get("nprobe")
    if nprobe is not None and (metadata["kind"] == "flat" or not _is_count(nprobe)):
        raise bad("nprobe", f"{nprobe!r} is given for a flat index (exact search has no lists)"
                  if metadata["kind"] == "flat" else f"must be a positive int or null, got {nprobe!r}")
    model, options = metadata.get("model"), metadata.get("options")
    if not isinstance(model, dict) or not isinstance(model.get("digest"), str):
        raise bad("model", f"must be an object with the model's 'digest', got {model!r}")
    if not isinstance(options, dict) or not _is_count(options.get("refine_factor")):
        raise bad("options.refine_factor", f"must be a positive int, got {options!r}")
    source = metadata.get("source")
    if not isinstance(metadata.get("catalogue"), str) or not isinstance(source, dict) \
            or not isinstance(source.get("location"), str):
        raise bad("catalogue/source", f"must name the catalogue folder and its source, got "
                                      f"{metadata.get('catalogue')!r}, {source!r}")


def read_metadata(folder: Path) -> dict[str, Any]:
    """The checked ``index.json`` of ``folder``, or one ConfigError naming it."""
    path = folder / METADATA_FILE
    try:
        metadata = json.loads(read_regular(path).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--index: {folder} holds no {METADATA_FILE}; build it with train/build_index.py") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"--index: {path} cannot be read ({error}); build the index again") from None
    if not isinstance(metadata, dict) or metadata.get("format") != "pksampler-catalogue-index":
        raise ConfigError(f"--index: {path} is not a pksampler index description; build the index again")
    _check_metadata(path, metadata)
    name = metadata.get("index_file", INDEX_FILE)
    # the index file lives in the folder itself: a path (``../x``, ``/etc/x``, ``a/b``) is never followed
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
        raise ConfigError(f"--index: {path}: index_file {name!r} must be a plain file name inside {folder}; "
                          "build the index again")
    return metadata


def load_index(folder: str | Path) -> Searcher:
    """The index of ``folder``, checked against its metadata (size and SHA-256), its delta merged (vectors added
    and ids removed since the base file was written), set to its nprobe, ready to search."""
    folder = Path(folder)
    metadata = read_metadata(folder)
    index = load_base(folder, metadata)
    apply_delta(index, *read_delta(folder, metadata))
    rerank = _rerank_vectors(folder, metadata) if metadata["kind"] == "ivfpq" else None
    return Searcher(index, metadata, rerank)


def load_base(folder: Path, metadata: dict[str, Any]) -> faiss.Index:
    """The base index file alone, checked against ``metadata`` (size, then SHA-256), set to its nprobe."""
    path = folder / metadata.get("index_file", INDEX_FILE)
    if not path.is_file() or path.stat().st_size != metadata.get("index_bytes"):
        raise ConfigError(f"--index: {path} is missing or not the file {folder / METADATA_FILE} describes "
                          f"({metadata.get('index_bytes')} bytes); build the index again")
    digest = file_sha256(path)
    if digest != metadata.get("index_sha256"):
        raise ConfigError(f"--index: {path} is not the file {folder / METADATA_FILE} describes (SHA-256 {digest[:12]}, "
                          f"expected {str(metadata.get('index_sha256'))[:12]}: changed, damaged or half rebuilt); "
                          "build the index again")
    try:
        index = faiss.read_index(str(path))
    except RuntimeError as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise ConfigError(f"--index: {path} is not a readable faiss index ({reason}); build the index again") from None
    if metadata.get("nprobe") is not None:
        faiss.extract_index_ivf(index).nprobe = metadata["nprobe"]
    return index


def _rerank_vectors(folder: Path, metadata: dict[str, Any]) -> PartVectors:
    """The catalogue's parts that an ``ivfpq`` index re-ranks with, refused when the folder now holds another
    embedding (another model, source, size or count): the codes would be re-ranked with vectors of other images."""
    vectors = PartVectors(metadata["catalogue"])
    held = vectors.manifest

    def described(model: Any, source: Any, dim: Any, count: Any) -> str:
        return (f"model {str(model.get('digest'))[:12]}, source {str((source or {}).get('digest'))[:12]}, "
                f"{count} vectors of dim {dim}")

    now = described(held["model"], held.get("source"), held["dim"], held["count"])
    then = described(metadata["model"], metadata["source"], metadata["dim"], metadata["count"])
    if now != then:
        raise ConfigError(f"--index: {folder / METADATA_FILE}: the catalogue {metadata['catalogue']} it re-ranks "
                          f"with now holds {now}, the index was built from {then}; build the index again from the "
                          "catalogue as it is")
    return vectors

"""The index grows and shrinks in place: a delta beside an untouched base file, merged at load; the drift check;
compaction; another model refused."""

from __future__ import annotations

import hashlib
import json

import faiss
import numpy as np
import pytest
from catalogue_fixtures import clustered, versioned_catalogue

from pksampler.train.catalogue import cli
from pksampler.train.catalogue.index import IndexOptions, load_index
from pksampler.train.catalogue.parts import PartVectors
from pksampler.train.catalogue.update import grow_index
from pksampler.train.errors import ConfigError


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _live(versions):
    """Every version's vectors by id, less the removed ids: what the index must hold."""
    vectors = np.concatenate([v for v, _ in versions])
    removed = {i for _, r in versions for i in r}
    ids = np.array([i for i in range(len(vectors)) if i not in removed])
    return vectors[ids], ids


def _check_exact(folder, versions, queries, k=10):
    """Searched over every list, the grown index returns the exact top-k of the live vectors, never a removed id."""
    searcher = load_index(folder)
    vectors, ids = _live(versions)
    assert searcher.index.ntotal == len(ids) == searcher.metadata["count"]
    if searcher.metadata["nlist"]:
        faiss.extract_index_ivf(searcher.index).nprobe = searcher.metadata["nlist"]
    _, found = searcher.search(queries, k)
    expected = ids[np.argsort(-(queries @ vectors.T), axis=1, kind="stable")[:, :k]]
    assert np.array_equal(np.sort(found, axis=1), np.sort(expected, axis=1))
    return searcher


def test_an_ivf_index_grows_and_shrinks_without_rewriting_its_base(tmp_path, capsys):
    dim, options = 16, IndexOptions(kind="ivfflat", nlist=16, queries=200)
    catalogue, out = tmp_path / "cat", tmp_path / "index"
    versions = [(clustered(3000, dim, classes=120, seed=1), [])]
    versioned_catalogue(catalogue, versions, part_size=1000)
    built = grow_index(catalogue, out, options=options)
    assert built["history"][-1]["how"] == "built" and built["drift"]["base_mean_sq_distance"] > 0
    base = _sha(out / "index.faiss")
    queries = clustered(20, dim, classes=120, seed=1)

    # week 2: 150 new vectors of the same products, three ids removed
    versions.append((clustered(150, dim, classes=120, seed=1)[::-1].copy() * 1, [5, 17, 2999]))
    versioned_catalogue(catalogue, versions, part_size=1000)
    meta = grow_index(catalogue, out, options=options)
    last = meta["history"][-1]
    assert (last["how"], last["added"], last["removed"], last["delta_added"], last["delta_removed"]) == \
        ("updated", 150, 3, 150, 3)
    assert _sha(out / "index.faiss") == base == meta["index_sha256"]  # the base file is not rewritten
    assert {d["file"] for d in meta["delta"].values()} == {p.name for p in out.glob("delta-*.npy")}
    assert not meta["last_drift"]["retrain"] and meta["last_drift"]["ratio"] < 1.2
    _check_exact(out, versions, queries)

    # week 3: vectors from elsewhere (uniform on the sphere, far from the catalogue's clusters); one of week 2's
    # ids removed again: it leaves the delta, not the base
    rng = np.random.default_rng(3)
    far = rng.standard_normal((600, dim)).astype(np.float32)
    versions.append((far / np.linalg.norm(far, axis=1, keepdims=True), [3001]))
    versioned_catalogue(catalogue, versions, part_size=1000)
    capsys.readouterr()
    assert cli.build_index_main([str(catalogue), "--out", str(out), "--kind", "ivfflat", "--nlist", "16",
                                "--compact-fraction", "0.5"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("[pksampler] index: updated to version 3") and "+600 vectors, -1 ids" in printed[0]
    assert "retrain the coarse quantizer" in printed[1] and "--rebuild" in printed[1], printed
    meta = json.loads((out / "index.json").read_text())
    assert meta["last_drift"]["retrain"] and meta["last_drift"]["ratio"] > 1.2
    assert (meta["history"][-1]["delta_added"], meta["history"][-1]["delta_removed"]) == (749, 3)
    _check_exact(out, versions, np.concatenate([queries, versions[-1][0][:5]]))

    # past the compaction share, the delta is merged into a new base file; the old files go
    versions.append((clustered(40, dim, classes=120, seed=4), [0, 1]))
    versioned_catalogue(catalogue, versions, part_size=1000)
    meta = grow_index(catalogue, out, options=IndexOptions(kind="ivfflat", queries=200, compact_fraction=0.05))
    assert meta["history"][-1]["how"] == "compacted" and meta["delta"] is None
    assert sorted(p.name for p in out.iterdir()) == ["centroids.npy", "index-0004.faiss", "index.json"]
    assert meta["base_count"] == meta["count"]
    _check_exact(out, versions, queries)
    assert grow_index(catalogue, out, options=options)["history"][-1]["how"] == "up to date"
    rebuilt = grow_index(catalogue, out, options=IndexOptions(kind="ivfflat", nlist=16, queries=200, rebuild=True))
    assert [h["how"] for h in rebuilt["history"]] == ["built"] and rebuilt["catalogue_version"] == 4
    _check_exact(out, versions, queries)


def test_the_ivfpq_rerank_reads_every_versions_parts(tmp_path):
    dim = 16
    versions = [(clustered(2000, dim, classes=80, seed=2), []), (clustered(120, dim, classes=80, seed=5), [7])]
    catalogue = versioned_catalogue(tmp_path / "cat", versions[:1], part_size=500)
    options = IndexOptions(kind="ivfpq", nlist=8, queries=200)
    grow_index(catalogue, tmp_path / "index", options=options)
    versioned_catalogue(catalogue, versions, part_size=500)
    assert grow_index(catalogue, tmp_path / "index", options=options)["history"][-1]["how"] == "updated"
    lookup = PartVectors(catalogue)
    assert np.array_equal(lookup(np.array([2000, 2119, 3, -1])),
                          np.stack([versions[1][0][0], versions[1][0][119], versions[0][0][3], np.zeros(dim)]))
    searcher = load_index(tmp_path / "index")
    faiss.extract_index_ivf(searcher.index).nprobe = 8
    _, found = searcher.search(versions[1][0][:20], 1)  # a week-2 vector finds itself, through the re-rank
    assert np.array_equal(found[:, 0], np.arange(2000, 2020))
    _, found = searcher.search(versions[0][0][7:8], 5)
    assert 7 not in found


def test_an_index_of_another_model_is_refused_not_updated(tmp_path, capsys):
    vectors = clustered(300, 8, classes=10)
    grow_index(versioned_catalogue(tmp_path / "a", [(vectors, [])], part_size=100), tmp_path / "index")
    other = versioned_catalogue(tmp_path / "b", [(vectors, [])], part_size=100, digest="e" * 64)
    with pytest.raises(ConfigError, match=r"^--out: .* holds the index of another model .* a new model means a new "
                                          r"index"):
        grow_index(other, tmp_path / "index")
    assert cli.build_index_main([str(other), "--out", str(tmp_path / "index")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "a new model means a new index" in err, err


def test_a_damaged_delta_is_one_line(tmp_path, capsys):
    versions = [(clustered(300, 8, classes=10), []), (clustered(20, 8, classes=10, seed=1), [4])]
    catalogue = versioned_catalogue(tmp_path / "cat", versions[:1], part_size=100)
    grow_index(catalogue, tmp_path / "index")
    versioned_catalogue(catalogue, versions, part_size=100)
    meta = grow_index(catalogue, tmp_path / "index")
    path = tmp_path / "index" / meta["delta"]["vectors"]["file"]
    path.write_bytes(path.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ConfigError, match=r"^--index: .*delta-0002-vectors.npy is missing or not the file .* build the "
                                          r"index again \(--rebuild\)"):
        load_index(tmp_path / "index")

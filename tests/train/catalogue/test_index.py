"""The catalogue's part plan and its faiss index: exact where it says exact, certified where approximate."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from catalogue_fixtures import clustered, fake_catalogue

from pksampler.train.catalogue.index import IndexOptions, build_index, load_index
from pksampler.train.catalogue.parts import PartPlan
from pksampler.train.errors import ConfigError


@pytest.mark.parametrize("world", range(1, 8))
def test_every_part_belongs_to_exactly_one_rank_and_parts_tile_the_ids(world):
    plan = PartPlan(103, 10)
    owned = sorted(p for rank in range(world) for p in plan.parts_of(rank, world))
    assert owned == list(range(plan.num_parts)) == list(range(11))
    covered = np.concatenate([np.arange(*plan.bounds(p)) for p in owned])
    assert np.array_equal(covered, np.arange(103))


def test_the_flat_index_is_exact_search_with_the_catalogue_ids(tmp_path):
    vectors = clustered(700, 16, classes=20)
    missing = (3, 250, 699)
    catalogue = fake_catalogue(tmp_path / "cat", vectors, part_size=128, missing=missing)
    meta = build_index(catalogue, tmp_path / "index", options=IndexOptions(queries=200))
    assert meta["kind"] == "flat" and meta["count"] == 697
    cert = meta["certificate"]
    assert cert["recall_at_1"] == 1.0 and cert["recall_at_10"] == 1.0 and cert["queries"] == 200
    searcher = load_index(tmp_path / "index")
    assert searcher.metadata == json.loads((tmp_path / "index" / "index.json").read_text())
    queries = clustered(5, 16, classes=20, seed=9)
    d, i = searcher.search(queries, 5)
    kept = np.array([j for j in range(700) if j not in missing])
    scores = queries @ vectors[kept].T
    expected = kept[np.argsort(-scores, axis=1, kind="stable")[:, :5]]
    assert np.array_equal(i, expected)
    assert np.allclose(d, np.take_along_axis(scores, np.argsort(-scores, axis=1)[:, :5], 1), atol=1e-5)
    assert not set(i.ravel()) & set(missing)


@pytest.mark.parametrize("kind", ["ivfflat", "ivfpq"])
def test_an_approximate_index_carries_a_certificate_it_meets(tmp_path, kind):
    vectors = clustered(6000, 32, classes=300, seed=1)
    catalogue = fake_catalogue(tmp_path / "cat", vectors, part_size=1000)
    meta = build_index(catalogue, tmp_path / "index", options=IndexOptions(kind=kind, nlist=32, queries=400))
    cert = meta["certificate"]
    assert meta["kind"] == kind and meta["nlist"] == 32 and meta["nprobe"] == cert["nprobe"]
    assert cert["queries"] == 200 and cert["tuning_queries"] == 200
    assert cert["recall_at_1"] >= 0.99 and cert["meets_target"] and cert["recall_at_10"] >= cert["recall_at_1"]
    if kind == "ivfpq":  # codes in memory, the vectors stay in the parts for the re-rank
        assert meta["index_bytes"] < vectors.nbytes / 2
    # the certificate is honest: recomputed here on other queries by brute force
    searcher = load_index(tmp_path / "index")
    queries = clustered(300, 32, classes=300, seed=1)  # new points around the same centres
    _, found = searcher.search(queries, 1)
    exact = np.argmax(queries @ vectors.T, axis=1)
    assert (found[:, 0] == exact).mean() >= 0.97


def test_ivfflat_lists_filled_in_place_hold_what_add_with_ids_puts_there(tmp_path):
    import faiss

    vectors = clustered(3000, 16, classes=100, seed=3)
    catalogue = fake_catalogue(tmp_path / "cat", vectors, part_size=700, missing=(5, 1500))
    build_index(catalogue, tmp_path / "index", options=IndexOptions(kind="ivfflat", nlist=16, queries=100))
    built = load_index(tmp_path / "index").index
    plain = faiss.IndexIVFFlat(faiss.IndexFlatIP(16), 16, 16, faiss.METRIC_INNER_PRODUCT)
    plain.quantizer.add(built.quantizer.reconstruct_n(0, 16))
    plain.is_trained = True
    kept = np.array([i for i in range(3000) if i not in (5, 1500)])
    plain.add_with_ids(vectors[kept], kept)
    assert built.ntotal == plain.ntotal == 2998
    for number in range(16):
        assert np.array_equal(faiss.rev_swig_ptr(built.invlists.get_ids(number), built.invlists.list_size(number)),
                              faiss.rev_swig_ptr(plain.invlists.get_ids(number), plain.invlists.list_size(number)))
    plain.nprobe = built.nprobe
    assert np.array_equal(built.search(vectors[:40], 5)[1], plain.search(vectors[:40], 5)[1])


def test_the_index_refuses_a_file_that_does_not_match_its_metadata(tmp_path):
    catalogue = fake_catalogue(tmp_path / "cat", clustered(50, 8, classes=5), part_size=20)
    build_index(catalogue, tmp_path / "index")
    path = tmp_path / "index" / "index.faiss"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ConfigError, match=r"index\.faiss is missing or not the file"):
        load_index(tmp_path / "index")
    with pytest.raises(ConfigError, match=r"--kind: 'hnsw' must be one of"):
        IndexOptions(kind="hnsw")
    with pytest.raises(ConfigError, match=r"no manifest\.json; embed the catalogue first"):
        build_index(tmp_path / "nothing", tmp_path / "index2")


def test_the_index_refuses_a_same_size_tampered_file_a_bad_description_and_a_path_outside(tmp_path):
    catalogue = fake_catalogue(tmp_path / "cat", clustered(50, 8, classes=5), part_size=20)
    meta = build_index(catalogue, tmp_path / "index")
    path, described = tmp_path / "index" / "index.faiss", tmp_path / "index" / "index.json"
    original = path.read_bytes()
    tampered = bytearray(original)
    tampered[-5] ^= 0xFF  # one vector changed: same size, another file
    path.write_bytes(bytes(tampered))
    with pytest.raises(ConfigError, match=r"^--index: .*index\.faiss is not the file .*index\.json describes "
                                          r"\(SHA-256 .*half rebuilt\)"):
        load_index(tmp_path / "index")
    path.write_bytes(b"XXXX" + original[4:])  # bad magic, digest recorded for it: faiss's own refusal, one line
    described.write_text(json.dumps({**meta, "index_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}))
    with pytest.raises(ConfigError, match=r"^--index: .*index\.faiss is not a readable faiss index"):
        load_index(tmp_path / "index")
    path.write_bytes(original)
    (tmp_path / "outside.faiss").write_bytes(original)
    for name in ("../outside.faiss", str(tmp_path / "outside.faiss"), "sub/index.faiss", ".."):
        described.write_text(json.dumps({**meta, "index_file": name}))
        with pytest.raises(ConfigError, match=r"index_file .* must be a plain file name inside"):
            load_index(tmp_path / "index")
    described.write_text("{bad")
    with pytest.raises(ConfigError, match=r"^--index: .*index\.json cannot be read \("):
        load_index(tmp_path / "index")
    described.write_text(json.dumps(meta))
    assert load_index(tmp_path / "index").metadata["count"] == 50


def test_a_manifest_count_that_disagrees_with_its_part_file_is_refused(tmp_path):
    catalogue = fake_catalogue(tmp_path / "cat", clustered(30, 8, classes=3), part_size=10)
    manifest = json.loads((catalogue / "manifest.json").read_text())
    manifest["parts"][1]["count"], manifest["count"] = 7, 27  # the part file holds 10 rows
    (catalogue / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"part-00001\.npy: must be float32 of shape \(7, 8\) as manifest\.json "
                                          r"says, got float32 \(10, 8\)"):
        build_index(catalogue, tmp_path / "index")
    manifest["count"] = 30  # totals that do not add up are refused before any part is read
    (catalogue / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"manifest\.json: count 30 must be the sum of the parts' counts \(27\)"):
        build_index(catalogue, tmp_path / "index")


def _broken(tmp_path, name):
    catalogue = fake_catalogue(tmp_path / name, clustered(24, 8, classes=3), part_size=10)
    return catalogue, json.loads((catalogue / "manifest.json").read_text())


def test_ordinary_bad_catalogues_and_outputs_are_one_line_naming_the_file_and_the_rule(tmp_path):
    catalogue, manifest = _broken(tmp_path, "missing")
    (catalogue / "embeddings" / "part-00001.npy").unlink()
    with pytest.raises(ConfigError, match=r"part 1 \(part-00001\.npy\) cannot be read as \.npy arrays"):
        build_index(catalogue, tmp_path / "index")

    catalogue, _ = _broken(tmp_path, "object")
    np.save(catalogue / "embeddings" / "part-00001.npy", np.array([object()] * 10, dtype=object), allow_pickle=True)
    with pytest.raises(ConfigError, match=r"part 1 \(part-00001\.npy\) cannot be read as \.npy arrays"):
        build_index(catalogue, tmp_path / "index")

    catalogue, _ = _broken(tmp_path, "dim")
    np.save(catalogue / "embeddings" / "part-00001.npy", np.zeros((10, 4), dtype=np.float32))
    with pytest.raises(ConfigError, match=r"part-00001\.npy: must be float32 of shape \(10, 8\) .* got float32 "
                                          r"\(10, 4\)"):
        build_index(catalogue, tmp_path / "index")

    catalogue, _ = _broken(tmp_path, "ids")
    np.save(catalogue / "ids" / "part-00002.npy", np.arange(4, dtype=np.int32))
    with pytest.raises(ConfigError, match=r"ids.part-00002\.npy: must be int64 of shape \(4,\) .* got int32"):
        build_index(catalogue, tmp_path / "index")

    for name, change, message in [
            ("noparts", lambda m: m.pop("parts"), r"parts is missing"),
            ("dimtext", lambda m: m.update(dim="abc"), r"dim must be a positive int, got 'abc'"),
            ("partsdict", lambda m: m.update(parts={}), r"parts must be a list, got dict"),
            ("entry", lambda m: m["parts"].__setitem__(0, {"part": 0}), r"parts\[0\] must hold int 'part' and 'count'")]:
        catalogue, manifest = _broken(tmp_path, name)
        change(manifest)
        (catalogue / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ConfigError, match=r"manifest\.json: " + message):
            build_index(catalogue, tmp_path / "index")

    catalogue, _ = _broken(tmp_path, "fine")
    with pytest.raises(ConfigError, match=r"^--kind: ivfpq needs at least 256 vectors .* holds 24; use --kind flat"):
        build_index(catalogue, tmp_path / "index", options=IndexOptions(kind="ivfpq"))
    (tmp_path / "a_file").write_text("")
    for out in (tmp_path / "a_file", tmp_path / "a_file" / "index"):
        with pytest.raises(ConfigError, match=r"^--out: '.*a_file.*' cannot be used as a folder"):
            build_index(catalogue, out)
    assert build_index(catalogue, tmp_path / "index")["count"] == 24

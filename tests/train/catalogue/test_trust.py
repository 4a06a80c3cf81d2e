"""The catalogue commands trust nothing they read: the source's listing, the parts, index.json, the disk, the store.

Each bad input is one line on stderr naming the argument or the file, the value and the rule (exit status 2),
never a traceback, never a wait without end.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from catalogue_fixtures import clustered, fake_catalogue, make_checkpoint, render_folder
from launch import ROOT

from pksampler.files import lock_exclusively
from pksampler.train.catalogue import cli, index as index_module
from pksampler.train.catalogue.embed import EmbedOptions, embed_catalogue
from pksampler.train.catalogue.index import IndexOptions, build_index
from pksampler.train.catalogue import parts as parts_module
from pksampler.train.errors import ConfigError
from pksampler.train.runtime.distributed import Backend


def _one_line(capsys, pattern: str) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(pattern, err), err
    return err


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """A real catalogue of PNG files, embedded in one process and indexed exactly."""
    folder = tmp_path_factory.mktemp("embedded")
    checkpoint = make_checkpoint(folder / "best.pt")
    data = render_folder(folder / "products", classes=3, per_class=4)
    embed_catalogue(checkpoint, str(data), folder / "catalogue", Backend(),
                    options=EmbedOptions(part_size=5, batch_size=4, workers=0))
    build_index(folder / "catalogue", folder / "index", options=IndexOptions(queries=12))
    return folder, checkpoint, data


def _query(folder, checkpoint, images, out, index="index"):
    return cli.query_main([*map(str, images), "--index", str(folder / index), "--checkpoint", str(checkpoint),
                           "--out", str(out), "--k", "3"])


# issue 51, item 1: the query names what was embedded, not the folder as it is now


def test_a_query_names_what_was_embedded_after_the_source_changed(embedded, tmp_path, capsys):
    folder, checkpoint, data = embedded
    scan = tmp_path / "scan.png"
    shutil.copy(data / "product_00001" / "00002.png", scan)
    assert _query(folder, checkpoint, [scan], tmp_path / "q0") == 0
    first = json.loads((tmp_path / "q0" / "results.jsonl").read_text())["results"][0]
    assert first["path"].endswith("product_00001/00002.png") and first["similarity"] == pytest.approx(1.0, abs=1e-5)

    added = data / "product_00000" / "00000a.png"  # sorts after 00000.png: every later position shifts by one
    shutil.copy(data / "product_00000" / "00000.png", added)
    removed = data / "product_00000" / "00003.png"
    kept = removed.read_bytes()
    removed.unlink()
    try:  # the item table names each id as embedded: the same file, the same id, whatever the folder holds now
        assert _query(folder, checkpoint, [scan], tmp_path / "q1") == 0
        again = json.loads((tmp_path / "q1" / "results.jsonl").read_text())["results"][0]
        assert (again["id"], again["path"], again["class"]) == (first["id"], first["path"], first["class"])
        # a catalogue embedded before item tables existed still names results by position: refused in one line
        legacy = tmp_path / "legacy"
        shutil.copytree(folder / "catalogue", legacy)
        manifest = json.loads((legacy / "manifest.json").read_text())
        for field in ("versions", "embedded", "next_id"):
            manifest.pop(field)
        (legacy / "manifest.json").write_text(json.dumps(manifest))
        build_index(legacy, tmp_path / "legacy-index", options=IndexOptions(queries=12))
        capsys.readouterr()
        assert _query(tmp_path, checkpoint, [scan], tmp_path / "q2", index="legacy-index") == 2
        _one_line(capsys, r"^error: --index: .*changed since it was embedded.*embed the catalogue again")
    finally:
        added.unlink()
        removed.write_bytes(kept)
    assert _query(tmp_path, checkpoint, [scan], tmp_path / "q3", index="legacy-index") == 0  # the listing as embedded


# issue 51, item 4: build_index.py checks every part against the manifest


def _catalogue(tmp_path, name="cat"):
    return fake_catalogue(tmp_path / name, clustered(30, 8, classes=3), part_size=10)


def _edit_manifest(catalogue, edit):
    manifest = json.loads((catalogue / "manifest.json").read_text())
    edit(manifest)
    (catalogue / "manifest.json").write_text(json.dumps(manifest))


def _edit_part(catalogue, part, *, embeddings=None, ids=None, record=None):
    name = f"part-{part:05d}"
    if embeddings is not None:
        vectors = np.load(catalogue / "embeddings" / f"{name}.npy")
        embeddings(vectors)
        np.save(catalogue / "embeddings" / f"{name}.npy", vectors)
    if ids is not None:
        values = np.load(catalogue / "ids" / f"{name}.npy")
        ids(values)
        np.save(catalogue / "ids" / f"{name}.npy", values)
    if record is not None:
        path = catalogue / "parts" / f"{name}.json"
        data = json.loads(path.read_text())
        record(data)
        path.write_text(json.dumps(data))


def _set(array, position, value):
    array[position] = value


def _dump_twice(manifest):
    manifest["parts"].append(dict(manifest["parts"][0]))
    manifest["count"] += manifest["parts"][0]["count"]


_CHANGED = r"{folder}/part-00001\.npy: its bytes are not the ones part-00001\.json records \(SHA-256\)"


def _link_to_part_0(catalogue, folder="embeddings"):
    path = catalogue / folder / "part-00001.npy"
    path.unlink()
    path.symlink_to(catalogue / folder / "part-00000.npy")


def _another_models_vectors(catalogue):
    other = clustered(30, 8, classes=3, seed=9)  # finite, unit length, the same shape
    np.save(catalogue / "embeddings" / "part-00001.npy", other[10:20])


def _leave_out_part_1(manifest):
    manifest["count"] -= manifest["parts"].pop(1)["count"]


PART_DAMAGE = {
    "nan": (lambda c: _edit_part(c, 1, embeddings=lambda v: _set(v, (3, 2), np.nan)),
            r"part-00001\.npy: holds NaN or infinite values"),
    "inf": (lambda c: _edit_part(c, 2, embeddings=lambda v: _set(v, (0, 0), np.inf)),
            r"part-00002\.npy: holds NaN or infinite values"),
    "id out of range": (lambda c: _edit_part(c, 0, ids=lambda v: _set(v, 9, 10**6)),
                        r"part-00000\.npy: ids must rise strictly within \[0, 10\).*got 1000000"),
    "id of another part": (lambda c: _edit_part(c, 1, ids=lambda v: _set(v, 0, 5)),
                           r"part-00001\.npy: ids must rise strictly within \[10, 20\)"),
    "unsorted ids": (lambda c: _edit_part(c, 2, ids=lambda v: v.__setitem__(slice(None), v[::-1].copy())),
                     r"part-00002\.npy: ids must rise strictly"),
    "part listed twice": (lambda c: _edit_manifest(c, _dump_twice), r"parts\[3\] repeats part 0"),
    "no model": (lambda c: _edit_manifest(c, lambda m: m.pop("model")), r"manifest\.json: model must be an object"),
    "another model": (lambda c: _edit_part(c, 1, record=lambda r: r.update(model_digest="e" * 64)),
                      r"part-00001\.json: embedded by another model \(digest eeeeeeeeeeee, the manifest's dddddddddddd\)"),
    # before: each of these was indexed, and certified, without a word
    "embeddings linked to another part": (_link_to_part_0, _CHANGED.format(folder="embeddings")),
    "ids linked to another part": (lambda c: _link_to_part_0(c, "ids"), r"part-00001\.npy: ids must rise strictly"),
    "another model's vectors of the same shape": (_another_models_vectors, _CHANGED.format(folder="embeddings")),
    "a record without the digests": (lambda c: _edit_part(c, 1, record=lambda r: r.pop("sha256")),
                                     r"part-00001\.json: records no SHA-256 of the part's arrays"),
    "a part left out of the manifest": (lambda c: _edit_manifest(c, _leave_out_part_1),
                                        r"manifest\.json: parts must list each of the plan's 3 parts \(30 ids in parts "
                                        r"of 10\) once, in order: part 1 is missing"),
    "a plan claiming more ids": (lambda c: _edit_manifest(c, lambda m: m["plan"].update(total=10**9)),
                                 r"manifest\.json: parts must list each of the plan's 100000000 parts .* part 3 is "
                                 r"missing"),
}


@pytest.mark.parametrize("damage", sorted(PART_DAMAGE))
def test_build_index_refuses_parts_that_are_not_what_the_manifest_says(tmp_path, capsys, damage):
    catalogue = _catalogue(tmp_path)
    edit, message = PART_DAMAGE[damage]
    edit(catalogue)
    assert cli.build_index_main([str(catalogue), "--out", str(tmp_path / "index")]) == 2
    _one_line(capsys, message)
    assert not (tmp_path / "index" / "index.faiss").exists()


def test_a_second_model_cannot_embed_into_an_out_that_a_running_job_holds(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "a.pt")
    other = make_checkpoint(tmp_path / "b.pt", seed=1)
    data = render_folder(tmp_path / "products", classes=2, per_class=3)
    out = tmp_path / "catalogue"
    out.mkdir()
    handle, _ = lock_exclusively(out / getattr(parts_module, "JOB_LOCK", "job.lock"), "model 0123456789ab, pid 999 on host-a")  # the first job, running
    try:
        with pytest.raises(ConfigError, match=r"^--out: .* is being embedded by another job \(model 0123456789ab, "
                                              r"pid 999 on host-a\); wait for it, or use another --out"):
            embed_catalogue(other, str(data), out, Backend(), options=EmbedOptions(part_size=4, workers=0))
    finally:
        handle.close()
    embed_catalogue(checkpoint, str(data), out, Backend(), options=EmbedOptions(part_size=4, workers=0))
    with pytest.raises(ConfigError, match=r"holds parts embedded by another model"):  # after it finished, as before
        embed_catalogue(other, str(data), out, Backend(), options=EmbedOptions(part_size=4, workers=0))


# issue 51, item 5: one line where a traceback was


def test_damaged_index_metadata_is_one_line(embedded, tmp_path, capsys):
    folder, checkpoint, data = embedded
    scan = data / "product_00000" / "00001.png"
    cases = {"model": (lambda m: m.pop("model"), r"index\.json: model must be .*got None"),
             "nprobe on flat": (lambda m: m.update(nprobe=4), r"index\.json: nprobe 4 is given for a flat index"),
             "count": (lambda m: m.update(count="12"), r"index\.json: count must be a positive int, got '12'")}
    for name, (edit, message) in cases.items():
        copy = tmp_path / name.replace(" ", "_")
        shutil.copytree(folder / "index", copy)
        metadata = json.loads((copy / "index.json").read_text())
        edit(metadata)
        (copy / "index.json").write_text(json.dumps(metadata))
        assert cli.query_main([str(scan), "--index", str(copy), "--checkpoint", str(checkpoint),
                               "--out", str(tmp_path / "q")]) == 2, name
        _one_line(capsys, message)


def test_an_unknown_precision_or_device_is_one_line(tmp_path, capsys):
    checkpoint = make_checkpoint(tmp_path / "best.pt")
    data = render_folder(tmp_path / "products", classes=2, per_class=2)
    for option, value in (("--precision", "fp8"), ("--device", "tpu")):
        argv = ["--checkpoint", str(checkpoint), "--data", str(data), "--out", str(tmp_path / "c"), option, value]
        assert cli.embed_main(argv) == 2
        _one_line(capsys, rf"^error: {option}: '{value}' must be one of ")


def _full_disk(monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr("pksampler.files.os.fsync", no_space)


def test_a_full_disk_names_the_option_and_the_file(tmp_path, capsys, monkeypatch):
    checkpoint = make_checkpoint(tmp_path / "best.pt")
    data = render_folder(tmp_path / "products", classes=2, per_class=2)
    catalogue = _catalogue(tmp_path)
    with monkeypatch.context() as patch:
        _full_disk(patch)
        assert cli.embed_main(["--checkpoint", str(checkpoint), "--data", str(data), "--out", str(tmp_path / "c"),
                               "--workers", "0"]) == 2
        _one_line(capsys, r"^error: --out: cannot write .*c/embeddings/part-00000\.npy: \[Errno 28\] No space left")
        assert cli.build_index_main([str(catalogue), "--out", str(tmp_path / "i")]) == 2
        _one_line(capsys, r"^error: --out: cannot write .*i/index\.faiss: \[Errno 28\] No space left")
    assert not list((tmp_path / "c" / "embeddings").iterdir())  # no half-written file is left


# issue 51, item 6: every wait is bounded and names the command's own option


def test_a_manifest_claiming_more_vectors_than_its_parts_hold_is_refused_before_any_sampling(tmp_path, capsys,
                                                                                               monkeypatch):
    catalogue = _catalogue(tmp_path)

    def huge(manifest):
        manifest["parts"][0]["count"] = 10**12
        manifest["count"] = sum(e["count"] for e in manifest["parts"])
    _edit_manifest(catalogue, huge)
    monkeypatch.setattr(index_module, "_rows", lambda *a, **k: pytest.fail("sampled before checking the parts"))
    assert cli.build_index_main([str(catalogue), "--out", str(tmp_path / "i"), "--kind", "ivfflat"]) == 2
    _one_line(capsys, r"part-00000\.npy: must be float32 of shape \(1000000000000, 8\)")


def test_a_fifo_in_place_of_a_part_is_refused_not_waited_on(tmp_path):
    catalogue = _catalogue(tmp_path)
    part = catalogue / "embeddings" / "part-00001.npy"
    part.unlink()
    os.mkfifo(part)
    result = subprocess.run([sys.executable, str(ROOT / "train" / "build_index.py"), str(catalogue), "--out",
                             str(tmp_path / "i")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert re.fullmatch(r"error: .*part-00001\.npy is a FIFO, not a regular file.*\n", result.stderr), result.stderr


@pytest.fixture
def silent_store():
    """A TCP port that accepts connections and never answers: an object store that hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    server.close()


def test_a_store_that_never_answers_fails_within_the_commands_own_bound(tmp_path, capsys, monkeypatch, silent_store):
    checkpoint = make_checkpoint(tmp_path / "best.pt")
    for name, value in (("AWS_ENDPOINT_URL", silent_store), ("AWS_ACCESS_KEY_ID", "k"),
                        ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    assert cli.embed_main(["--checkpoint", str(checkpoint), "--data", "s3://bucket/pack", "--out",
                           str(tmp_path / "c"), "--outage-seconds", "2"]) == 2
    err = _one_line(capsys, r"^error: --data: s3://bucket/pack/manifest\.json: .*--outage-seconds 2")
    assert "data.args" not in err
    assert time.monotonic() - started < 60  # a bound, not a measurement: the store gave no answer at all


@pytest.mark.parametrize(("text", "reason"), [
    # obstore's text for a store that accepted and never answered: the elapsed time may hold "404" or "403"
    ("Generic S3 error: Error performing GET http://127.0.0.1:40443/bucket/pack/manifest.json in 2.404403877s - "
     "HTTP error: error sending request ... elapsed: 2.404403877s, retry_timeout: 2s", "the store did not answer"),
    ("Generic S3 error: Error performing GET http://127.0.0.1:9000/bucket/pack/manifest.json: status code: 404 "
     "Not Found", "no such object or bucket"),
    ("Generic S3 error: ... <Code>AccessDenied</Code>", "access denied"),
    # the request's address holds the key: images filed by class id put a status-like number in it
    ("Generic S3 error: Error performing GET http://127.0.0.1:40443/bucket/pack/train/404/0001.jpg in 2.1s - "
     "HTTP error: error sending request", "the store did not answer"),
    ("Generic S3 error: Error performing PUT http://127.0.0.1:40443/bucket/pack/403/x.json in 2.1s - "
     "HTTP error: error sending request", "the store did not answer"),
    ("Generic S3 error: Error performing GET http://127.0.0.1:9000/bucket/pack/404/manifest.json - Client error "
     "with status 404 Not Found: <Code>NoSuchKey</Code>", "no such object or bucket"),
])
def test_an_http_status_is_read_as_a_word_not_as_digits_inside_a_duration(text, reason):
    from pksampler.datasets.objectstore import ObjectStore

    class GenericError(Exception):
        pass

    error = ObjectStore("s3://bucket/pack")._fail("manifest.json", GenericError(text))
    assert str(error).startswith(f"s3://bucket/pack/manifest.json: {reason}"), str(error)


# issue 51, item 12: the scripts' usage lines are commands


@pytest.mark.parametrize("script", ["export_model.py", "embed_catalogue.py", "build_index.py", "query_catalogue.py",
                                    "retrieval.py"])
def test_each_scripts_usage_block_holds_commands_that_run_it(script):
    import ast

    doc = ast.get_docstring(ast.parse((ROOT / "train" / script).read_text(encoding="utf-8")))
    usage = doc.split("Usage::", 1)[1].split("\n\n")[1]
    for line in usage.splitlines():
        assert re.match(rf"^    (horovodrun .*?python |torchrun .*?|python (-m torch\.distributed\.launch .*?)?)train/{re.escape(script)}( |$)", line), line


def test_records_of_another_model_written_while_a_job_ran_stop_it_before_the_manifest(tmp_path, monkeypatch):
    from pksampler.train.catalogue import embed as embed_module

    checkpoint = make_checkpoint(tmp_path / "best.pt")
    data = render_folder(tmp_path / "products", classes=2, per_class=3)
    write = embed_module.write_part

    def then_another_host_writes(out, part, embeddings, ids, record):  # a job on another host shares the folder
        write(out, part, embeddings, ids, {**record, "model_digest": "e" * 64} if part == 1 else record)
    monkeypatch.setattr(embed_module, "write_part", then_another_host_writes)
    with pytest.raises(ConfigError, match=r"^--out: parts \[1\] of .* were embedded by another model \(digest "
                                          r"eeeeeeeeeeee, this job's [0-9a-f]{12}\) while this job ran"):
        embed_catalogue(checkpoint, str(data), tmp_path / "c", Backend(), options=EmbedOptions(part_size=4, workers=0))
    assert not (tmp_path / "c" / "manifest.json").exists()


# issue 50, item 4 (its first rule): a new model means a new index


def test_build_index_refuses_an_out_holding_the_index_of_another_model(tmp_path, capsys):
    catalogue = _catalogue(tmp_path)
    assert cli.build_index_main([str(catalogue), "--out", str(tmp_path / "index")]) == 0
    assert cli.build_index_main([str(catalogue), "--out", str(tmp_path / "index")]) == 0  # the same model: rebuilt
    capsys.readouterr()
    before = (tmp_path / "index" / "index.faiss").read_bytes()
    other = fake_catalogue(tmp_path / "other", clustered(30, 8, classes=3, seed=4), part_size=10)
    _edit_manifest(other, lambda m: m["model"].update(digest="f" * 64))
    for part in range(3):
        _edit_part(other, part, record=lambda r: r.update(model_digest="f" * 64))
    assert cli.build_index_main([str(other), "--out", str(tmp_path / "index")]) == 2
    _one_line(capsys, r"^error: --out: .*index holds the index of another model \(digest dddddddddddd, this "
                      r"catalogue's ffffffffffff\); a new model means a new index: use another --out, or delete it")
    assert (tmp_path / "index" / "index.faiss").read_bytes() == before


# the embed job's lock file: a killed job's is taken over, a planted one is refused and never written through


def _plant(out, kind, victim):
    lock = out / parts_module.JOB_LOCK
    if kind == "symbolic link":
        os.symlink(victim, lock)
    elif kind == "FIFO":
        os.mkfifo(lock)
    else:
        lock.mkdir()


@pytest.mark.parametrize("kind", ["symbolic link", "FIFO", "folder"])
def test_a_lock_file_planted_as_a_link_fifo_or_folder_is_refused_in_one_line(tmp_path, capsys, kind):
    """Before: a link was followed and the file it named was truncated and overwritten with the job's line; a FIFO
    or a folder was a line naming neither --out nor the lock ('File or stream is not seekable', '[Errno 21]')."""
    checkpoint = make_checkpoint(tmp_path / "a.pt")
    data = render_folder(tmp_path / "products", classes=2, per_class=2)
    out, victim = tmp_path / "catalogue", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious\n")
    _plant(out, kind, victim)
    argv = ["--checkpoint", str(checkpoint), "--data", str(data), "--out", str(out), "--part-size", "4",
            "--workers", "0"]
    assert cli.embed_main(argv) == 2
    _one_line(capsys, rf"^error: --out: .*\.embed\.lock is a {kind}, not a regular file: it cannot be used as a "
                      r"lock file; remove it$")
    assert victim.read_text() == "precious\n" and not (out / "manifest.json").exists()


def test_a_lock_file_left_by_a_killed_job_does_not_stop_the_next_one(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "a.pt")
    data = render_folder(tmp_path / "products", classes=2, per_class=2)
    out = tmp_path / "catalogue"
    out.mkdir()
    (out / parts_module.JOB_LOCK).write_text("model 0123456789ab, pid 999999 on a-host-that-died\n")  # no flock
    manifest = embed_catalogue(checkpoint, str(data), out, Backend(), options=EmbedOptions(part_size=3, workers=0))
    assert manifest["count"] == 4
    assert (out / parts_module.JOB_LOCK).read_text().startswith(f"model {manifest['model']['digest'][:12]}, pid ")


def test_a_part_damaged_after_embedding_is_refused_by_the_index_and_the_rerun_and_a_new_out_mends_it(tmp_path, capsys):
    """Before: a rerun skipped the damaged part (its record still matched) and said nothing. A finished version is
    not embedded again in place (its ids name the items of its day): both commands name the part, the rerun names
    --out, and embedding into a new --out gives a catalogue the index takes."""
    checkpoint = make_checkpoint(tmp_path / "a.pt")
    data = render_folder(tmp_path / "products", classes=2, per_class=3)
    out, options = tmp_path / "catalogue", EmbedOptions(part_size=3, workers=0)
    embed_catalogue(checkpoint, str(data), out, Backend(), options=options)
    path = out / "embeddings" / "part-00001.npy"
    good = np.load(path)
    np.save(path, -good)  # finite, unit length, the right shape: only the bytes tell
    assert cli.build_index_main([str(out), "--out", str(tmp_path / "index")]) == 2
    _one_line(capsys, r"part-00001\.npy: its bytes are not the ones part-00001\.json records.*new --out")
    assert cli.embed_main(["--checkpoint", str(checkpoint), "--data", str(data), "--out", str(out),
                           "--part-size", "3", "--workers", "0"]) == 2
    _one_line(capsys, r"^error: --out: .*part-00001\.npy: its bytes are not .*embed the source into a new --out")
    fresh = tmp_path / "catalogue2"
    embed_catalogue(checkpoint, str(data), fresh, Backend(), options=options)
    assert np.array_equal(np.load(fresh / "embeddings" / "part-00001.npy"), good)
    assert cli.build_index_main([str(fresh), "--out", str(tmp_path / "index")]) == 0


def test_an_ivfpq_index_refuses_a_catalogue_embedded_again_by_another_model_under_it(tmp_path):
    """Before: its exact re-rank read the new model's vectors for the old ids and returned other images (a
    catalogue vector's own id at rank 1: 1.0 before, 0.0 after) without a word."""
    vectors = clustered(600, 8, classes=6)
    catalogue = fake_catalogue(tmp_path / "cat", vectors, part_size=200)
    build_index(catalogue, tmp_path / "index", options=IndexOptions(kind="ivfpq", queries=50, pq_bytes=2))
    _, found = index_module.load_index(tmp_path / "index").search(vectors[:20], 1)
    assert (found[:, 0] == np.arange(20)).all()
    shutil.rmtree(catalogue)
    fake_catalogue(catalogue, clustered(600, 8, classes=6, seed=7), part_size=200)
    _edit_manifest(catalogue, lambda m: m["model"].update(digest="f" * 64))
    with pytest.raises(ConfigError, match=r"^--index: .*index\.json: the catalogue .*/cat it re-ranks with now holds "
                                          r"model ffffffffffff, .* the index was built from model dddddddddddd, .*; "
                                          r"build the index again"):
        index_module.load_index(tmp_path / "index")

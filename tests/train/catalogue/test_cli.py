"""The catalogue command lines: one line per error, from the rank that hit it, never a traceback for bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from catalogue_fixtures import clustered, fake_catalogue
from thread_ranks import on_ranks

from pksampler.agree import gather_outcomes
from pksampler.train.catalogue import cli
from pksampler.train.catalogue.embed import _setup_outcome
from pksampler.train.errors import ConfigError, SharedConfigError


def _outcomes(errors):
    """What each rank raises once the set-up outcomes of every rank are gathered (ranks as threads)."""
    return on_ranks(len(errors), lambda ranks: _setup_outcome(gather_outcomes(ranks, errors[ranks.rank]), ranks.rank,
                                                              errors[ranks.rank]))


def test_a_set_up_error_of_one_rank_stops_every_rank_and_is_shown_by_that_rank():
    missing = ConfigError("--data: '/data/d1' is neither a folder, a list file nor an s3:// location")
    outcomes = _outcomes([None, missing, None])
    assert all(isinstance(o, ConfigError) for o in outcomes)  # nobody goes on into a collective
    assert outcomes[1] is missing  # rank 1 shows its own line
    assert str(outcomes[0]).startswith("stopped: rank(s) [1] hit bad input")
    assert isinstance(outcomes[0], SharedConfigError) and isinstance(outcomes[2], SharedConfigError)  # rank 0 says it

    same = [ConfigError("--part-size: must be a positive int, got 0") for _ in range(3)]
    outcomes = _outcomes(same)
    assert [isinstance(o, SharedConfigError) for o in outcomes] == [False, True, True]  # once, by rank 0
    assert [str(o) for o in outcomes] == [str(e) for e in same]
    assert _outcomes([None, None]) == [None, None]


def _run_as(monkeypatch, rank, error):
    monkeypatch.setattr(cli, "_rank", lambda: rank)
    monkeypatch.setattr(cli.time, "sleep", lambda seconds: pytest.fail("a rank-local error must not wait"))

    def step():
        raise error
    return cli._run(step)


def test_a_rank_local_error_is_one_line_from_that_rank_and_a_stopped_peer_says_so(monkeypatch, capsys):
    assert _run_as(monkeypatch, 1, ConfigError("--data: '/data/d1' does not exist")) == 2
    assert capsys.readouterr().err.splitlines() == ["error: rank 1: --data: '/data/d1' does not exist"]

    class HorovodInternalError(RuntimeError):  # what horovod raises in a collective whose peer exited
        pass

    assert _run_as(monkeypatch, 0, HorovodInternalError("Horovod has been shut down.")) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["[pksampler] rank 0: stopped: a collective failed because another rank stopped "
                                "(HorovodInternalError); that rank's error is above"], err
    assert _run_as(monkeypatch, 0, NotADirectoryError(20, "Not a directory", "/x/a_file")) == 2
    assert capsys.readouterr().err.splitlines() == ["error: [Errno 20] Not a directory: '/x/a_file'"]


def test_the_build_and_query_commands_print_one_line_for_bad_catalogues_and_indexes(tmp_path, capsys):
    catalogue = fake_catalogue(tmp_path / "cat", clustered(24, 8, classes=3), part_size=10)
    (tmp_path / "a_file").write_text("")
    cases = [
        ([str(catalogue), "--out", str(tmp_path / "a_file")], r"^error: --out: '.*a_file' cannot be used as a folder"),
        ([str(catalogue), "--out", str(tmp_path / "i"), "--kind", "ivfpq"], r"^error: --kind: ivfpq needs at least 256"),
    ]
    for argv, message in cases:
        assert cli.build_index_main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert __import__("re").match(message, err), err
    assert cli.build_index_main([str(catalogue), "--out", str(tmp_path / "index")]) == 0
    capsys.readouterr()
    (tmp_path / "index" / "index.json").write_text("{bad")
    from pksampler.train.catalogue.index import load_index

    with pytest.raises(ConfigError, match=r"index\.json cannot be read"):
        load_index(tmp_path / "index")
    manifest = json.loads((catalogue / "manifest.json").read_text())
    manifest["dim"] = "abc"
    (catalogue / "manifest.json").write_text(json.dumps(manifest))
    assert cli.build_index_main([str(catalogue), "--out", str(tmp_path / "index2")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {catalogue / 'manifest.json'}: dim must be a positive int, got 'abc'; embed "
                                "the catalogue again (train/embed_catalogue.py)"], err


def test_the_query_command_refuses_an_out_that_is_a_file_before_any_work(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    argv = [str(tmp_path / "q.png"), "--index", str(tmp_path / "no_index"), "--checkpoint", str(tmp_path / "no.pt"),
            "--out", str(tmp_path / "a_file")]
    assert cli.query_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: --out: ") and "cannot be used as a folder" in err, err


def test_embed_takes_the_legacy_launchers_local_rank_in_both_spellings(tmp_path, monkeypatch, capsys):
    """``python -m torch.distributed.launch`` passes ``--local-rank=N``; it must agree with LOCAL_RANK."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    base = ["--checkpoint", str(tmp_path / "none.pt"), "--data", str(tmp_path), "--out", str(tmp_path / "out")]
    assert cli.embed_main([*base, "--local-rank=0"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --local-rank=0 disagrees with the environment variable "
                                               "LOCAL_RANK='1': the launcher gives every process one local rank; "
                                               "pass one of them, or the same value")
    monkeypatch.delenv("LOCAL_RANK")
    assert cli.embed_main([*base, "--local_rank", "0"]) == 2  # accepted; then the missing checkpoint is the error
    err = capsys.readouterr().err
    assert "none.pt" in err and "local" not in err and len(err.strip().splitlines()) == 1
    assert cli.os.environ["LOCAL_RANK"] == "0"
    monkeypatch.delenv("LOCAL_RANK")

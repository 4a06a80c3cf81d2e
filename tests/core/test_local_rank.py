"""The legacy launcher's --local-rank argument: both spellings accepted, one value with LOCAL_RANK."""

from __future__ import annotations

import argparse

import pytest

from pksampler.comm import add_local_rank_argument, adopt_local_rank, launcher_world


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser()
    add_local_rank_argument(made)
    return made


@pytest.mark.parametrize("argv, expected", [
    ([], None), (["--local-rank=1"], 1), (["--local_rank", "1"], 1), (["--local_rank=0"], 0), (["--local-rank", "3"], 3),
])
def test_both_spellings_parse(argv, expected):
    assert parser().parse_args(argv).local_rank == expected


def test_the_argument_sets_local_rank_and_so_the_device_choice():
    environ = {"RANK": "3", "WORLD_SIZE": "4"}
    adopt_local_rank(1, environ)
    assert environ["LOCAL_RANK"] == "1" and launcher_world(environ) == (3, 4, 1)
    adopt_local_rank(1, environ)  # agreeing with the variable: nothing to say
    adopt_local_rank(None, environ)
    assert environ["LOCAL_RANK"] == "1"


def test_disagreement_and_negative_values_are_named():
    with pytest.raises(ValueError, match=r"--local-rank=0 disagrees with the environment variable LOCAL_RANK='1'"):
        adopt_local_rank(0, {"LOCAL_RANK": "1"})
    with pytest.raises(ValueError, match=r"--local-rank=-1: must be an integer >= 0"):
        adopt_local_rank(-1, {})


@pytest.mark.parametrize("environ, key", [
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0"}, "HOROVOD_LOCAL_RANK"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
     "OMPI_COMM_WORLD_LOCAL_RANK"),
])
def test_the_argument_must_agree_with_any_launchers_local_rank(environ, key):
    """Under horovodrun the GPU comes from Horovod's local rank: a different --local-rank would be silently ignored."""
    with pytest.raises(ValueError, match=rf"--local-rank=1 disagrees with the environment variable {key}='0'"):
        adopt_local_rank(1, dict(environ))
    agreeing = {**environ, key: "1"}
    adopt_local_rank(1, agreeing)
    assert launcher_world(agreeing)[2] == 1


def test_local_rank_is_compared_as_a_number_and_a_non_number_is_named():
    environ = {"LOCAL_RANK": "01"}
    adopt_local_rank(1, environ)  # the same rank, written with a leading zero
    assert environ["LOCAL_RANK"] == "01"
    with pytest.raises(ValueError, match=r"--local-rank=0 disagrees with the environment variable LOCAL_RANK='x'"):
        adopt_local_rank(0, {"LOCAL_RANK": "x"})


def test_two_different_values_are_a_usage_error_and_a_repeat_of_one_is_not(capsys):
    assert parser().parse_args(["--local-rank=1", "--local_rank", "1"]).local_rank == 1
    with pytest.raises(SystemExit) as stopped:
        parser().parse_args(["--local-rank=0", "--local_rank", "1"])
    assert stopped.value.code == 2
    assert "--local_rank=1: --local-rank was already given as 0; a process has one local rank" in capsys.readouterr().err

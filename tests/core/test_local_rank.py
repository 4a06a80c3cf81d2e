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

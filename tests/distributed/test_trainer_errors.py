"""The trainer's errors under real launchers: bad configs, disagreeing ranks, a raising or dying rank.

Each job ends in its first seconds, so the file is many short launches; every case expects one clear line from
rank 0 and no rank's traceback (tests/distributed/test_trainer.py has the runs that train).
"""

from __future__ import annotations

import pytest
from launch import LAUNCHERS, launch, rank_tracebacks
from trainer_runs import HOOKED, SCRIPT, write_config

pytestmark = pytest.mark.horovod


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_bad_config_key_reported_once_by_rank_zero(tmp_path, launcher):
    config = write_config(tmp_path, "bad", train__epochz=3)
    result = launch(launcher, SCRIPT, "--config", str(config))
    assert result.returncode != 0
    assert result.stdout.count("unknown config key train.'epochz'") == 1, result.stdout[-3000:]
    assert rank_tracebacks(result.stdout) == 0, result.stdout[-3000:]


def test_config_errors_give_one_line_and_status_two_every_time(tmp_path):
    # 8 launches, each case under both launchers: the rank-0 line must never be lost when the launcher tears the
    # job down.
    cases = [("--set", "sampler.classes_per_step=two"), ("--set", "optim.lr=.inf"), ("--set", "train.epochs=[1"),
             ("--set", f"workspace={tmp_path / 'file.txt'}")]
    (tmp_path / "file.txt").write_text("a file, not a folder")
    config = write_config(tmp_path, "run")
    for repeat in range(2 * len(cases)):
        args = cases[repeat // 2]
        result = launch("torchrun" if repeat % 2 else "horovodrun", SCRIPT, "--config", str(config), *args)
        errors = [line for line in result.stdout.splitlines() if "error:" in line]
        assert len(errors) == 1 and rank_tracebacks(result.stdout) == 0, (args, result.stdout[-3000:])
        assert result.returncode != 0, result.stdout[-2000:]


def test_more_ranks_than_classes_per_step_are_refused_once(tmp_path):
    result = launch("horovodrun", SCRIPT, "--set", f"workspace={tmp_path / 'ws'}", "--set", "train.epochs=1",
                    "--set", "sampler.classes_per_step=2", np=3, timeout=180)
    assert result.returncode != 0
    message = ("sampler.classes_per_step=2 cannot be split over 3 ranks: every rank needs at least one per step, "
               "so the world size must be at most 2")
    assert result.stdout.count(message) == 1 and rank_tracebacks(result.stdout) == 0, result.stdout[-3000:]


@pytest.mark.parametrize("key, value", [("train.max_steps", "3"), ("train.gather_embeddings", "false"),
                                        ("optim.lr", "0.01")])
def test_ranks_that_disagree_stop_with_the_same_error_on_both(tmp_path, key, value):
    config = write_config(tmp_path, "run")
    # A hang would last until Gloo's 180 s timeout; the launch's 150 s limit fails the test first (no timing compared).
    result = launch("horovodrun", HOOKED, "--config", str(config), env={"PKSAMPLER_TEST_RANK_SET": f"1:{key}={value}"},
                    timeout=150)
    assert result.returncode != 0
    assert result.stdout.count(f"ranks disagree on {key}") == 1, result.stdout[-3000:]


def test_an_unexpected_exception_shows_one_traceback(tmp_path):
    config = write_config(tmp_path, "raise")
    result = launch("horovodrun", HOOKED, "--config", str(config), env={"PKSAMPLER_TEST_RAISE": "2"}, timeout=120)
    assert result.returncode != 0
    assert result.stdout.count("RuntimeError: unexpected failure injected at step 2") >= 1
    assert rank_tracebacks(result.stdout) == 1, result.stdout[-3000:]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_dying_rank_ends_the_job_quickly(tmp_path, launcher):
    # The survivor would otherwise wait in a collective until its timeout (Gloo 180 s, torchrun's
    # train.collective_timeout, set past the launch limit here): the launch's 150 s limit fails the test first.
    config = write_config(tmp_path, "crash", train__epochs=50, train__collective_timeout=600)
    result = launch(launcher, HOOKED, "--config", str(config), env={"PKSAMPLER_TEST_CRASH": "1:3"}, timeout=150)
    assert result.returncode != 0
    assert "simulated crash at step 3" in result.stdout

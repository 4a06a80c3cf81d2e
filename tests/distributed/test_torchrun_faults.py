"""torchrun faults end the job: a rank that stops responding (named), and a launcher killed with SIGKILL."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from launch import ROOT, end_launch, launch, launch_command, run_launcher, spawn

pytestmark = pytest.mark.horovod
HOOKED = ROOT / "tests" / "distributed" / "train_with_test_hooks.py"


def write_config(tmp_path: Path, **train) -> Path:
    config = {
        "seed": 3, "workspace": str(tmp_path / "run"),
        "data": {"args": {"num_classes": 24, "images_per_class": 6, "image_size": 32}, "image_size": 24, "workers": 0},
        "sampler": {"classes_per_step": 4, "samples_per_class": 3},
        "model": {"width": 8, "depth": [1, 1], "embedding_dim": 16},
        "loss": {"name": "batch_hard"}, "optim": {"lr": 0.003, "base_batch": 12},
        "train": {"epochs": 2, "eval_every": 1, "tensorboard": False, **train},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_frozen_rank_ends_the_job_after_the_collective_timeout_naming_it(tmp_path):
    config = write_config(tmp_path, collective_timeout=15)
    result = launch("torchrun", HOOKED, "--config", str(config), env={"PKSAMPLER_TEST_FREEZE": "1:2"}, timeout=280)
    assert result.returncode != 0, result.stdout[-3000:]
    assert ("error: rank 0: a collective waited longer than train.collective_timeout=15 s for the other ranks; "
            "rank(s) [1] stopped responding") in result.stdout, result.stdout[-3000:]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_ranks_exit_when_the_torchrun_launcher_is_killed(tmp_path):
    config = write_config(tmp_path, epochs=200)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PKSAMPLER_TEST_PIDS": str(pids)}
    agent = spawn(launch_command("torchrun", HOOKED, "--config", str(config)), kind="torchrun", cwd=ROOT, env=env,
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while len(list(pids.glob("*.pid"))) < 2 and time.monotonic() < deadline and agent.poll() is None:
            time.sleep(1)
        ranks = [int(p.read_text()) for p in pids.glob("*.pid") if p.read_text()]
        assert len(ranks) == 2, "the ranks did not start"
        agent.kill()  # SIGKILL: the agent cannot stop its workers
        agent.wait()
        deadline = time.monotonic() + 60
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(1)
        assert not any(alive(pid) for pid in ranks), "ranks still training after their launcher died"
    finally:
        end_launch(agent)  # the ranks too: they run in sessions of their own


def test_a_relaunch_never_reads_the_previous_launchs_process_group_keys():
    # torchrun's agent store (shared with the workers by default) kept the last launch's gloo addresses under
    # fixed keys: a relaunched rank that arrived before its peer read the stale address and either failed
    # ("connection refused", a restart lost) or waited, with its peer, for the whole collective timeout.
    # Here rank 1 fails after one collective, and in the relaunch rank 0 arrives last, on purpose.
    script = ROOT / "tests" / "distributed" / "torch_restart.py"
    command = launch_command("torchrun", script)
    command[command.index("--nproc_per_node"):command.index("--nproc_per_node")] = ["--max-restarts", "1"]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}  # as a user runs it
    done = run_launcher(command, kind="torchrun", env={**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                        timeout=240)
    output = done.stdout
    assert done.returncode == 0, output[-4000:]
    # two ranks share the pipe: under PYTHONUNBUFFERED a line and its newline are separate writes, so find them
    assert sorted(re.findall(r"\[restart-test\] attempt 1 rank \d+ sum \d+", output)) == [
        "[restart-test] attempt 1 rank 0 sum 3", "[restart-test] attempt 1 rank 1 sum 3"], output[-4000:]


@pytest.mark.parametrize("share", ["0", "1"])
def test_torchrun_sets_up_with_the_agents_store_shared_or_not(share, tmp_path):
    # With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 nothing listens at MASTER_PORT until rank 0's env:// store does;
    # every rank waited 180 s per try on the agent's store there (more than 4 minutes), then died with C++ traces.
    script = ROOT / "tests" / "distributed" / "torch_init_allreduce.py"
    command = [*launch_command("torchrun", script)[:3], "--standalone", "--nproc-per-node", "2", "--max-restarts",
               "0", str(script)]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": share, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "torchrun.log"
    with log.open("w") as sink:  # a file, not a pipe: a rank outliving the launcher cannot hold the test open
        process = spawn(command, kind="torchrun", cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        process.wait(timeout=180)
    except subprocess.TimeoutExpired:
        pass
    finally:
        end_launch(process)  # a hung launcher and its ranks
    output = log.read_text(errors="replace")
    if process.returncode is None or process.returncode < 0:
        pytest.fail(f"torchrun (TORCH_DISABLE_SHARE_RDZV_TCP_STORE={share}) hung for 180 s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    assert sorted(re.findall(r"\[init-test\] rank \d+ of \d+ sum \d+", output)) == [  # lines may interleave
        "[init-test] rank 0 of 2 sum 3", "[init-test] rank 1 of 2 sum 3"], output[-4000:]
    assert "TCP client failed" not in output, output[-4000:]


def test_an_agent_store_that_does_not_answer_is_one_line_not_minutes_of_retries(monkeypatch):
    # The first connect to the agent's store waited the whole connect budget per try, with C++ retry logs.
    from launch import free_port

    from pksampler.train.runtime.launch_store import launch_store

    port = free_port()  # nothing listens there
    for name, value in (("TORCHELASTIC_RUN_ID", "test"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)),
                        ("TORCHELASTIC_USE_AGENT_STORE", "True")):
        monkeypatch.setenv(name, value)
    with pytest.raises(TimeoutError) as caught:
        launch_store(1, connect_seconds=600)
    message = str(caught.value)
    assert f"127.0.0.1:{port} did not answer" in message and "\n" not in message
    for told, disabled in (("False", None), (None, "1")):  # no agent store: torch's own env:// set-up
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
        if told is not None:
            monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", told)
        if disabled is not None:
            monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", disabled)
        assert launch_store(1, connect_seconds=600) is None

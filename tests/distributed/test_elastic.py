"""Horovod elastic on one machine: hosts ``localhost`` and ``127.0.0.1`` come and go through a discovery script.

Horovod's own test pattern: the discovery script prints a file that the test
rewrites while the job runs. Pass criteria: every global step is in
metrics.jsonl once, and the samples every committed step trained are those
of the uninterrupted plan (computed here with the sampler at one rank).

A launch is seconds of start-up per rank, so the runs that several tests read
are module-scoped fixtures (``shared_run``): one job in which rank 0's host
leaves serves the leaving host's checks and the new rank 0's; one join with a
sharded head serves the joiners' state, the head's rows and a hook's table;
and one process's run of the head settings is the reference of both head runs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from launch import ROOT, end_launch, finish_agent, kill_agent, run_launcher, shared_run, spawn, start_agent

pytestmark = pytest.mark.horovod

SCRIPT = ROOT / "tests" / "distributed" / "train_with_test_hooks.py"
#: horovodrun with discovery every 0.1 s (Horovod's own elastic tests lower its 1 s interval the same way)
FAST_DISCOVERY = ROOT / "tests" / "distributed" / "horovodrun_fast_discovery.py"
TWO_HOSTS = "localhost:2\n127.0.0.1:2\n"
ONE_HOST = "localhost:2\n"
#: every run: the default config, few steps, images fetched in the rank's process (recorded)
SETTINGS = ("train.max_steps=12", "train.commit_every=2", "data.workers=0", "train.tensorboard=false")
#: a checkpoint every 3 steps, a commit only every 100 (and at the last step, 6; 7 steps an epoch); small
#: images and network, so the steps cost little beside the two jobs' start-up
CHECKPOINTS_BETWEEN_COMMITS = ("train.max_steps=6", "train.checkpoint_every=3", "train.commit_every=100",
                               "data.args.num_classes=40", "data.args.image_size=24", "data.image_size=16",
                               "model.width=8", "data.workers=0", "train.tensorboard=false")
#: two epochs of 7 steps, each ending with an evaluation
TWO_SHORT_EPOCHS = ("train.epochs=2", "train.eval_every=1", "train.commit_every=2", "data.args.num_classes=40",
                    "data.args.image_size=24", "data.image_size=16", "model.width=8", "data.workers=0")

#: the runs compared with one process (the added-host run and the head's leaving run, both with a head:
#: HEAD_SETTINGS): SGD, whose steps are linear in the gradient (AdamW's first steps divide by the gradients' own
#: size and grow the rounding of the sums fastest)
JOIN_SETTINGS = (*SETTINGS, "optim.name=sgd", "optim.lr=0.05")


@dataclass
class ElasticRun:
    returncode: int
    output: str
    changed_at: float  # when the discovery script's answer changed
    ended_at: float
    workspace: Path
    records: Path
    logged: list[int]  # the global steps in metrics.jsonl when the job ended (a resume may log more later)


def run_elastic(tmp_path: Path, *, hosts: str, then: str | Callable[[Path], str], np: int, min_np: int,
                max_np: int, after_step: int,
                timeout: float = 420.0, env: dict[str, str] | None = None,
                settings: tuple[str, ...] = SETTINGS) -> ElasticRun:
    """``horovodrun`` elastic over a discovery script printing ``hosts``, switched to ``then`` after a step.

    ``then`` may be a function of the records folder (what the ranks trained so far), for a change that depends
    on where Horovod put the ranks.
    """
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text(hosts)
    workspace, records = tmp_path / "ws", tmp_path / "records"
    records.mkdir()
    command = elastic_command(discovery_script(tmp_path, hosts_file), workspace, settings, np=np, min_np=min_np,
                              max_np=max_np)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "180",
                "PKSAMPLER_TEST_RECORD": str(records), **(env or {})}
    process = spawn(command, kind="horovodrun", cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True)
    deadline, changed_at = time.monotonic() + timeout, float("nan")
    try:
        while process.poll() is None and time.monotonic() < deadline:
            if _steps_logged(workspace) >= after_step:
                hosts_file.write_text(then(records) if callable(then) else then)
                changed_at = time.time()
                break
            time.sleep(0.1)
        output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        end_launch(process)
        output, _ = process.communicate()
        raise AssertionError(f"elastic run timed out after {timeout}s:\n{output[-6000:]}") from None
    logged = _logged_steps(workspace) if (workspace / "metrics.jsonl").is_file() else []
    return ElasticRun(process.returncode, output, changed_at, time.time(), workspace, records, logged)


def discovery_script(tmp_path: Path, hosts_file: Path) -> Path:
    """A host-discovery script that prints ``hosts_file`` (run every 0.1 s: ``FAST_DISCOVERY``)."""
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    script.chmod(0o755)
    return script


def elastic_command(script: Path, workspace: Path, settings: tuple[str, ...], *, np: int, min_np: int,
                    max_np: int) -> list[str]:
    """``horovodrun`` elastic (discovery ``script``) of the test trainer in ``workspace`` with ``settings``."""
    return [sys.executable, str(FAST_DISCOVERY), "-np", str(np), "--min-np", str(min_np), "--max-np", str(max_np),
            "--host-discovery-script", str(script), "--network-interface", "lo", "--start-timeout", "120",
            sys.executable, str(SCRIPT), "--set", f"workspace={workspace}",
            *(arg for setting in settings for arg in ("--set", setting))]


def _steps_logged(workspace: Path) -> int:
    path = workspace / "metrics.jsonl"
    return path.read_text().count('"type": "step"') if path.is_file() else 0


def _logged_steps(workspace: Path) -> list[int]:
    lines = (workspace / "metrics.jsonl").read_text().splitlines()
    return [record["global_step"] for record in map(json.loads, lines) if record["type"] == "step"]


def uninterrupted_plan(steps: int, settings: tuple[str, ...] = SETTINGS) -> list[list[tuple[int, int]]]:
    """(epoch, sample index) pairs of global steps 1..steps: the sampler at one rank, the run's config."""
    from pksampler.train.builders import build_data, build_sampler
    from pksampler.train.config.load import load_config

    config = load_config(ROOT / "configs" / "demo.yaml", list(settings))
    sampler = build_sampler(config.sampler, build_data(config).train.labels, 1, 0, config.seed)
    plan, epoch = [], 0
    while len(plan) < steps:
        sampler.set_epoch(epoch)
        plan += [sorted((epoch, int(i)) for i in batch) for batch in sampler]
        epoch += 1
    return plan[:steps]


def committed_steps(records: Path) -> dict[int, dict]:
    """Per global step, what the last world that ran it trained: its size and the (epoch, index) pairs of all ranks.

    A step run again after a rollback is recorded twice; the later world's run is the one kept.
    """
    runs: dict[int, dict[float, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for path in records.glob("*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            runs[record["global_step"]][record["world_started"]].append(record)
    steps = {}
    for step, worlds in runs.items():
        last = worlds[max(worlds)]
        steps[step] = dict(size=last[0]["size"], ranks=sorted(r["rank"] for r in last), runs=len(worlds),
                           pairs=sorted((r["epoch"], i) for r in last for i in r["indices"]))
    return steps


def _parameters_per_run(records: Path) -> dict[int, list[set[float]]]:
    """Per global step and world that ran it (rolled back or not), the parameter sums its ranks reported."""
    runs: dict[int, dict[float, set[float]]] = defaultdict(lambda: defaultdict(set))
    for path in records.glob("*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            runs[record["global_step"]][record["world_started"]].add(record["parameters"])
    return {step: list(worlds.values()) for step, worlds in runs.items()}


def check_exactly_the_plan(run: ElasticRun, steps: int, settings: tuple[str, ...] = SETTINGS) -> dict[int, dict]:
    assert run.returncode == 0, run.output[-6000:]
    assert run.logged == list(range(1, steps + 1)), run.output[-3000:]
    trained = committed_steps(run.records)
    assert sorted(trained) == list(range(1, steps + 1))
    for step, expected in enumerate(uninterrupted_plan(steps, settings), start=1):
        assert trained[step]["ranks"] == list(range(trained[step]["size"])), (step, trained[step])
        assert trained[step]["pairs"] == expected, f"global step {step} trained other samples than the plan"
    # A joiner that did not receive the state would train other parameters than the survivors.
    for step, runs in _parameters_per_run(run.records).items():
        assert all(len(values) == 1 for values in runs), f"ranks hold different parameters after global step {step}"
    return trained


def _report(name: str, run: ElasticRun, trained: dict[int, dict]) -> None:
    """Measurements for README: steps run again, and how long the change took to reach a new world."""
    replayed = [step for step, info in trained.items() if info["runs"] > 1]
    sizes = [trained[step]["size"] for step in sorted(trained)]
    records = [json.loads(line) for path in run.records.glob("*.jsonl") for line in path.read_text().splitlines()]
    worlds = sorted({r["world_started"] for r in records})
    last_of_first = max(r["time"] for r in records if r["world_started"] == worlds[0])
    print(f"[elastic] {name}: world sizes per step {sizes}; steps run twice {replayed}; change to new world "
          f"{worlds[-1] - run.changed_at:.1f} s; last step of the old world to new world "
          f"{worlds[-1] - last_of_first:.1f} s", flush=True)


#: the folder beside a run's workspace where the hook's table (``PKSAMPLER_TEST_TOY_TABLE``) writes each rank's range
TOY = "toy"


def _train_alone(folder: Path, settings: tuple[str, ...], env: dict[str, str]) -> Path:
    """The test trainer in one process with ``settings`` and ``env``; its workspace."""
    workspace = folder / "alone"
    alone = subprocess.run([sys.executable, str(SCRIPT), "--set", f"workspace={workspace}",
                            *(arg for setting in settings for arg in ("--set", setting))],
                           cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True,
                           timeout=300)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    return workspace


def _step_losses(workspace: Path) -> list[float]:
    lines = (workspace / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if record["type"] == "step"]


def _check_same_model(workspace: Path, reference: Path) -> None:
    """``last.pt`` at step 12 in both, trained in float64: the same model (and head rows and momentum, with a head)
    up to the order of the sums."""
    import torch

    from tiny_runs import read_trained

    got, want = (read_trained(path / "checkpoints" / "last.pt") for path in (workspace, reference))
    assert got["state"]["global_step"] == want["state"]["global_step"] == 12
    pairs = {name: (got["model"][name], value) for name, value in want["model"].items()}
    if "head" in want["loss"]:
        pairs.update({f"head.{key}": (got["loss"]["head"][key], want["loss"]["head"][key])
                      for key in ("rows", "momentum")})
    not_float64 = {name: str(torch.as_tensor(a).dtype) for name, (a, _) in pairs.items()
                   if torch.as_tensor(a).is_floating_point() and torch.as_tensor(a).dtype != torch.float64}
    assert not not_float64, not_float64
    # Relative to each tensor's own scale where that is above 1 (the rows' momentum reaches ~5). A lost or
    # misplaced range is off by the values themselves, far above this.
    worst = {name: float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max()
                         / max(1.0, float(torch.as_tensor(b).abs().max()))) for name, (a, b) in pairs.items()}
    print(f"[elastic] largest parameter difference to one process {max(worst.values()):.2e}", flush=True)
    assert max(worst.values()) < FLOAT64_TOLERANCE, sorted(worst.items(), key=lambda item: -item[1])[:5]


#: the join run with a row-sharded head beside the pair loss (cosface over every class each step), with both
#: necks on: configs/folder.yaml's (model.neck=batch, on the gathered batch) and the BNNeck a head brings by
#: default. Its runs and their one-process reference train in float64 (HEAD_ENV). In float32 the necks amplify
#: the sums' rounding (one process whose weights are moved by x (1 + 1e-7 N) drifts 0.44 in a loss of ~9 by
#: step 10, as far as an uninterrupted horovodrun -np 2 drifts from it), so a float32 comparison could not
#: tell a lost range from rounding; in float64 the rounding is 1e-16 and the same steps must agree to 1e-9
#: (docs/sharded-head.md, "BNNeck: the traces drift, and why")
HEAD_SETTINGS = (*JOIN_SETTINGS, "head.name=cosface", "head.scale=16", "head.margin=0.2", "model.neck=batch",
                 "data.args.image_size=24", "data.image_size=16", "model.width=8")  # float64 convolutions are slow
#: the head runs' environment: they train in float64 (tests/distributed/train_with_test_hooks.py)
HEAD_ENV = {"PKSAMPLER_TEST_DTYPE": "float64"}
#: how far a float64 head run may be from one process's run of the same global batches (relative): measured
FLOAT64_TOLERANCE = 1e-9


def _hosts_of_rank_0(records: Path) -> set[str]:
    """Where rank 0 ran so far, as Horovod names the hosts (its placement of the two hosts varies by run)."""
    hosts = {r["host"] for path in records.glob("*.jsonl") for r in map(json.loads, path.read_text().splitlines())
             if r["rank"] == 0}
    assert len(hosts) == 1 and hosts <= {"localhost", "127.0.0.1"}, hosts
    return hosts


def _without_rank_0s_host(records: Path) -> str:
    """The discovery answer without the host of rank 0."""
    return "127.0.0.1:2\n" if _hosts_of_rank_0(records) == {"localhost"} else "localhost:2\n"


def _only_rank_0s_host(records: Path) -> str:
    """The discovery answer with the host of rank 0 alone: the other host leaves."""
    return "localhost:2\n" if _hosts_of_rank_0(records) == {"localhost"} else "127.0.0.1:2\n"


@shared_run()
def rank_0s_host_left(folder: Path) -> ElasticRun:
    """4 workers on two hosts, rank 0's host removed after step 4 of two short epochs (an evaluation each)."""
    return run_elastic(folder, hosts=TWO_HOSTS, then=_without_rank_0s_host, np=4, min_np=2, max_np=4, after_step=4,
                       settings=TWO_SHORT_EPOCHS)


@shared_run()
def joined_with_head(folder: Path) -> ElasticRun:
    """2 workers, a host of 2 added once step 2 is logged, 12 steps with a row-sharded head and the hook's table.
    The steps are short: rank 0 holds after step 3 until Horovod tells it of the new hosts, and the commit at
    step 4 moves the run into the world of 4."""
    (folder / TOY).mkdir()
    return run_elastic(folder, hosts=ONE_HOST, then=TWO_HOSTS, np=2, min_np=2, max_np=4, after_step=2,
                       settings=HEAD_SETTINGS, env={**HEAD_ENV, "PKSAMPLER_TEST_TOY_TABLE": str(folder / TOY),
                                                    "PKSAMPLER_TEST_HOLD_FOR_HOSTS": "3"})


@shared_run()
def head_alone(folder: Path) -> Path:
    """One process's run of ``HEAD_SETTINGS`` (12 steps): the reference of both head runs; its workspace."""
    return _train_alone(folder, HEAD_SETTINGS, HEAD_ENV)


def test_a_removed_host_leaves_the_survivors_training_the_same_plan(rank_0s_host_left):
    # The host that leaves here is rank 0's; in the head's leaving run below it is the other one.
    run = rank_0s_host_left
    trained = check_exactly_the_plan(run, 14, TWO_SHORT_EPOCHS)
    assert trained[1]["size"] == 4 and trained[14]["size"] == 2, {s: t["size"] for s, t in trained.items()}
    _report("host removed", run, trained)


def test_when_rank_0s_host_leaves_the_new_rank_0_takes_over_the_workspace(rank_0s_host_left):
    run = rank_0s_host_left
    assert run.returncode == 0, run.output[-6000:]
    records = [json.loads(line) for line in (run.workspace / "metrics.jsonl").read_text().splitlines()]
    evaluations = [record for record in records if record["type"] == "eval"]
    # Both evaluations (epoch 1 at step 7, epoch 2 at step 14) ran after rank 0's host left.
    assert [(r["epoch"], r["global_step"]) for r in evaluations] == [(1, 7), (2, 14)], evaluations
    final = json.loads((run.workspace / "final_metrics.json").read_text())
    assert final == {k: v for k, v in evaluations[-1].items() if k not in ("type", "epoch", "global_step")}
    assert (run.workspace / "checkpoints" / "best.pt").is_file() and (run.workspace / "curves.png").is_file()
    holder = (run.workspace / ".lock").read_text().strip()
    rank_0_at = {(int(path.stem), r["global_step"]) for path in run.records.glob("*.jsonl")  # <pid>.jsonl
                 for r in map(json.loads, path.read_text().splitlines()) if r["rank"] == 0}
    assert holder == f"pid {max(rank_0_at, key=lambda pair: pair[1])[0]} on host {socket.gethostname()}", holder
    assert len({pid for pid, _ in rank_0_at}) == 2, "rank 0 did not change hands"
    assert "is rank 0 now and writes the workspace" in run.output, run.output[-3000:]


def test_added_hosts_receive_the_state_and_their_joiners_train_to_the_end(joined_with_head, head_alone):
    # Issue 27: with Horovod's response cache on, survivors and joiners executed different collectives from the
    # second step of the world of 4; Gloo aborted on both sides (op.preamble.length <= op.nbytes), status 1.
    run = joined_with_head
    trained = check_exactly_the_plan(run, 12, HEAD_SETTINGS)
    sizes = {step: info["size"] for step, info in trained.items()}
    assert sizes[1] == 2 and sizes[12] == 4, sizes
    _report("host added", run, trained)
    # The same global batches in one process: the same losses, up to the order of the sums (the final model, the
    # head's rows and momentum: the next test).
    # A joiner without the committed state (model, neck statistics, rows) would be off by far more.
    _check_losses(run.workspace, head_alone)


def _check_head_run_against_one_process(workspace: Path, reference: Path) -> None:
    """The elastic run's 12 losses, model, rows and momentum equal one process's (``reference``, the workspace of
    ``head_alone``) up to the order of the sums."""
    _check_losses(workspace, reference)
    _check_same_model(workspace, reference)


def _check_losses(workspace: Path, reference: Path) -> None:
    """The 12 step losses of a float64 head run equal one process's within :data:`FLOAT64_TOLERANCE` (relative)."""
    losses, expected = _step_losses(workspace), _step_losses(reference)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    print(f"[elastic] largest relative loss difference to one process {worst:.2e}", flush=True)
    assert len(losses) == 12 and worst < FLOAT64_TOLERANCE, (losses, expected)


def _check_toy_table(folder: Path, *, size: int, step: int, added: int | None = None) -> None:
    """A second sharded table (tests/toy_table.py's ToyTable, shared by a hook) came through every reset:
    every row once, each holding its id plus every committed step's number once (``added``: their sum, by
    default 1 + ... + ``step``)."""
    ranks = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]
    assert len(ranks) == size and all(r["size"] == size and r["step"] == step for r in ranks), ranks
    rows = sorted(row for r in ranks for row in r["rows"])
    assert [int(row[1]) for row in rows] == list(range(37)), rows
    added = step * (step + 1) // 2 if added is None else added
    assert all(value == ident + added for value, ident in rows), rows


def test_the_sharded_head_reaches_hosts_that_join(joined_with_head, head_alone):
    # Issue 29: the trainer refused a head under Horovod elastic (the rows would need re-sharding at a reset).
    # Joiners receive rank 0's committed whole head in the sync and take their ranges of it. A second sharded
    # table, added by a hook (nothing in engine/elastic/ or run_setup knows it), reaches them the same way.
    run = joined_with_head
    assert run.returncode == 0, run.output[-6000:]
    trained = committed_steps(run.records)
    assert (trained[1]["size"], trained[12]["size"]) == (2, 4), {s: t["size"] for s, t in trained.items()}
    _check_toy_table(run.workspace.parent / TOY, size=4, step=12)
    _check_head_run_against_one_process(run.workspace, head_alone)


def test_the_sharded_head_survives_a_host_leaving_and_a_resume_on_every_rank(tmp_path, head_alone):
    """4 ranks -> 2 after step 2, the host without rank 0 leaving (the survivors re-shard from their committed copy: Horovod skips the sync),
    stop at step 8; then a new job resumes from last.pt, which only rank 0 reads: the first sync hands every rank
    the range files' names and each reads its own range of the head and of the hook's table from them (before,
    the other ranks kept their initial rows and the job failed; then rank 0 read the whole head, and the
    table restarted from its initial rows)."""
    toy = tmp_path / TOY  # a second sharded table, kept by a hook: the survivors re-assemble it too
    toy.mkdir()
    run = run_elastic(tmp_path, hosts=TWO_HOSTS, then=_only_rank_0s_host, np=4, min_np=2, max_np=4, after_step=2,
                      settings=(*HEAD_SETTINGS, "train.max_steps=8"), env={**HEAD_ENV, "PKSAMPLER_TEST_TOY_TABLE": str(toy)})
    trained = check_exactly_the_plan(run, 8, HEAD_SETTINGS)
    assert (trained[1]["size"], trained[8]["size"]) == (4, 2), {s: t["size"] for s, t in trained.items()}
    _check_toy_table(toy, size=2, step=8)
    command = elastic_command(tmp_path / "discover.sh", run.workspace, HEAD_SETTINGS, np=2, min_np=2, max_np=2)
    toy_resumed = tmp_path / "toy_resumed"
    toy_resumed.mkdir()
    resumed = run_launcher(command, kind="horovodrun", timeout=300,
                           env={**os.environ, **HEAD_ENV, "OMP_NUM_THREADS": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "180",
                                "PKSAMPLER_TEST_TOY_TABLE": str(toy_resumed)})
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert "resumed at epoch 0 step 8" in resumed.stdout, resumed.stdout[-3000:]
    _check_head_run_against_one_process(run.workspace, head_alone)
    # the table from last.pt: its step-8 checkpoint was written by the checkpoint hook, which runs before the
    # test's hook adds 8, so steps 1-7 and 9-12 (had it restarted, only 9-12)
    _check_toy_table(toy_resumed, size=2, step=12, added=12 * 13 // 2 - 8)


def test_survivors_below_min_np_end_with_one_clear_error_long_before_horovods_timeout(tmp_path):
    # Horovod alone would wait HOROVOD_ELASTIC_TIMEOUT (600 s by default) and then blame a worker's exit status.
    # The bound below separates our 7 s wait (HOROVOD_ELASTIC_TIMEOUT less 5 s; no host comes back, so any
    # value above 5 s tests the same) from those 600 s with room for a loaded machine's teardown. Two hosts of one
    # slot: one worker is left, below --min-np 2 (the wait does not depend on how many survive).
    run = run_elastic(tmp_path, hosts="localhost:1\n127.0.0.1:1\n", then="localhost:1\n", np=2, min_np=2, max_np=2,
                      after_step=2, env={"HOROVOD_ELASTIC_TIMEOUT": "12"})
    took = run.ended_at - run.changed_at
    print(f"[elastic] below --min-np: the job ended {took:.1f} s after the host left", flush=True)
    assert run.returncode != 0, run.output[-3000:]
    assert "[pksampler] error: Horovod elastic: no new world within 7 s" in run.output, run.output[-3000:]
    assert "fewer slots than --min-np" in run.output
    assert took < 300, f"the job took {took:.0f} s to end after the host left"


def _wait_until(ready: Callable[[], bool], process: subprocess.Popen, log: Path, *, timeout: float, what: str) -> None:
    """Poll ``ready()`` while the launcher runs; fail with the log's tail if it ends or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen (launcher status {process.poll()}):\n"
                                 f"{log.read_text()[-4000:]}")
        time.sleep(0.2)


def test_a_job_killed_after_a_checkpoint_resumes_with_every_step_logged_once(tmp_path):
    # Issue 27: last.pt was written every checkpoint_every steps but the step lines only at commits, and a
    # resume cuts metrics.jsonl back to last.pt's step: the steps between the last commit and the checkpoint
    # were in neither place. Here rank 0 stops after step 4 (last.pt holds step 3, no commit yet), the whole
    # job is killed, and a second job resumes from last.pt.
    from pksampler.train.engine.checkpoint import load_checkpoint

    hosts, workspace = tmp_path / "hosts.txt", tmp_path / "ws"
    hosts.write_text(ONE_HOST)
    command = elastic_command(discovery_script(tmp_path, hosts), workspace, CHECKPOINTS_BETWEEN_COMMITS, np=2,
                              min_np=2, max_np=2)
    last, first_log = workspace / "checkpoints" / "last.pt", tmp_path / "first.log"
    first = start_agent(command, first_log, env={"PKSAMPLER_TEST_FREEZE": "0:4"})
    try:
        _wait_until(lambda: "frozen at step 4" in first_log.read_text() and last.is_file(), first, first_log,
                    timeout=240, what="rank 0 stopping after step 4 with last.pt written")
    finally:
        kill_agent(first)
    killed_at = load_checkpoint(last)["state"]["global_step"]
    assert killed_at == 3, f"the first job was killed with last.pt at step {killed_at}, expected 3"

    second = finish_agent(start_agent(command, tmp_path / "second.log"), tmp_path / "second.log", timeout=240)
    assert second.returncode == 0, second.stdout[-4000:]
    steps = _logged_steps(workspace)
    assert steps == list(range(1, 7)), (f"metrics.jsonl holds the steps {steps}, expected 1..6 each once (the job "
                                        f"was killed with last.pt at step 3, before any commit)")



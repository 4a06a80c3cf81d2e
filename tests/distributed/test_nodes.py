"""Two nodes on one machine under both launchers: the same model, bit for bit, as one node of 4 ranks.

horovodrun -H localhost:2,127.0.0.1:2 counts two hosts (ranks 2 and 3 have
local ranks 0 and 1); two torchrun agents meet at one c10d rendezvous and
share the WORKSPACE. Each launcher runs twice (two nodes, one node) in a
module-scoped fixture, with ``train.deterministic``, and every assertion reads
those runs: 4 ranks on 2 loaded cores are slow.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest
import torch
import yaml
from launch import (LAUNCHERS, ROOT, agent_command, finish_agent, free_port, kill_agent, launch, launch_agents,
                    start_agent, wait_for_port)
from tiny_runs import folder_keys, read_trained

pytestmark = pytest.mark.horovod
HOOKED = ROOT / "tests" / "distributed" / "train_with_test_hooks.py"
SCRIPT = ROOT / "train" / "retrieval.py"
STEPS = 4
#: the default data (configs/demo.yaml) with configs/folder.yaml's model, loss and head keys and the head it offers
#: turned on (the BatchNorm neck on the gathered batch, the sharded head), a few steps, a checkpoint mid-run
#: (written in the background)
ARGS = (*(argument for key in folder_keys() for argument in ("--set", key)), "--set", "head.name=arcface",
        "--set", f"train.max_steps={STEPS}",
        "--set", "train.checkpoint_every=2", "--set", "train.deterministic=true")


def _run(launcher: str, workspace: Path, *, two_nodes: bool) -> str:
    args = (*ARGS, "--set", f"workspace={workspace}")
    env = {"PKSAMPLER_TEST_AUDIT": str(workspace)}
    if launcher == "horovodrun":
        hosts = "localhost:2,127.0.0.1:2" if two_nodes else "localhost:4"
        result = launch(launcher, HOOKED, *args, np=4, hosts=hosts, env=env, timeout=400)
        assert result.returncode == 0, result.stdout[-4000:]
        return result.stdout
    workspace.mkdir(parents=True)
    results = launch_agents(HOOKED, *args, agents=2 if two_nodes else 1, nproc=2 if two_nodes else 4, env=env,
                            log_dir=workspace.parent, timeout=400)
    for result in results:
        assert result.returncode == 0, result.stdout[-4000:]
    return "".join(result.stdout for result in results)


@pytest.fixture(scope="module", params=LAUNCHERS)
def runs(request, tmp_path_factory):
    launcher = request.param
    root = tmp_path_factory.mktemp(launcher)
    outputs = {}
    for name, two_nodes in (("two", True), ("one", False)):
        (root / name).mkdir()
        outputs[name] = _run(launcher, root / name / "workspace", two_nodes=two_nodes)
    return launcher, {name: (root / name / "workspace", output) for name, output in outputs.items()}


def _audits(output: str) -> list[dict]:
    return sorted((json.loads(line.split("[audit] ", 1)[1]) for line in output.splitlines() if "[audit] " in line),
                  key=lambda audit: audit["rank"])


def _final(workspace: Path) -> dict:
    return read_trained(workspace / "checkpoints" / "last.pt")  # the head's rows inside, from their range files


def _tensors(tree, prefix: str = ""):
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix}/{key}")


def test_two_nodes_train_bit_for_bit_the_model_of_one_node(runs):
    launcher, outputs = runs
    two, one = (_final(outputs[name][0]) for name in ("two", "one"))
    assert two["state"]["global_step"] == one["state"]["global_step"] == STEPS
    pairs = {name: dict(_tensors({"model": state["model"], "optimizer": state["optimizer"]}))
             for name, state in (("two", two), ("one", one))}
    assert pairs["two"].keys() == pairs["one"].keys() and len(pairs["two"]) > 10
    unequal = [key for key, tensor in pairs["two"].items() if not torch.equal(tensor, pairs["one"][key])]
    assert not unequal, (launcher, unequal[:5])
    losses = [[json.loads(line)["loss"] for line in (outputs[name][0] / "metrics.jsonl").read_text().splitlines()]
              for name in ("two", "one")]
    assert len(losses[0]) == STEPS and losses[0] == losses[1]


def test_each_host_counts_its_own_local_ranks_and_rank_zero_alone_writes(runs):
    launcher, outputs = runs
    workspace, output = outputs["two"]
    audits = _audits(output)
    assert [(a["rank"], a["local_rank"], a["size"]) for a in audits] == [(0, 0, 4), (1, 1, 4), (2, 0, 4), (3, 1, 4)]
    # On a host with two GPUs each rank takes the one of its local rank: no rank asks for cuda:2 or cuda:3.
    assert [a["device_on_two_gpus"] for a in audits] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert all(a["deterministic_kernels"] for a in audits)
    if launcher == "horovodrun":
        assert all(a["fusion_threshold"] == "0" for a in audits)
    # Rank 0 alone writes the workspace's files; every other rank writes only its own range of the head's rows
    # beside a checkpoint (rank 0 writes their manifest). Temporaries are named after their target.
    written = [sorted({re.sub(r"^(.*/)?\.([^/]+)\.[^./]+\.tmp$", r"\1\2", path) for path in a["written"]})
               for a in audits]
    assert {"checkpoints/last.pt", "metrics.jsonl", "config.json", ".lock"} <= set(written[0]), written[0]
    own = re.compile(r"^checkpoints/(?:last|best)\.shared/loss/step-\d+/rows-(\d+-\d+)\.pt$")
    ranges = [{own.match(path).group(1) if own.match(path) else path for path in paths} for paths in written[1:]]
    assert all(len(mine) == 1 for mine in ranges), written  # each its own range, one file per checkpoint
    names = [next(iter(mine)) for mine in ranges]
    assert len(set(names)) == 3 and all(re.fullmatch(r"\d+-\d+", name) for name in names), written
    # The lock names the process that holds the workspace and its host.
    assert (workspace / ".lock").read_text().strip() == f"pid {audits[0]['pid']} on host {socket.gethostname()}"
    assert output.count(f"world=4") == 1  # one announcement, from rank 0


# A small model and data set: the job must still be running when a node is lost.
ELASTIC = {
    "seed": 5,
    "data": {"name": "synthetic", "args": {"num_classes": 24, "images_per_class": 6, "image_size": 32},
             "test_fraction": 0.3, "image_size": 24, "workers": 0},
    "sampler": {"name": "balanced", "classes_per_step": 4, "samples_per_class": 3},
    "model": {"width": 8, "depth": [1, 1], "embedding_dim": 16, "norm": "group"},
    "optim": {"name": "sgd", "lr": 0.01, "base_batch": 12, "warmup_steps": 3},
    "train": {"epochs": 5, "eval_every": 100, "checkpoint_every": 5, "gallery_queries": 3, "tensorboard": False},
}


def _logged(path: Path) -> list[tuple[int, float]]:
    """(global step, time) of every complete step line of metrics.jsonl as it is now."""
    found = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if record.get("type") == "step":
            found.append((record["global_step"], record["time"]))
    return found


def test_losing_a_node_under_torchrun_elastic_replays_at_most_checkpoint_every_steps(tmp_path):
    """Two agents of 2 ranks (--nnodes=1:2); the one that does not host the store is killed with its workers.

    The survivors restart at world 2 from the last checkpoint and finish every
    step. metrics.jsonl is read while the job runs: a step logged before the
    loss and again after the restart (with another time) was replayed.
    """
    
    workspace, every = tmp_path / "ws", ELASTIC["train"]["checkpoint_every"]
    config = tmp_path / "elastic.yaml"
    config.write_text(yaml.safe_dump({**ELASTIC, "workspace": str(workspace)}))
    port = free_port()
    command = agent_command(SCRIPT, "--config", str(config), nnodes="1:2", nproc=2, endpoint=f"127.0.0.1:{port}",
                            max_restarts=3)
    # As a user runs it: torchrun's agent store shared with the workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE
    # unset). It keeps the last launch's process-group keys; the workers build their group on a store of each
    # launch's own (train/runtime/launch_store.py), so the restart after the loss neither hangs nor fails.
    env = None
    host = start_agent(command, tmp_path / "host.log", env=env)
    lost = None
    try:
        wait_for_port(port, host)  # this agent hosts the rendezvous store: losing it would end the job
        lost = start_agent(command, tmp_path / "lost.log", env=env)
        seen: set[tuple[int, float]] = set()
        while host.poll() is None and lost.poll() is None and max((s for s, _ in seen), default=0) <= 2 * every:
            seen.update(_logged(workspace / "metrics.jsonl"))
            time.sleep(0.1)
        assert lost.poll() is None and host.poll() is None
        assert "world=4" in (tmp_path / "host.log").read_text() + (tmp_path / "lost.log").read_text()
        kill_agent(lost)
        deadline = time.monotonic() + 400
        while host.poll() is None and time.monotonic() < deadline:
            seen.update(_logged(workspace / "metrics.jsonl"))
            time.sleep(0.1)
        result = finish_agent(host, tmp_path / "host.log", timeout=1)
    finally:
        for process in (host, lost):
            if process is not None and process.poll() is None:
                kill_agent(process)
    assert result.returncode == 0, result.stdout[-4000:]
    resumed = re.search(r"world=2 .* steps/epoch=(\d+) resumed at epoch (\d+) step (\d+)", result.stdout)
    assert resumed, result.stdout[-4000:]
    per_epoch, epoch, step = (int(group) for group in resumed.groups())
    total, restart = ELASTIC["train"]["epochs"] * per_epoch, epoch * per_epoch + step
    assert _final(workspace)["state"]["global_step"] == total
    assert [step for step, _ in _logged(workspace / "metrics.jsonl")] == list(range(1, total + 1))
    times: dict[int, set[float]] = {}
    for step, at in seen:
        times.setdefault(step, set()).add(at)
    replayed = sorted(step for step, ats in times.items() if len(ats) > 1)
    print(f"node lost after step {max(replayed, default=restart)}, restarted from step {restart}: "
          f"{len(replayed)} steps replayed (checkpoint_every={every})")
    assert replayed == list(range(restart + 1, restart + 1 + len(replayed))) and len(replayed) <= every, replayed

"""The sampler inside Lightning, Accelerate, torchdata and pytorch-ignite, with two real processes (gloo, CPU).

One launch per framework (ignite shares torchdata's torchrun launch) runs its correct recipes and its misuses; the
scripts record every rank's batches and errors, and these tests check them
against the plan computed here: P x K batches, no class on two ranks in a
step, equal steps on every rank, ``set_epoch`` reaching the sampler, exact
mid-epoch resume (and full later epochs), and one clear error for each way
a framework would otherwise break the batches silently.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from launch import free_port, run_launcher

from framework_runs import STEPS, WORLD, check_epoch, reference_plan

pytestmark = pytest.mark.launcher  # two processes under each framework's launcher
HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{HERE}:{HERE.parent}"}
for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"):
    ENV.pop(key, None)


def run(command: list[str], *, timeout: float = 300.0, env: dict[str, str] | None = None) -> str:
    """Run a launcher in its own session; past ``timeout`` kill its whole tree and fail with its output."""
    kind = {"accelerate.commands.launch": "accelerate", "torch.distributed.run": "torchrun"}.get(command[2], "lightning")
    return run_launcher(command, kind=kind, timeout=timeout, env={**ENV, **(env or {})}, cwd=HERE).stdout


def records(out: Path, prefix: str, output: str) -> list[dict]:
    paths = [out / f"{prefix}-rank{rank}.json" for rank in range(WORLD)]
    assert all(p.exists() for p in paths), f"missing records {paths}:\n{output[-4000:]}"
    return [json.loads(p.read_text()) for p in paths]


def epochs_of(ranks: list[dict], name: str, epoch: int) -> list[list[list[int]]]:
    for rank, record in enumerate(ranks):
        assert "error" not in record[name], f"{name} failed on rank {rank}: {record[name]['error']}"
    return [record[name]["epochs"][str(epoch)] for record in ranks]


def test_lightning_ddp_trains_exact_pk_resumes_exactly_and_refuses_its_default(tmp_path):
    output = run([sys.executable, str(HERE / "lightning_run.py"), str(tmp_path)])
    ranks = records(tmp_path, "lightning", output)
    for epoch in (0, 1):
        check_epoch(epochs_of(ranks, "flat", epoch), epoch)  # Lightning called set_epoch on the flat form
    stopped = epochs_of(ranks, "stop", 0)
    assert stopped == [reference_plan(0, rank=r)[:20] for r in range(WORLD)]
    check_epoch(epochs_of(ranks, "resume", 0), 0, start=20)  # the loader's state came back with the checkpoint
    check_epoch(epochs_of(ranks, "resume", 1), 1)  # the next epoch is whole: len() is the epoch's length
    for record in ranks:
        # Lightning's own error, before any batch: it names the fix, Trainer(use_distributed_sampler=False)
        error = " ".join(record["batch-default"]["error"].split())
        assert error.startswith("TypeError: Lightning can't inject a (distributed) sampler into your batch sampler")
        assert "set `Trainer(use_distributed_sampler=False)`" in error
        assert record["flat-default"]["error"] == (
            "SamplerSetupError: DistributedBalancedSampler is used through Lightning's "
            "DistributedSamplerWrapper (Trainer(use_distributed_sampler=True), the default), which re-shards its "
            "batches across "
            "ranks and breaks P x K without an error: pass Trainer(use_distributed_sampler=False) (Fabric: "
            "setup_dataloaders(..., use_distributed_sampler=False)); the sampler already gives each rank its "
            "share of every step")
    assert ranks[0]["early"]["error"].startswith(
        "SamplerSetupError: DistributedBalancedSampler detected rank 0 of num_replicas=1 when it was built, "
        "but torch.distributed now says rank 0 of 2"), ranks[0]["early"]
    # rank 1 stopped too (its peer left) instead of training on: an error, or the process ended before recording
    assert "error" in ranks[1].get("early", {"error": "ended"}), ranks[1]["early"]


def test_accelerate_launch_trains_exact_pk_unprepared_and_refuses_each_prepared_loader(tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               str(HERE / "accelerate_run.py"), str(tmp_path)]
    output = run(command, env={"ACCELERATE_USE_CPU": "true"})
    ranks = records(tmp_path, "accelerate", output)
    assert [r["recipe"]["world"] for r in ranks] == [WORLD, WORLD]
    for epoch in (0, 1):
        check_epoch(epochs_of(ranks, "recipe", epoch), epoch)
    for record in ranks:
        for case in ("prepare-batch", "prepare-flat", "split", "dispatch"):
            error = record[case].get("error", f"no error: {record[case]}")
            assert error.startswith("SamplerSetupError: DistributedBalanced") and \
                "leave the DataLoader out of accelerator.prepare(...)" in error, (case, error)


def test_stateful_dataloader_resumes_mid_epoch_exactly_and_ignite_keeps_a_batch_sampler_and_refuses_a_proxy(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
               str(HERE / "stateful_run.py"), str(tmp_path)]
    output = run(command)
    ranks = records(tmp_path, "stateful", output)
    for case in ("batch-0", "batch-2", "flat-0", "flat-2"):
        check_epoch([r[case]["before"] + r[case]["after"] for r in ranks], 1)
        assert [len(r[case]["before"]) for r in ranks] == [20, 20], case
        check_epoch([r[case]["next"] for r in ranks], 2)
        assert [r[case]["len"] for r in ranks] == [[STEPS, STEPS]] * WORLD, case  # len(loader): the whole epoch
    for record in ranks:
        assert record["wrong-rank"].startswith("SamplerMismatchError: sampler ranks do not match the process group "
                                               "(process 1 has rank=0)"), record["wrong-rank"]
    for epoch in (0, 1):  # ignite's auto_dataloader leaves the batch form alone: exact P x K
        check_epoch(epochs_of([r["ignite"] for r in ranks], "batch", epoch), epoch)
    for record in ranks:  # and wraps the flat form in DistributedProxySampler, which the sampler refuses
        assert record["ignite"]["flat"].startswith("SamplerSetupError: DistributedBalancedSampler is used through "
                                                   "pytorch-ignite's DistributedProxySampler"), record["ignite"]

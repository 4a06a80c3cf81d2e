"""Run by test_torchrun_faults.py under torchrun with --max-restarts=1: the first launch ends with rank 1 failing
after one collective; in the relaunch rank 0 reaches the process group last (it waits for rank 1's arrival mark in
the agent's store), the order in which a rank used to read its peer's address from the previous launch."""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from pksampler.train.runtime.distributed import TorchBackend


def main() -> int:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    if attempt == 1:
        if rank == 0:
            agent.wait(["pksampler-test/arrived-1"])  # rank 1 is in its set-up already
            time.sleep(2.0)  # and well into it: it reads the store before rank 0 writes
        else:
            agent.set("pksampler-test/arrived-1", "1")
    backend = TorchBackend("cpu", "fp32", collective_timeout=120)
    total = backend.allreduce_sum(torch.tensor([float(rank + 1)]))
    # one write per line: the ranks share the pipe
    sys.stdout.write(f"[restart-test] attempt {attempt} rank {rank} sum {total.item():g}\n")
    sys.stdout.flush()
    if attempt == 0 and rank == 1:
        return 3  # a failure: the agent relaunches both ranks
    backend.barrier()
    backend.shutdown()  # a Gloo group left to the interpreter's exit may abort the rank
    return 0


if __name__ == "__main__":
    sys.exit(main())

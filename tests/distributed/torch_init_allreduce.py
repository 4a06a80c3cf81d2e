"""Run by test_torchrun_faults.py under torchrun: the trainer's backend set-up, then one all-reduce."""

from __future__ import annotations

import sys

import torch

from pksampler.train.runtime.distributed import make_backend


def main() -> int:
    backend = make_backend("auto", device="cpu", precision="fp32")
    total = backend.allreduce_sum(torch.tensor([float(backend.rank + 1)]))
    # one write per line: the ranks share the pipe
    sys.stdout.write(f"[init-test] rank {backend.rank} of {backend.size} sum {total.item():g}\n")
    sys.stdout.flush()
    backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

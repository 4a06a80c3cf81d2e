"""The Horovod checks in one launch: hvd_smoke.py (collectives, one DistributedOptimizer step), hvd_sampler.py (the
distributed samplers), then hvd_wait.py (the same collectives through the trainer's sleeping wait); a launch costs
seconds of start-up per rank, so they share one."""

from __future__ import annotations

import sys
from pathlib import Path

import hvd_sampler
import hvd_smoke
import hvd_wait

if __name__ == "__main__":
    hvd_smoke.main()
    hvd_sampler.main()
    hvd_wait.main(Path(sys.argv[1]))

"""Both Horovod checks in one launch: hvd_smoke.py (collectives, one DistributedOptimizer step), then
hvd_sampler.py (the distributed samplers); a launch costs seconds of start-up per rank, so they share one."""

from __future__ import annotations

import hvd_sampler
import hvd_smoke

if __name__ == "__main__":
    hvd_smoke.main()
    hvd_sampler.main()

"""A rank that does nothing but live: it writes its pid to ``<folder>/<rank>.pid`` and sleeps (at most 10 min).

The launch-cleanup tests start it under horovodrun and torchrun, interrupt
the pytest that launched it, and check that no rank outlives the interruption.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

rank = os.environ.get("HOROVOD_RANK") or os.environ.get("RANK") or "0"
target = Path(sys.argv[1]) / f"{rank}.pid"
target.with_suffix(".tmp").write_text(str(os.getpid()))
target.with_suffix(".tmp").replace(target)  # atomic: a reader never sees a half-written pid
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    time.sleep(1)

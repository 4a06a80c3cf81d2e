"""What a rank runs on: the communication backends (Horovod, torch.distributed, one process),
the device and precision set-up, the workspace (lock, event log) and the persistent loader.
"""

from __future__ import annotations

"""The full digest of a shard set's index and labels, checked once per host in the background.

Opening a :class:`~pksampler.datasets.ShardedDataset` checks only fingerprints
(sizes, first and last MiB) and the labels; bit rot in the middle of
``index.npy`` would send a sample to the bytes of another. The first rank of
each host (local rank 0) reads both files in full in a background thread
while training starts; after each epoch every rank reports whether its host
found a mismatch (one small all-gather), so all ranks stop together with one
error naming the files.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from pksampler.train.engine.hooks import HookBase
from pksampler.train.errors import ConfigError

__all__ = ["IndexDigestHook"]

_PENDING, _GOOD, _BAD = 0, 1, 2


class IndexDigestHook(HookBase):
    """Verify ``dataset.verify(shards=False)`` on local rank 0 in a thread; agree on the outcome after each epoch."""

    def __init__(self, dataset: Any, backend: Any, *, key: str = "data.root") -> None:
        self.dataset, self.backend, self.key = dataset, backend, key
        self.status, self.message = (_PENDING if backend.local_rank == 0 else _GOOD), ""
        self.thread: threading.Thread | None = None
        self.agreed = False

    def before_train(self) -> None:
        if self.status == _PENDING:
            self.thread = threading.Thread(target=self._verify, name="pksampler-index-digest", daemon=True)
            self.thread.start()

    def _verify(self) -> None:
        try:
            self.dataset.verify(index=True, shards=False)
        except (ValueError, OSError) as error:
            self.message, self.status = str(error), _BAD
            return
        self.status = _GOOD

    def after_epoch(self) -> None:
        if self.agreed:
            return
        if self.thread is not None:
            self.thread.join()  # the first epoch usually outlasts one read of the index
        statuses = self.backend.allgather_numpy(np.array([self.status], dtype=np.int64))[:, 0]
        self.agreed = True
        if (statuses == _BAD).any():
            ranks = np.flatnonzero(statuses == _BAD).tolist()
            detail = self.message or f"found by rank(s) {ranks}"
            raise ConfigError(f"{self.key}: the shard set's index does not match its manifest: {detail}")

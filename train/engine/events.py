"""One stream of events per run (detectron2's ``EventStorage`` idea).

The loop puts one record of scalars per optimizer step
(:meth:`EventStorage.put_step`); hooks put per-epoch records (held-out
metrics, bad-image counts) with :meth:`EventStorage.put_record` and images
(the result gallery) with :meth:`EventStorage.put_image`. Every consumer
reads from here and nowhere else: ``metrics.jsonl``, TensorBoard, the
progress display and the curves PNG.

Per-step scalars are kept as compact series (an int64 step and a float64
value per step and scalar), so the storage stays small over millions of steps; records and
images are few (one per epoch). A resumed run refills the storage from its
``metrics.jsonl`` (:meth:`EventStorage.replay`), which the workspace has
already cut back to the checkpoint's step, so the curves of a resumed run
show the whole run while checkpoints carry no history.

Example::

    storage = EventStorage()
    storage.put_step(epoch=0, step=1, global_step=1, loss=0.7, lr=1e-3)
    storage.put_record("eval", epoch=1, global_step=8, recall_at_1=0.4)
    steps, losses = storage.series("loss")
    new, cursor = storage.records_since(0)
"""

from __future__ import annotations

import json
import numbers
from array import array
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["EventStorage"]

#: step fields that are positions, not scalars to plot
_NOT_SERIES = frozenset({"epoch", "step", "global_step", "time"})


class EventStorage:
    """Scalars per step, records per epoch and images of one run, in the order they happened."""

    def __init__(self) -> None:
        self._series: dict[str, tuple[array, array]] = {}
        self._latest_step: dict[str, Any] | None = None
        self._records: list[dict[str, Any]] = []
        self._images: list[tuple[str, int, Path]] = []

    def put_step(self, **values: Any) -> dict[str, Any]:
        """The record of one optimizer step (``global_step`` required); numeric values extend their series."""
        if "global_step" not in values:
            raise ValueError(f"EventStorage.put_step() needs global_step=, got keys {sorted(values)}")
        global_step = int(values["global_step"])
        record = {"type": "step", **values}
        self._extend(global_step, values)
        self._latest_step = record
        return record

    def add_to_step(self, **values: Any) -> None:
        """More scalars of the step just put (a hook's, e.g. the head's own loss): into its record and series."""
        if self._latest_step is None:
            raise ValueError(f"EventStorage.add_to_step({', '.join(sorted(values))}): no step has been put yet")
        again = sorted(set(values) & set(self._latest_step))
        if again:  # a second value would be a second point of the series, and the record would keep one
            raise ValueError(f"EventStorage.add_to_step({', '.join(sorted(values))}): the step's record has "
                             f"{', '.join(again)} already")
        self._latest_step.update(values)
        self._extend(int(self._latest_step["global_step"]), values)

    def _extend(self, global_step: int, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if name in _NOT_SERIES or isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            steps, series = self._series.setdefault(name, (array("q"), array("d")))
            steps.append(global_step)
            series.append(float(value))

    def put_record(self, kind: str, **fields: Any) -> dict[str, Any]:
        """A per-epoch record of ``kind`` (``"eval"``, ``"bad_images"``, ...)."""
        record = {"type": kind, **fields}
        self._records.append(record)
        return record

    def put_image(self, tag: str, global_step: int, path: Path) -> None:
        """An image file (e.g. the result gallery) for ``global_step``."""
        self._images.append((tag, int(global_step), Path(path)))

    @property
    def latest_step(self) -> dict[str, Any] | None:
        """The newest step record, or None before the first step."""
        return self._latest_step

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(global steps, values)`` of the per-step scalar ``name`` (empty arrays if never put)."""
        steps, values = self._series.get(name, (array("q"), array("d")))
        return np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64)

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Per-epoch records, oldest first; only those of ``kind`` when given."""
        return [r for r in self._records if kind is None or r["type"] == kind]

    def records_since(self, cursor: int) -> tuple[list[dict[str, Any]], int]:
        """Records put after the first ``cursor`` ones, and the new cursor (for writers that poll)."""
        return self._records[cursor:], len(self._records)

    def images_since(self, cursor: int) -> tuple[list[tuple[str, int, Path]], int]:
        """Images put after the first ``cursor`` ones, and the new cursor."""
        return self._images[cursor:], len(self._images)

    def replay(self, path: Path) -> int:
        """Put every record of a ``metrics.jsonl`` file back (a resumed run); returns how many were read.

        Lines cut short by a kill are skipped, as the workspace does when it truncates the file.
        """
        if not path.is_file():
            return 0
        count = 0
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict) or "type" not in record:
                continue
            if record["type"] == "step":
                self.put_step(**{k: v for k, v in record.items() if k != "type"})
            else:
                self._records.append(record)
            count += 1
        return count

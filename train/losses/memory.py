"""Cross-batch memory (XBM, Wang et al. 2020, "Cross-Batch Memory for Embedding Learning").

After the first few thousand steps a network's embeddings drift slowly, so
the embeddings of the last few batches are still good stand-ins for the
current ones. XBM keeps them in a queue and lets the pair losses compare each
anchor of the batch with the batch *and* the queue: many more (hard)
negatives per step at the cost of a matrix product, no extra forward pass.

How it is used here:

1. The loss (:class:`pksampler.train.losses.pair.MetricLoss`) reads
   :meth:`CrossBatchMemory.references` (empty during the first
   ``warmup_steps`` batches, when the embeddings still move fast), computes
   the loss against batch + references, then :meth:`~CrossBatchMemory.enqueue`
   s the batch, detached.
2. The loss sees the gathered global batch, so every rank enqueues the same
   rows in the same order: the memory is identical on every rank and for
   every world size that trains the same global batches.
3. The queue is a ring buffer of rows; the oldest rows are overwritten.

Config: ``loss.memory: {size: M, warmup_steps: N}`` keeps the last M global
batches (``size_items`` counts rows instead); ``null`` turns it off.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["CrossBatchMemory", "build_memory"]


def _positive_int(value: Any, name: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '>= 1'}, got {value}")
    return value


class CrossBatchMemory:
    """A queue of the last embeddings (detached) and labels seen by the loss.

    Args:
        size_batches: keep the last ``size_batches`` batches; the capacity in
            rows is fixed at the first :meth:`enqueue` as ``size_batches`` ×
            that batch's rows (the balanced sampler's batches all have the
            same size).
        size_items: keep the last ``size_items`` rows instead (exactly one of
            the two sizes).
        dim: embedding dimension; None takes it from the first batch.
        warmup_steps: :meth:`references` is empty until this many batches
            have been enqueued (0: from the second batch on).
        dtype: storage type of the embeddings (float32 also under autocast).

    Corner cases: a batch larger than the capacity keeps its last rows;
    :meth:`state_dict` holds only tensors and plain numbers, so a checkpoint
    with it loads under ``torch.load(weights_only=True)``.

    Example::

        memory = CrossBatchMemory(size_batches=4, warmup_steps=100)
        ref, ref_labels = memory.references()      # (0, D) before warm-up
        loss = batch_hard_triplet(emb, labels, ref_embeddings=ref, ref_labels=ref_labels)
        memory.enqueue(emb, labels)
    """

    def __init__(self, *, size_batches: int | None = None, size_items: int | None = None,
                 dim: int | None = None, warmup_steps: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if (size_batches is None) == (size_items is None):
            raise ValueError(f"give exactly one of size_batches and size_items, got size_batches={size_batches!r}, "
                             f"size_items={size_items!r}")
        self.size_batches = None if size_batches is None else _positive_int(size_batches, "size_batches")
        self.size_items = None if size_items is None else _positive_int(size_items, "size_items")
        self.dim = None if dim is None else _positive_int(dim, "dim")
        self.warmup_steps = _positive_int(warmup_steps, "warmup_steps", allow_zero=True)
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
        self.dtype = dtype
        self.device = torch.device(device)
        self.steps = 0          # batches enqueued so far
        self._pointer = 0       # next row to write
        self._filled = 0        # rows holding data
        self._embeddings: torch.Tensor | None = None
        self._labels: torch.Tensor | None = None

    def __repr__(self) -> str:
        size = f"size_batches={self.size_batches}" if self.size_batches else f"size_items={self.size_items}"
        return (f"CrossBatchMemory({size}, dim={self.dim}, warmup_steps={self.warmup_steps}, "
                f"rows={self._filled}/{self.capacity}, steps={self.steps})")

    @property
    def capacity(self) -> int:
        """Rows the queue holds when full (0 until the first batch fixes it for ``size_batches``)."""
        return 0 if self._embeddings is None else self._embeddings.shape[0]

    def __len__(self) -> int:
        return self._filled

    @property
    def active(self) -> bool:
        """Whether the warm-up is over (references are returned)."""
        return self.steps >= self.warmup_steps and self._filled > 0

    def _allocate(self, rows: int, dim: int) -> None:
        capacity = self.size_items if self.size_items is not None else self.size_batches * rows
        self.dim = dim
        self._embeddings = torch.zeros(capacity, dim, dtype=self.dtype, device=self.device)
        self._labels = torch.zeros(capacity, dtype=torch.int64, device=self.device)

    def enqueue(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Append a batch (detached, copied), overwriting the oldest rows when full."""
        if embeddings.ndim != 2:
            raise ValueError(f"embeddings must be 2-D (rows, dim), got shape {tuple(embeddings.shape)}")
        if labels.shape != (embeddings.shape[0],):
            raise ValueError(f"labels must have shape ({embeddings.shape[0]},), got {tuple(labels.shape)}")
        if self.dim is not None and embeddings.shape[1] != self.dim:
            raise ValueError(f"embeddings have dimension {embeddings.shape[1]}, the memory holds dim={self.dim}")
        if self._embeddings is None:
            self._allocate(embeddings.shape[0], embeddings.shape[1])
        buffer, buffer_labels = self._buffers()
        capacity = buffer.shape[0]
        rows = embeddings.detach()[-capacity:].to(self.device, self.dtype)
        new_labels = labels.detach()[-capacity:].to(self.device, torch.int64)
        positions = (self._pointer + torch.arange(rows.shape[0], device=self.device)) % capacity
        buffer[positions] = rows
        buffer_labels[positions] = new_labels
        self._pointer = (self._pointer + rows.shape[0]) % capacity
        self._filled = min(capacity, self._filled + rows.shape[0])
        self.steps += 1

    def references(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeddings (R, D), labels (R,))`` held, oldest first; empty (R = 0) during the warm-up.

        The tensors are copies with no gradient, so they stay valid while the
        next batch is enqueued.
        """
        if not self.active:
            dim = self.dim or 0
            return (torch.zeros(0, dim, dtype=self.dtype, device=self.device),
                    torch.zeros(0, dtype=torch.int64, device=self.device))
        buffer, buffer_labels = self._buffers()
        order = self._order()
        return buffer[order], buffer_labels[order]

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The allocated embedding and label buffers (allocated by the first :meth:`enqueue`)."""
        if self._embeddings is None or self._labels is None:
            raise RuntimeError("CrossBatchMemory: no batch has been enqueued yet")
        return self._embeddings, self._labels

    def _order(self) -> torch.Tensor:
        """Buffer rows from oldest to newest."""
        if self._filled < self.capacity:
            return torch.arange(self._filled, device=self.device)
        return (self._pointer + torch.arange(self.capacity, device=self.device)) % self.capacity

    def to(self, device: torch.device | str) -> "CrossBatchMemory":
        """Move the buffers (and future allocations) to ``device``; returns self."""
        self.device = torch.device(device)
        if self._embeddings is not None and self._labels is not None:
            self._embeddings = self._embeddings.to(self.device)
            self._labels = self._labels.to(self.device)
        return self

    def state_dict(self) -> dict[str, Any]:
        """Tensors (on the CPU, oldest row first) and plain numbers only: loads with ``weights_only=True``."""
        embeddings, labels = (torch.zeros(0, self.dim or 0, dtype=self.dtype), torch.zeros(0, dtype=torch.int64))
        if self._embeddings is not None and self._labels is not None:
            order = self._order()
            embeddings, labels = self._embeddings[order].cpu(), self._labels[order].cpu()
        return {
            "size_batches": self.size_batches, "size_items": self.size_items, "dim": self.dim,
            "warmup_steps": self.warmup_steps, "capacity": self.capacity, "steps": self.steps,
            "embeddings": embeddings, "labels": labels,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the sizes must match this memory's configuration.

        A different ``warmup_steps`` is taken from the configuration (it only
        decides when references start); a different size is an error, since
        the queue would not hold what the configuration says.
        """
        missing = sorted({"size_batches", "size_items", "dim", "capacity", "steps", "embeddings", "labels"} - set(state))
        if missing:
            raise ValueError(f"memory state is missing {missing}")
        for key in ("size_batches", "size_items"):
            if state[key] != getattr(self, key):
                raise ValueError(f"loss.memory: the checkpoint's memory has {key}={state[key]!r}, "
                                 f"the configuration {key}={getattr(self, key)!r}")
        if self.dim is not None and state["dim"] is not None and state["dim"] != self.dim:
            raise ValueError(f"memory state has dim={state['dim']}, this memory dim={self.dim}")
        embeddings, labels = state["embeddings"], state["labels"]
        rows, capacity = embeddings.shape[0], int(state["capacity"])
        if labels.shape != (rows,) or rows > capacity:
            raise ValueError(f"memory state is inconsistent: {rows} embeddings, labels of shape "
                             f"{tuple(labels.shape)}, capacity {capacity}")
        self.steps = int(state["steps"])
        self.dim = state["dim"]
        self._embeddings = self._labels = None
        self._pointer = self._filled = 0
        if capacity:
            self._embeddings = torch.zeros(capacity, embeddings.shape[1], dtype=self.dtype, device=self.device)
            self._labels = torch.zeros(capacity, dtype=torch.int64, device=self.device)
            self._embeddings[:rows] = embeddings.to(self.device, self.dtype)
            self._labels[:rows] = labels.to(self.device, torch.int64)
            self._filled = rows
            self._pointer = rows % capacity


def build_memory(config: Mapping[str, Any] | Any | None, *, device: torch.device | str = "cpu") -> CrossBatchMemory | None:
    """A :class:`CrossBatchMemory` from ``loss.memory`` (``{size: M, warmup_steps: N}``), or None when it is off.

    ``size`` counts global batches; ``size_items`` (instead of ``size``)
    counts rows. A config object with those attributes works too.
    """
    if config is None:
        return None
    if not isinstance(config, Mapping):
        config = {k: getattr(config, k) for k in ("size", "size_items", "warmup_steps") if hasattr(config, k)}
    unknown = sorted(set(config) - {"size", "size_items", "warmup_steps"})
    if unknown:
        raise ValueError(f"loss.memory: unknown key {unknown[0]!r} (accepted: size, size_items, warmup_steps)")
    size, size_items = config.get("size"), config.get("size_items")
    if (size is None) == (size_items is None):
        raise ValueError(f"loss.memory needs exactly one of size (batches) and size_items (rows), got {dict(config)!r}")
    for key in ("size", "size_items", "warmup_steps"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0
                                  or (value == 0 and key != "warmup_steps")):
            raise ValueError(f"loss.memory.{key} must be a {'non-negative' if key == 'warmup_steps' else 'positive'} "
                             f"int, got {value!r}")
    return CrossBatchMemory(size_batches=size, size_items=size_items,
                            warmup_steps=config.get("warmup_steps", 0) or 0, device=device)

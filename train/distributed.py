"""One backend-neutral interface to the collectives the trainer uses.

Three implementations: Horovod (ring-allreduce via ``hvd.DistributedOptimizer``),
torch.distributed (``DistributedDataParallel``, gloo or nccl) and a single
process. The training loop is written once against :class:`Backend`.

Gradient scale with gathered embeddings: every rank computes the same loss on
the all-gathered batch. Horovod's allgather averages the incoming gradients
in backward and its optimizer averages again across ranks, so the loss is
multiplied by the world size (``gathered_loss_scale``) to give the gradient of
one process holding the global batch. torch's autograd all_gather sums in
backward and DDP averages, which already gives that gradient.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

__all__ = ["Backend", "HorovodBackend", "SingleBackend", "TorchBackend", "make_backend"]


class Backend:
    """Single process: every collective is the identity."""

    name = "none"
    rank = 0
    size = 1
    local_rank = 0
    local_size = 1
    gathered_loss_scale = 1.0

    def allreduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-sized tensors of all ranks along dim 0, keeping gradients."""
        return tensor

    def allgather_numpy(self, row: np.ndarray) -> np.ndarray:
        """``(F,)`` int64 row of every rank as a ``(W, F)`` array (for the sampler check)."""
        return self.allgather(torch.from_numpy(np.ascontiguousarray(row))[None]).numpy()

    def broadcast_object(self, value: Any, root: int = 0) -> Any:
        return value

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Make every rank start from rank 0's parameters and optimizer state."""

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, fp16_allreduce: bool,
             backward_passes_per_step: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        return model, optimizer

    @contextlib.contextmanager
    def accumulating(self, model: nn.Module) -> Iterator[None]:
        """Context for a backward pass whose gradients are not reduced yet."""
        yield

    def sync_batch_norm(self) -> type[nn.Module] | None:
        return None

    def barrier(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


SingleBackend = Backend


class HorovodBackend(Backend):
    """Horovod: ``hvd.init``, ring-allreduce in ``hvd.DistributedOptimizer``."""

    name = "horovod"

    def __init__(self) -> None:
        import horovod.torch as hvd

        hvd.init()
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self.gathered_loss_scale = float(self.size)

    def allreduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.hvd.allreduce(tensor, op=self.hvd.Average)

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.hvd.allgather(tensor)

    def broadcast_object(self, value: Any, root: int = 0) -> Any:
        # An explicit name: the default is the type name, which differs between the
        # sender (a value) and the receivers (None) and would deadlock.
        return self.hvd.broadcast_object(value, root_rank=root, name="pksampler.broadcast_object")

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # With an empty state (a fresh run) Horovod would first take a
        # zero-gradient step to create it, which moves weight-decayed
        # parameters; a fresh state is identical on every rank anyway.
        if optimizer.state_dict()["state"]:
            self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def wrap(self, model, optimizer, *, fp16_allreduce, backward_passes_per_step):
        compression = self.hvd.Compression.fp16 if fp16_allreduce else self.hvd.Compression.none
        optimizer = self.hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression,
            backward_passes_per_step=backward_passes_per_step,
        )
        return model, optimizer

    def sync_batch_norm(self) -> type[nn.Module]:
        return self.hvd.SyncBatchNorm

    def barrier(self) -> None:
        self.hvd.allreduce(torch.zeros(1), name="barrier")

    def shutdown(self) -> None:
        self.hvd.shutdown()


class TorchBackend(Backend):
    """torch.distributed (``torchrun``): gloo on CPU, nccl on GPU, DistributedDataParallel."""

    name = "torch"

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend=backend)
        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.size))

    def allreduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone()
        self.dist.all_reduce(out)
        return out / self.size

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.requires_grad:
            from torch.distributed import _functional_collectives as functional

            # autograd-aware: the backward pass reduce-scatters (sums) the gradients
            gathered = functional.all_gather_tensor_autograd(tensor.contiguous(), 0, self.dist.group.WORLD)
            return functional.wait_tensor(gathered) if hasattr(functional, "wait_tensor") else gathered
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=0)

    def broadcast_object(self, value: Any, root: int = 0) -> Any:
        holder = [value]
        self.dist.broadcast_object_list(holder, src=root)
        return holder[0]

    def broadcast_state(self, model, optimizer) -> None:
        for tensor in model.state_dict().values():
            self.dist.broadcast(tensor, src=0)
        state = self.broadcast_object(optimizer.state_dict() if self.rank == 0 else None)
        optimizer.load_state_dict(state)

    def wrap(self, model, optimizer, *, fp16_allreduce, backward_passes_per_step):
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        if fp16_allreduce:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return wrapped, optimizer

    @contextlib.contextmanager
    def accumulating(self, model: nn.Module) -> Iterator[None]:
        with model.no_sync():
            yield

    def sync_batch_norm(self) -> type[nn.Module]:
        return nn.SyncBatchNorm

    def barrier(self) -> None:
        self.dist.barrier()

    def shutdown(self) -> None:
        self.dist.destroy_process_group()


def _launched_by_horovodrun() -> bool:
    return "HOROVOD_RANK" in os.environ or "HOROVOD_HOSTNAME" in os.environ


def _launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ)


def make_backend(choice: str = "auto") -> Backend:
    """The backend for ``distributed.backend``: auto picks the launcher's runtime.

    ``auto``: Horovod under horovodrun, torch.distributed under torchrun,
    else Horovod with one rank if it imports, else a single process.
    """
    if choice == "horovod" or (choice == "auto" and _launched_by_horovodrun()):
        return HorovodBackend()
    if choice == "torch" or (choice == "auto" and _launched_by_torchrun()):
        return TorchBackend()
    if choice == "none":
        return Backend()
    try:
        return HorovodBackend()
    except ImportError:
        return Backend()

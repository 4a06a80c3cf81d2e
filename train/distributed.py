"""Backends: starting the runtime and wrapping model and optimizer for data parallelism.

Three implementations: Horovod (ring-allreduce via ``hvd.DistributedOptimizer``),
torch.distributed (``DistributedDataParallel``; NCCL on GPUs, gloo on the CPU)
and a single process. Rank queries and collectives are not written here:
every backend delegates them to :mod:`pksampler.comm`, which serves whichever
runtime is initialised.

Gradient scale with gathered embeddings: every rank computes the same loss on
the all-gathered batch. Horovod's allgather averages the incoming gradients
in backward and its optimizer averages again across ranks, so the loss is
multiplied by the world size (``gathered_loss_scale``) to give the gradient of
one process holding the global batch. torch's autograd all_gather sums in
backward and DDP averages, which already gives that gradient. Both hold when
ranks hold different numbers of samples (G not divisible by W): each rank's
parameter gradient is the loss's gradient through its own rows only, the
ranks' parts add up to the whole batch's gradient, and the averaging divides
by W, not by sample counts, so the scale stays W (Horovod) or 1 (torch).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from pksampler import comm

from .device import DeviceSetup, setup_device

__all__ = ["Backend", "HorovodBackend", "TorchBackend", "make_backend"]


class Backend:
    """Single process: every collective is the identity (through :mod:`pksampler.comm`)."""

    name = "none"
    gathered_loss_scale = 1.0

    def __init__(self, device: str = "cpu", precision: str = "fp32", *, setup: DeviceSetup | None = None) -> None:
        self.rank, self.size = comm.world_info()
        self.local_rank = comm.local_rank()
        self.setup: DeviceSetup = setup if setup is not None else setup_device(device, precision, self.local_rank)

    @property
    def device(self) -> torch.device:
        return self.setup.device

    # --- collectives: one implementation, in pksampler.comm ------------------------
    def allreduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return comm.allreduce_mean(tensor)

    def allgather(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """Concatenate the tensors of all ranks along dim 0, keeping gradients; first dims may differ.

        ``sizes``: every rank's first dim, when known (saves torch a small collective).
        """
        return comm.all_gather(tensor, sizes=sizes)

    def allgather_numpy(self, row: np.ndarray) -> np.ndarray:
        """``(F,)`` int64 row of every rank as a ``(W, F)`` array (fingerprints)."""
        return comm.all_gather_numpy(row, device=self.collective_device)

    def broadcast_object(self, value: Any, root: int = 0, *, name: str = "pksampler.broadcast_object") -> Any:
        return comm.broadcast_object(value, root, name=name)

    def barrier(self) -> None:
        comm.barrier()

    @property
    def collective_device(self) -> torch.device | None:
        """Where small tensor collectives must live (NCCL: the rank's GPU)."""
        return None

    # --- data parallelism ------------------------------------------------------------
    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Make every rank start from rank 0's parameters and optimizer state."""

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, fp16_allreduce: bool,
             backward_passes_per_step: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        return model, optimizer

    @contextlib.contextmanager
    def accumulating(self, model: nn.Module) -> Iterator[None]:
        """Context for a backward pass whose gradients are not reduced yet."""
        yield

    def synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        """Finish the gradient allreduce before the gradients are read (fp16 unscaling)."""

    def skip_synchronize(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        """Context for ``optimizer.step()`` after :meth:`synchronize` was called explicitly."""
        return contextlib.nullcontext()

    def sync_batch_norm(self) -> type[nn.Module] | None:
        return None

    def shutdown(self) -> None:
        pass


class HorovodBackend(Backend):
    """Horovod: ``hvd.init``, ring-allreduce in ``hvd.DistributedOptimizer`` (NCCL on GPU builds)."""

    name = "horovod"

    def __init__(self, device: str = "auto", precision: str = "auto") -> None:
        import horovod.torch as hvd

        hvd.init()
        self.hvd = hvd
        super().__init__(device, precision)
        self.gathered_loss_scale = float(self.size)

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

    def synchronize(self, optimizer) -> None:
        optimizer.synchronize()

    def skip_synchronize(self, optimizer):
        return optimizer.skip_synchronize()

    def sync_batch_norm(self) -> type[nn.Module]:
        return self.hvd.SyncBatchNorm

    def shutdown(self) -> None:
        self.hvd.shutdown()


class TorchBackend(Backend):
    """torch.distributed (``torchrun``): NCCL with ``device_ids=[local_rank]`` on GPUs, gloo on the CPU."""

    name = "torch"

    def __init__(self, device: str = "auto", precision: str = "auto") -> None:
        import torch.distributed as dist

        found = comm.launcher_world()
        local = found[2] if found is not None else 0
        setup = setup_device(device, precision, local)  # pin the GPU before NCCL starts
        if not dist.is_initialized():
            if setup.is_cuda:
                dist.init_process_group(backend="nccl", device_id=setup.device)
            else:
                dist.init_process_group(backend="gloo")
        self.dist = dist
        super().__init__(device, precision, setup=setup)

    @property
    def collective_device(self) -> torch.device | None:
        return self.device if self.setup.is_cuda else None

    def broadcast_state(self, model, optimizer) -> None:
        for tensor in model.state_dict().values():
            self.dist.broadcast(tensor, src=0)
        state = self.broadcast_object(optimizer.state_dict() if self.rank == 0 else None,
                                      name="pksampler.optimizer_state")
        optimizer.load_state_dict(state)

    def wrap(self, model, optimizer, *, fp16_allreduce, backward_passes_per_step):
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.setup.is_cuda else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids)
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

    def shutdown(self) -> None:
        self.dist.destroy_process_group()


def _launched_by_horovodrun() -> bool:
    return "HOROVOD_RANK" in os.environ or "HOROVOD_HOSTNAME" in os.environ


def _launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ)


def make_backend(choice: str = "auto", *, device: str = "auto", precision: str = "auto") -> Backend:
    """The backend for ``distributed.backend``: auto picks the launcher's runtime.

    ``auto``: Horovod under horovodrun, torch.distributed under torchrun,
    else Horovod with one rank if it imports, else a single process.
    """
    if choice == "horovod" or (choice == "auto" and _launched_by_horovodrun()):
        return HorovodBackend(device, precision)
    if choice == "torch" or (choice == "auto" and _launched_by_torchrun()):
        return TorchBackend(device, precision)
    if choice == "none":
        return Backend(device, precision)
    try:
        return HorovodBackend(device, precision)
    except ImportError:
        return Backend(device, precision)

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
import dataclasses
import datetime
import os
import re
import sys
import threading
import time
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from pksampler import comm
from pksampler.world import World

from pksampler.train.runtime.device import (DeviceSetup, horovod_cpu_defaults, horovod_elastic_defaults,
                                            setup_device)
from pksampler.train.runtime.horovod_wait import set_horovod_wait, sleeps_in_waits
from pksampler.train.runtime.launch_store import launch_store
from pksampler.train.runtime.process_group import choose_backend

__all__ = ["Backend", "CollectiveTimeout", "HorovodBackend", "TorchBackend", "make_backend"]

#: the longest a torchrun rank waits for its launch's process group to connect (then it exits and is restarted)
_CONNECT_SECONDS = 180.0
#: how often a torchrun rank checks that its launcher is still alive (seconds)
_PARENT_POLL_SECONDS = 1.0
_TIMEOUT_MESSAGE = re.compile(r"timed? ?out|timeout", re.IGNORECASE)


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than ``train.collective_timeout``; the message names the rank(s) behind."""


class Backend(comm.ProcessCollectives):
    """Single process: every collective is the identity (through :mod:`pksampler.comm`).

    A :class:`pksampler.comm.Collectives`: the collectives are inherited from
    :class:`~pksampler.comm.ProcessCollectives`; the world is the backend's own,
    replaced only by :meth:`set_world`."""

    name = "none"
    #: torch.distributed's backend under the process group (``TorchBackend``), None for Horovod and one process
    process_group: str | None = None
    #: whether the gathered batch's loss is multiplied by the world size (Horovod; see the module's docstring)
    scales_gathered_loss = False

    def __init__(self, device: str = "cpu", precision: str = "fp32", *, setup: DeviceSetup | None = None) -> None:
        self._world = World.detect()
        self.setup: DeviceSetup = setup if setup is not None else setup_device(device, precision, self.local_rank)

    # --- the world: one value, replaced whole at a membership change ---------------------
    @property
    def world(self) -> World:
        """This process's :class:`~pksampler.world.World` (rank, size, local rank), with the loss scale of this
        backend's gathered batch (:attr:`gathered_loss_scale`), which a part's gradient divides out."""
        return dataclasses.replace(self._world, loss_scale=self.gathered_loss_scale)

    def set_world(self, world: World) -> None:
        """The world after a membership change (a Horovod elastic reset); rank, size and the loss scale follow.

        The device stays: a process keeps its GPU across a reset.
        """
        if not isinstance(world, World):
            raise TypeError(f"Backend.set_world(world=) expects a pksampler.world.World, got {type(world).__name__}")
        self._world = world

    @property
    def rank(self) -> int:
        return self._world.rank

    @property
    def size(self) -> int:
        return self._world.size

    @property
    def local_rank(self) -> int:
        return self._world.local_rank

    @property
    def local_size(self) -> int:
        """Ranks on this host (they share its memory)."""
        return self._world.local_size

    @property
    def gathered_loss_scale(self) -> float:
        """What the loss of an all-gathered batch is multiplied by: the world size under Horovod, else 1."""
        return float(self._world.size) if self.scales_gathered_loss else 1.0

    @property
    def device(self) -> torch.device:
        return self.setup.device

    # --- data parallelism ------------------------------------------------------------
    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Make every rank start from rank 0's parameters and optimizer state."""

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, fp16_allreduce: bool,
             backward_passes_per_step: int, replicated: Sequence[str] = ()) -> tuple[nn.Module, torch.optim.Optimizer]:
        """``model`` and ``optimizer`` wrapped for data parallelism. ``replicated``: names of the model's tensors
        that every rank computes whole, gradient included (the neck on the gathered batch): DDP leaves them out
        of its averaging; Horovod averages them like the rest (their gradient hook divides by the world size)."""
        return model, optimizer

    @contextlib.contextmanager
    def accumulating(self, model: nn.Module) -> Iterator[None]:
        """Context for a backward pass whose gradients are not reduced yet."""
        yield

    def expect_backward_passes(self, optimizer: torch.optim.Optimizer, passes: int) -> None:
        """Tell the optimizer that ``passes`` backward passes make one step (gradient-cached steps)."""

    def synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        """Finish the gradient allreduce before the gradients are read (fp16 unscaling)."""

    def skip_synchronize(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        """Context for ``optimizer.step()`` after :meth:`synchronize` was called explicitly."""
        return contextlib.nullcontext()

    def sync_batch_norm(self) -> type[nn.Module] | None:
        return None

    def shutdown(self) -> None:
        pass

    def raise_if_timed_out(self, error: BaseException) -> None:
        """Turn a collective's timeout into :class:`CollectiveTimeout` naming the ranks behind (torchrun)."""


def _named_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter]]:
    """The model's named parameters and, named ``loss.<i>`` in group order, the optimizer's others (a loss's own
    parameters, the head's BNNeck): Horovod's optimizer refuses a parameter it cannot name."""
    named = list(model.named_parameters())
    known = {id(parameter) for _, parameter in named}
    others = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in known]
    return named + [(f"loss.{index}", parameter) for index, parameter in enumerate(others)]


class HorovodBackend(Backend):
    """Horovod: ``hvd.init``, ring-allreduce in ``hvd.DistributedOptimizer`` (NCCL on GPU builds)."""

    name = "horovod"
    scales_gathered_loss = True

    def __init__(self, device: str = "auto", precision: str = "auto", *, wait: str = "auto") -> None:
        import horovod.torch as hvd

        horovod_cpu_defaults(device)
        horovod_elastic_defaults()  # survivors and joiners of a reset must agree on every collective
        hvd.init()
        self.hvd = hvd
        super().__init__(device, precision)
        set_horovod_wait("sleep" if sleeps_in_waits(wait, self.device.type) else "spin")

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # With an empty state (a fresh run) Horovod would first take a
        # zero-gradient step to create it, which moves weight-decayed
        # parameters; a fresh state is identical on every rank anyway.
        if optimizer.state_dict()["state"]:
            self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def wrap(self, model, optimizer, *, fp16_allreduce, backward_passes_per_step, replicated=()):
        compression = self.hvd.Compression.fp16 if fp16_allreduce else self.hvd.Compression.none
        optimizer = self.hvd.DistributedOptimizer(
            optimizer, named_parameters=_named_parameters(model, optimizer), compression=compression,
            backward_passes_per_step=backward_passes_per_step,
        )
        return model, optimizer

    def expect_backward_passes(self, optimizer, passes: int) -> None:
        """Horovod's optimizer counts backward passes per parameter and allreduces at the count it was built
        with; a gradient-cached step makes one pass per chunk, a number that changes with the rank's batch."""
        if optimizer.backward_passes_per_step != passes:
            optimizer.set_backward_passes_per_step(passes)

    def synchronize(self, optimizer) -> None:
        optimizer.synchronize()

    def skip_synchronize(self, optimizer):
        return optimizer.skip_synchronize()

    def sync_batch_norm(self) -> type[nn.Module]:
        return self.hvd.SyncBatchNorm

    def shutdown(self) -> None:
        self.hvd.shutdown()


class TorchBackend(Backend):
    """torch.distributed (``torchrun``): NCCL with ``device_ids=[local_rank]`` on GPUs, gloo on the CPU, or the
    platform's ``BACKEND`` (:mod:`.process_group`)."""

    name = "torch"
    process_group: str | None = "gloo"

    def __init__(self, device: str = "auto", precision: str = "auto", *, collective_timeout: float = 300.0) -> None:
        import torch.distributed as dist

        found = comm.launcher_world()
        local = found[2] if found is not None else 0
        setup = setup_device(device, precision, local)  # pin the GPU before NCCL starts
        if not dist.is_initialized():
            self.process_group = choose_backend(setup.device, os.environ, dist=dist)
            _init_process_group(dist, self.process_group, setup, collective_timeout)
        else:
            self.process_group = str(dist.get_backend())
        self.dist = dist
        super().__init__(device, precision, setup=setup)
        self.collective_timeout = collective_timeout
        self._collectives = 0
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            self._store = None
        if "TORCHELASTIC_RUN_ID" in os.environ:
            _exit_with_launcher(self.rank)

    # --- progress marks: which rank reached how many collectives (read after a timeout) ---
    def _mark(self) -> None:
        self._collectives += 1
        if self._store is not None:
            self._store.set(f"pksampler/collectives/{self.rank}", str(self._collectives))

    def allreduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        self._mark()
        return super().allreduce_mean(tensor)

    def allgather(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        self._mark()
        return super().allgather(tensor, sizes)

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self._mark()
        return super().allreduce_sum(tensor)

    def allgather_numpy(self, row: np.ndarray) -> np.ndarray:
        self._mark()
        return super().allgather_numpy(row)

    def barrier(self) -> None:
        self._mark()
        super().barrier()

    def raise_if_timed_out(self, error: BaseException) -> None:
        if not _TIMEOUT_MESSAGE.search(str(error)):
            return
        counts = self._progress()
        behind = sorted(r for r, c in counts.items() if c < max(counts.values()))
        who = (f"rank(s) {behind} stopped responding (collectives reached per rank: {counts})" if behind
               else "every rank reached as many collectives; one stopped inside the gradient allreduce")
        raise CollectiveTimeout(
            f"rank {self.rank}: a collective waited longer than train.collective_timeout={self.collective_timeout:g} s "
            f"for the other ranks; {who}. The job ends; resume from the last checkpoint "
            f"({str(error).splitlines()[0][:200]})") from None

    def _progress(self) -> dict[int, int]:
        counts = {}
        for rank in range(self.size):
            key = f"pksampler/collectives/{rank}"
            try:
                counts[rank] = int(self._store.get(key)) if self._store is not None and self._store.check([key]) else 0
            except RuntimeError:
                counts[rank] = 0
        return counts

    @property
    def collective_device(self) -> torch.device | None:
        return self.device if self.process_group == "nccl" else None

    def broadcast_state(self, model, optimizer) -> None:
        for tensor in model.state_dict().values():
            self.dist.broadcast(tensor, src=0)
        state = self.broadcast_object(optimizer.state_dict() if self.rank == 0 else None,
                                      name="pksampler.optimizer_state")
        optimizer.load_state_dict(state)

    def wrap(self, model, optimizer, *, fp16_allreduce, backward_passes_per_step, replicated=()):
        from torch.nn.parallel import DistributedDataParallel

        if replicated:  # used outside DDP's forward, the same on every rank: no bucket may wait for them
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(replicated))
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


def _init_process_group(dist: Any, backend: str, setup: DeviceSetup, collective_timeout: float) -> None:
    """``init_process_group`` on a store of this launch's own under torchrun (:mod:`.launch_store`: the agent's
    shared store keeps the last launch's gloo addresses and NCCL id), its first connect bounded by
    ``_CONNECT_SECONDS`` so a stall becomes a restart; the collectives then wait ``collective_timeout``."""
    connect = min(collective_timeout, _CONNECT_SECONDS)
    rank = int(os.environ.get("RANK", "0"))
    store = launch_store(rank, connect_seconds=connect)
    options: dict[str, Any] = {"device_id": setup.device} if backend == "nccl" else {}
    if store is None or backend == "mpi":  # MPI meets through its own launcher, not a store
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=collective_timeout), **options)
        return
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=connect), **options)
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=collective_timeout))


def _exit_with_launcher(rank: int) -> None:
    """End this rank when its launcher (the torchrun agent, our parent) dies, e.g. killed with SIGKILL.

    A daemon thread polls the parent pid; once the process is re-parented, the
    agent is gone and nothing would stop the rank: it says so and exits.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_SECONDS)
        print(f"[pksampler] rank {rank}: the launcher (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="pksampler-launcher-watch", daemon=True).start()


def make_backend(choice: str = "auto", *, device: str = "auto", precision: str = "auto",
                 collective_timeout: float = 300.0, horovod_wait: str = "auto") -> Backend:
    """The backend for ``distributed.backend``: auto picks the launcher's runtime.

    ``auto``: Horovod under horovodrun, torch.distributed under torchrun,
    else Horovod with one rank if it imports, else a single process.
    ``horovod_wait``: ``distributed.horovod_wait`` (:mod:`.horovod_wait`).
    """
    if choice == "horovod" or (choice == "auto" and comm.launcher() == "horovodrun"):
        return HorovodBackend(device, precision, wait=horovod_wait)
    if choice == "torch" or (choice == "auto" and comm.launcher() == "torchrun"):
        return TorchBackend(device, precision, collective_timeout=collective_timeout)
    if choice == "none":
        return Backend(device, precision)
    try:
        return HorovodBackend(device, precision, wait=horovod_wait)
    except ImportError:
        return Backend(device, precision)

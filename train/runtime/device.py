"""Where a rank computes and in which precision.

``train.device``: ``auto`` (the rank's GPU when CUDA is available, else the
CPU), ``cpu`` or ``cuda``. On CUDA the rank's GPU is ``cuda:<local_rank>``,
batches arrive through pinned memory with ``non_blocking`` copies and the
model runs ``channels_last``.

``train.precision``: ``auto`` (bf16 on GPUs that support it, else fp16 on
CUDA; fp32 on the CPU), ``fp32``, ``bf16`` (autocast, no scaler) or ``fp16``
(autocast with a GradScaler, CUDA only). Embeddings are cast back to fp32
before they are gathered, so the loss and its mining see full precision.

``train.deterministic``: a run that repeats bit for bit, on any split of its
ranks over hosts. :func:`make_deterministic` runs before the runtime starts:
Horovod's tensor fusion is turned off (``HOROVOD_FUSION_THRESHOLD=0``, which
Horovod reads at ``hvd.init``; a fused buffer sums tensors in the order they
happened to become ready, so two runs differ in the last bits and the
difference grows), its autotuner too (it would re-enable fusion), and torch
uses deterministic kernels only. The training loader's workers draw no random
numbers (augmentation runs on the device, keyed by (seed, epoch, sample
index)); a per-epoch DataLoader (a trainer built without a
:class:`~.loader.TrainLoader`) seeds its workers with :func:`loader_generator`,
keyed by (seed, epoch, rank), instead of the process's global RNG.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, ContextManager

import numpy as np
import torch

from pksampler.train.errors import ConfigError

__all__ = ["DeviceSetup", "horovod_elastic_defaults", "loader_generator", "make_deterministic", "resolve_device",
           "resolve_precision", "setup_device"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DeviceSetup:
    """The rank's device and precision, and the helpers the step needs for them."""

    device: torch.device
    precision: str  # fp32 | bf16 | fp16

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.is_cuda else torch.contiguous_format

    @property
    def pin_memory(self) -> bool:
        return self.is_cuda

    def autocast(self) -> ContextManager:
        """Autocast for the forward pass (a no-op in fp32)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=_DTYPES[self.precision])

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """A GradScaler for fp16 (gradients would underflow without one); None otherwise."""
        return torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None

    def to_device(self, images: torch.Tensor) -> torch.Tensor:
        """A batch on the rank's device, in the model's memory format."""
        if not self.is_cuda:
            return images
        return images.to(self.device, non_blocking=True, memory_format=self.memory_format)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device, memory_format=self.memory_format) if self.is_cuda else model


def resolve_device(choice: str, local_rank: int, *, cuda_available: bool | None = None,
                   cuda_count: int | None = None) -> torch.device:
    """The device ``train.device`` names for the process with ``local_rank``."""
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if choice == "cpu" or (choice == "auto" and not available):
        return torch.device("cpu")
    if not available:
        raise ConfigError("train.device: 'cuda' was asked for but torch sees no CUDA device "
                          f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); use 'cpu' or 'auto'")
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if local_rank >= count:
        raise ConfigError(f"train.device: local rank {local_rank} has no GPU of its own ({count} visible); "
                          "start at most one process per GPU on each node")
    return torch.device("cuda", local_rank)


def resolve_precision(choice: str, device: torch.device, *,
                      bf16_supported: Callable[[], bool] | None = None) -> str:
    """The precision ``train.precision`` means on ``device``."""
    if device.type != "cuda":
        if choice == "fp16":
            raise ConfigError("train.precision: 'fp16' needs a CUDA device (use 'bf16' or 'fp32' on the CPU)")
        return "fp32" if choice == "auto" else choice
    if choice != "auto":
        return choice
    supported = bf16_supported if bf16_supported is not None else torch.cuda.is_bf16_supported
    return "bf16" if supported() else "fp16"


def setup_device(device_choice: str, precision_choice: str, local_rank: int) -> DeviceSetup:
    """Resolve both choices and pin the process to its GPU (``torch.cuda.set_device``) on CUDA."""
    device = resolve_device(device_choice, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return DeviceSetup(device, resolve_precision(precision_choice, device))


#: environment a deterministic run needs before Horovod and CUDA start
DETERMINISTIC_ENVIRONMENT = {
    "HOROVOD_FUSION_THRESHOLD": "0",  # one allreduce per tensor, always in the same order
    "HOROVOD_AUTOTUNE": "0",  # the autotuner varies the fusion threshold
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # cuBLAS refuses deterministic mode without it
}


#: Horovod's coordination cycle (ms) on CPU-only runs when ``HOROVOD_CYCLE_TIME`` is not set
CPU_CYCLE_TIME_MS = "10"


def horovod_cpu_defaults(device_choice: str, environ: dict[str, str] | None = None, *,
                         cuda_available: bool | None = None) -> None:
    """A 10 ms Horovod cycle on CPU-only runs unless the environment sets one; call before ``hvd.init``.

    Horovod's background thread runs a Gloo exchange every cycle (1 ms by
    default) even when idle; where each rank has one core, that time comes out
    of the compute threads (README "Scaling": ``-np 2`` on 2 cores 1.33x the
    images/s of one process at 1 ms, 1.59x at 10 ms). GPU runs keep Horovod's default.
    """
    environ = os.environ if environ is None else environ
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if device_choice == "cpu" or (device_choice == "auto" and not cuda):
        environ.setdefault("HOROVOD_CYCLE_TIME", CPU_CYCLE_TIME_MS)


def horovod_elastic_defaults(environ: dict[str, str] | None = None) -> None:
    """Horovod's response cache off in a Horovod elastic worker (``HOROVOD_ELASTIC=1``); call before ``hvd.init``.

    With the cache on (Horovod's default, 1024 entries), collectives that ran
    before skip rank 0's negotiation: the ranks agree on a bit vector whose
    positions name cached responses and fuse those locally. After a host is
    added, survivors and joiners submit the same collectives in the same
    order, yet from the second step of the new world, the first that uses
    cached responses, they execute different ones and Gloo aborts on both
    sides (``op.preamble.length <= op.nbytes``, issue 27; Horovod 0.28.1).
    Without the cache rank 0 negotiates every collective, which costs one
    more small exchange per cycle. Set even over the user's value: with the
    cache on, adding a host ends the job.
    """
    environ = os.environ if environ is None else environ
    if environ.get("HOROVOD_ELASTIC", "0") == "1":
        environ["HOROVOD_CACHE_CAPACITY"] = "0"


def make_deterministic(environ: dict[str, str] | None = None) -> None:
    """Make this process's training repeat bit for bit; call before the backend starts.

    Sets :data:`DETERMINISTIC_ENVIRONMENT` and ``torch.use_deterministic_algorithms``
    (an op without a deterministic kernel then raises, naming itself, rather
    than silently varying), cuDNN without benchmarking. Horovod reads its
    fusion settings once, in ``hvd.init``: if it is already running with
    fusion on, this raises ConfigError rather than promise what it cannot keep.
    """
    environ = os.environ if environ is None else environ
    from pksampler.comm import initialised_horovod

    if initialised_horovod() is not None and environ.get("HOROVOD_FUSION_THRESHOLD") != "0":
        raise ConfigError("train.deterministic: Horovod was started with tensor fusion on "
                          f"(HOROVOD_FUSION_THRESHOLD={environ.get('HOROVOD_FUSION_THRESHOLD')!r}); set "
                          "HOROVOD_FUSION_THRESHOLD=0 before hvd.init, or train.deterministic=false")
    environ.update(DETERMINISTIC_ENVIRONMENT)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def loader_generator(seed: int, epoch: int, rank: int) -> torch.Generator:
    """The generator a rank's DataLoader draws its workers' seeds from, keyed by (seed, epoch, rank).

    Each worker seeds ``torch``, ``random`` and ``numpy`` from it, so a
    transform that uses a global RNG still repeats, and a resumed run draws
    what the uninterrupted one drew in that epoch.
    """
    key = np.random.SeedSequence([seed, epoch, rank, 0x10AD]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(key[0]) << 32 | int(key[1]))

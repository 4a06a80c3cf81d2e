"""Where a rank computes and in which precision.

``train.device``: ``auto`` (the rank's GPU when CUDA is available, else the
CPU), ``cpu`` or ``cuda``. On CUDA the rank's GPU is ``cuda:<local_rank>``,
batches arrive through pinned memory with ``non_blocking`` copies and the
model runs ``channels_last``.

``train.precision``: ``auto`` (bf16 on GPUs that support it, else fp16 on
CUDA; fp32 on the CPU), ``fp32``, ``bf16`` (autocast, no scaler) or ``fp16``
(autocast with a GradScaler, CUDA only). Embeddings are cast back to fp32
before they are gathered, so the loss and its mining see full precision.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from .rules import ConfigError

__all__ = ["DeviceSetup", "resolve_device", "resolve_precision", "setup_device"]

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

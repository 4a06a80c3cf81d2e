"""Which torch.distributed backend the process group uses: the platform's ``BACKEND``, else the device's own.

A training platform sets ``BACKEND`` for the device type it gives the job
(``nccl`` for GPUs, ``gloo`` for CPUs); its sample script reads
``os.getenv("BACKEND", "nccl")``. Here an unset ``BACKEND`` means NCCL on a
GPU and gloo on the CPU, and a set one is honoured, or refused in one line
before any process group starts when it cannot work in this process: an
unknown name, NCCL without a CUDA device, a backend this torch was built
without. Horovod does not read it: it uses the transport it was built with.

Example::

    >>> choose_backend(torch.device("cpu"), {"BACKEND": "gloo"})
    'gloo'
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from pksampler.train.errors import ConfigError

__all__ = ["PROCESS_GROUP_BACKENDS", "choose_backend"]

#: the values ``BACKEND`` may take: torch.distributed's backends
PROCESS_GROUP_BACKENDS = ("gloo", "nccl", "mpi")


def choose_backend(device: torch.device, environ: Mapping[str, str], *, dist: Any = None) -> str:
    """The process group's backend for a rank on ``device``: ``BACKEND`` from ``environ`` when set, else ``nccl``
    on CUDA and ``gloo`` elsewhere. Raises ConfigError naming ``BACKEND``, its value and the rule."""
    if dist is None:
        import torch.distributed as dist
    value = environ.get("BACKEND", "").strip()
    if not value:
        return "nccl" if device.type == "cuda" else "gloo"
    name = value.lower()
    where = f"environment variable BACKEND={value!r}"
    if name not in PROCESS_GROUP_BACKENDS:
        raise ConfigError(f"{where}: must be one of {list(PROCESS_GROUP_BACKENDS)} (torch.distributed's backend)")
    if name == "nccl" and device.type != "cuda":
        raise ConfigError(f"{where} needs a CUDA GPU, but this rank runs on {device} (CUDA available: "
                          f"{torch.cuda.is_available()}); set BACKEND=gloo for CPUs")
    available = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available}
    if not available[name]():
        raise ConfigError(f"{where}: this torch {torch.__version__} was built without {name}; use one of "
                          f"{[b for b in PROCESS_GROUP_BACKENDS if available[b]()]}")
    return name

"""BACKEND: torch.distributed's backend as the platform chose it, or one line saying why it cannot be."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pksampler.train.errors import ConfigError
from pksampler.train.runtime.process_group import choose_backend

CPU, GPU = torch.device("cpu"), torch.device("cuda", 1)
#: a torch built with every backend, to check the choice on a GPU rank without one
EVERY = SimpleNamespace(is_gloo_available=lambda: True, is_nccl_available=lambda: True, is_mpi_available=lambda: True)


def test_unset_is_the_devices_own_and_a_set_value_is_honoured():
    assert choose_backend(CPU, {}) == "gloo" and choose_backend(GPU, {}, dist=EVERY) == "nccl"
    assert choose_backend(CPU, {"BACKEND": " "}) == "gloo"
    assert choose_backend(CPU, {"BACKEND": "gloo"}) == "gloo"
    assert choose_backend(GPU, {"BACKEND": "GLOO"}, dist=EVERY) == "gloo"  # gloo on a GPU rank is the user's choice
    assert choose_backend(GPU, {"BACKEND": "nccl"}, dist=EVERY) == "nccl"
    assert choose_backend(CPU, {"BACKEND": "mpi"}, dist=EVERY) == "mpi"


@pytest.mark.parametrize("value, message", [
    ("nccl", r"environment variable BACKEND='nccl' needs a CUDA GPU, but this rank runs on cpu .* set BACKEND=gloo"),
    ("ucc", r"environment variable BACKEND='ucc': must be one of \['gloo', 'nccl', 'mpi'\]"),
    ("horovod", r"BACKEND='horovod': must be one of"),
])
def test_what_cannot_work_is_one_line_naming_backend(value, message):
    with pytest.raises(ConfigError, match=message) as caught:
        choose_backend(CPU, {"BACKEND": value})
    assert "\n" not in str(caught.value)


def test_a_backend_this_torch_lacks_is_named():
    if dist.is_mpi_available():  # the CPU wheel has no MPI; a build with it needs no message
        assert choose_backend(CPU, {"BACKEND": "mpi"}) == "mpi"
        return
    with pytest.raises(ConfigError, match=r"BACKEND='mpi': this torch .* was built without mpi; use one of "
                                          r"\['gloo'"):
        choose_backend(CPU, {"BACKEND": "mpi"})

"""Device and precision resolution: every branch that needs no GPU, on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from pksampler.train.config.load import ConfigError
from pksampler.train.runtime.device import DeviceSetup, resolve_device, resolve_precision


def test_auto_uses_the_local_ranks_gpu_when_there_is_one():
    assert resolve_device("auto", 0, cuda_available=False) == torch.device("cpu")
    assert resolve_device("auto", 3, cuda_available=True, cuda_count=8) == torch.device("cuda", 3)
    assert resolve_device("cpu", 3, cuda_available=True, cuda_count=8) == torch.device("cpu")


def test_cuda_without_a_gpu_or_a_rank_without_its_own_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match=r"train.device: 'cuda' was asked for but torch sees no CUDA device"):
        resolve_device("cuda", 0, cuda_available=False)
    with pytest.raises(ConfigError, match=r"train.device: local rank 2 has no GPU of its own \(2 visible\)"):
        resolve_device("cuda", 2, cuda_available=True, cuda_count=2)


@pytest.mark.parametrize("choice, supported, expected", [
    ("auto", True, "bf16"), ("auto", False, "fp16"), ("fp32", True, "fp32"), ("fp16", True, "fp16"),
])
def test_precision_on_cuda(choice, supported, expected):
    assert resolve_precision(choice, torch.device("cuda", 0), bf16_supported=lambda: supported) == expected


def test_precision_on_the_cpu():
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == "fp32" and resolve_precision("bf16", cpu) == "bf16"
    with pytest.raises(ConfigError, match=r"train.precision: 'fp16' needs a CUDA device"):
        resolve_precision("fp16", cpu)


def test_cpu_setup_keeps_tensors_where_they_are_and_autocasts_bf16():
    fp32 = DeviceSetup(torch.device("cpu"), "fp32")
    images = torch.randn(2, 3, 8, 8)
    assert fp32.to_device(images) is images and not fp32.pin_memory and fp32.grad_scaler() is None
    assert fp32.memory_format == torch.contiguous_format
    layer = torch.nn.Linear(4, 4)
    with fp32.autocast():
        assert layer(torch.randn(2, 4)).dtype == torch.float32
    bf16 = DeviceSetup(torch.device("cpu"), "bf16")
    with bf16.autocast():
        assert layer(torch.randn(2, 4)).dtype == torch.bfloat16
    assert bf16.grad_scaler() is None


def test_cuda_setup_asks_for_pinned_memory_channels_last_and_an_fp16_scaler():
    setup = DeviceSetup(torch.device("cuda", 0), "fp16")
    assert setup.is_cuda and setup.pin_memory and setup.memory_format == torch.channels_last
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without a GPU torch disables the scaler, with a warning
        assert isinstance(setup.grad_scaler(), torch.amp.GradScaler)


def test_deterministic_mode_turns_fusion_off_before_horovod_starts_and_torch_to_deterministic_kernels():
    from pksampler.train.runtime.device import make_deterministic

    environ = {"HOROVOD_FUSION_THRESHOLD": str(64 << 20)}
    try:
        make_deterministic(environ)
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
    assert environ == {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_AUTOTUNE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


class _GlobalRandom(torch.utils.data.Dataset):
    """Draws from the worker's global torch RNG, as a careless transform would."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.rand(1)


def test_loader_workers_draw_seeds_keyed_by_seed_epoch_and_rank():
    from pksampler.train.runtime.device import loader_generator

    def draws(seed, epoch, rank):
        torch.manual_seed(1234 + epoch)  # the process's global RNG must not matter
        loader = torch.utils.data.DataLoader(_GlobalRandom(), batch_size=2, num_workers=1,
                                             generator=loader_generator(seed, epoch, rank))
        return torch.cat(list(loader))

    first = draws(0, 1, 0)
    assert torch.equal(first, draws(0, 1, 0))
    assert not torch.equal(first, draws(0, 2, 0)) and not torch.equal(first, draws(0, 1, 1))


def test_deterministic_is_true_or_false():
    from pksampler.train.config.load import load_config

    assert load_config(None, ["train.deterministic=true"], environ={}).train.deterministic is True
    with pytest.raises(ConfigError, match=r"train.deterministic: expected true or false, got 'maybe'"):
        load_config(None, ["train.deterministic=maybe"], environ={})


def test_cpu_runs_get_a_10_ms_horovod_cycle_unless_the_environment_sets_one():
    from pksampler.train.runtime.device import horovod_cpu_defaults

    for choice, cuda, expected in [("auto", False, "10"), ("cpu", True, "10"), ("auto", True, None), ("cuda", True, None)]:
        environ: dict[str, str] = {}
        horovod_cpu_defaults(choice, environ, cuda_available=cuda)
        assert environ.get("HOROVOD_CYCLE_TIME") == expected, (choice, cuda)
    environ = {"HOROVOD_CYCLE_TIME": "2"}
    horovod_cpu_defaults("cpu", environ)
    assert environ == {"HOROVOD_CYCLE_TIME": "2"}


def test_horovod_elastic_workers_run_without_the_response_cache():
    # Issue 27: with the cache on, survivors and joiners of a reset executed different collectives
    from pksampler.train.runtime.device import horovod_elastic_defaults

    for environ, expected in [({"HOROVOD_ELASTIC": "1"}, "0"), ({"HOROVOD_ELASTIC": "1", "HOROVOD_CACHE_CAPACITY": "9"}, "0"),
                              ({}, None), ({"HOROVOD_ELASTIC": "0", "HOROVOD_CACHE_CAPACITY": "64"}, "64")]:
        horovod_elastic_defaults(environ)
        assert environ.get("HOROVOD_CACHE_CAPACITY") == expected, environ

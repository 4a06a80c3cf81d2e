"""Rank/world detection and the cross-rank consistency check, simulated in one process."""

from __future__ import annotations

import numpy as np
import pytest

from pksampler.samplers import (
    DistributedBalancedBatchSampler,
    SamplerMismatchError,
    check_consistent,
    consistency_row,
    world_info,
)


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({}, (0, 1)),
        ({"RANK": "3", "WORLD_SIZE": "8"}, (3, 8)),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "RANK": "3", "WORLD_SIZE": "8"}, (1, 4)),
        ({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}, (2, 16)),
    ],
)
def test_world_info_reads_launcher_environment_in_order(monkeypatch, environment, expected):
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    assert world_info() == expected


def test_explicit_arguments_win_and_detected_rank_is_checked(monkeypatch):
    monkeypatch.setenv("HOROVOD_RANK", "1")
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    labels = np.arange(100) % 10
    detected = DistributedBalancedBatchSampler(labels, 2, 2)
    assert (detected.rank, detected.num_replicas) == (1, 2)
    explicit = DistributedBalancedBatchSampler(labels, 2, 2, num_replicas=4, rank=3)
    assert (explicit.rank, explicit.num_replicas) == (3, 4)
    monkeypatch.setenv("HOROVOD_RANK", "five")
    with pytest.raises(ValueError, match=r"HOROVOD_RANK='five'.*must be integers"):
        world_info()


def simulated_allgather(samplers):
    rows = np.stack([consistency_row(s) for s in samplers])
    return lambda row: rows


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"labels": np.arange(200) % 21}, "labels"),
        ({"samples_per_class": 3}, "plan"),
        ({"seed": 5}, "seed"),
    ],
)
def test_mismatch_raises_the_same_error_on_every_rank(change, field):
    base = {"labels": np.arange(200) % 20, "classes_per_batch": 2, "samples_per_class": 2, "num_replicas": 2}
    samplers = [DistributedBalancedBatchSampler(**{**base, "rank": 0}),
                DistributedBalancedBatchSampler(**{**base, **change, "rank": 1})]
    gather = simulated_allgather(samplers)
    messages = []
    for sampler in samplers:
        with pytest.raises(SamplerMismatchError, match=f"{field} differs") as caught:
            check_consistent(sampler, allgather=gather)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


def test_epoch_mismatch_and_consistent_ranks():
    labels = np.arange(200) % 20
    samplers = [DistributedBalancedBatchSampler(labels, 2, 2, num_replicas=2, rank=r) for r in range(2)]
    for sampler in samplers:
        check_consistent(sampler, allgather=simulated_allgather(samplers))  # agree: no error
    samplers[1].set_epoch(1)
    with pytest.raises(SamplerMismatchError, match=r"epoch differs \(ranks \[0\]: 0; ranks \[1\]: 1\)"):
        check_consistent(samplers[0], allgather=simulated_allgather(samplers))
    with pytest.raises(SamplerMismatchError, match="3 processes took part"):
        check_consistent(samplers[0], allgather=lambda row: np.stack([row] * 3))


@pytest.mark.parametrize(("environ", "expected"), [
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, "horovodrun"),
    ({"HOROVOD_HOSTNAME": "localhost"}, "horovodrun"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2"}, "torchrun"),
    ({"RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, None),  # a bare RANK is not a launcher
    ({}, None),
])
def test_one_launcher_detector_for_the_samplers_and_the_trainer(environ, expected):
    from pksampler import comm

    assert comm.launcher(environ) == expected


def test_a_rank_that_is_not_the_process_rank_raises_on_every_rank():
    labels = np.arange(200) % 20
    samplers = [DistributedBalancedBatchSampler(labels, 2, 2, num_replicas=2, rank=0) for _ in range(2)]
    for sampler in samplers:  # both processes built rank 0: every batch would be trained twice
        with pytest.raises(SamplerMismatchError, match=r"sampler ranks do not match the process group "
                                                       r"\(process 1 has rank=0\)"):
            check_consistent(sampler, allgather=simulated_allgather(samplers))

"""The sampler inside frameworks, in one process: whole-epoch ``len``, ``set_epoch`` reachable, loud wrappers.

The wrappers here are the frameworks' own classes (Lightning's
``DistributedSamplerWrapper``, Accelerate's ``BatchSamplerShard``), built for
rank 0 of 2 without a process group; tests/frameworks/ runs the same cases
with real processes.
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np
import pytest
import torch

from pksampler.samplers import DistributedBalancedBatchSampler, DistributedBalancedSampler, SamplerSetupError
from pksampler.samplers import world_info

LABELS = np.arange(400) % 40


def test_len_is_the_whole_epoch_and_a_resumed_iterator_starts_at_the_saved_step():
    sampler = DistributedBalancedBatchSampler(LABELS, 4, 2, num_replicas=2, rank=1, seed=3)
    sampler.set_epoch(2)
    full = list(sampler)
    assert len(sampler) == len(full) == sampler.num_batches
    resumed = DistributedBalancedBatchSampler(LABELS, 4, 2, num_replicas=2, rank=1)
    resumed.load_state_dict(sampler.state_dict(batches_consumed=3))
    assert len(resumed) == len(full) and list(resumed) == full[3:]
    flat = DistributedBalancedSampler(LABELS, 4, 2, num_replicas=2, rank=1)
    flat.load_state_dict(sampler.state_dict(batches_consumed=3))
    assert len(flat) == len(full) * flat.batch_size and list(flat) == [i for b in full[3:] for i in b]


def test_the_batch_form_exposes_set_epoch_where_frameworks_look():
    sampler = DistributedBalancedBatchSampler(LABELS, 4, 2, num_replicas=2, rank=0)
    handle = sampler.sampler
    assert not hasattr(handle, "sampler")  # no .sampler chain for frameworks to walk
    handle.set_epoch(5)
    assert sampler.epoch == 5 and len(handle) == len(sampler) * sampler.batch_size
    from torch.utils.data import DataLoader

    loader = DataLoader(range(400), batch_sampler=sampler)
    getattr(loader.batch_sampler, "sampler").set_epoch(6)  # what Lightning's _set_sampler_epoch does
    assert sampler.epoch == 6


def test_lightning_distributed_sampler_wrapper_is_refused_in_one_line():
    from lightning.fabric.utilities import distributed as wrapper_module

    sampler = DistributedBalancedSampler(LABELS, 4, 2, num_replicas=2, rank=0)
    wrapped = wrapper_module.DistributedSamplerWrapper(sampler, num_replicas=2, rank=0, shuffle=True)
    with pytest.raises(SamplerSetupError, match=r"^DistributedBalancedSampler is used through "
                       r"Lightning's DistributedSamplerWrapper \(Trainer\(use_distributed_sampler=True\), the "
                       r"default\), which re-shards .* pass Trainer\(use_distributed_sampler=False\)") as caught:
        list(wrapped)
    assert "\n" not in str(caught.value)
    assert len(list(sampler)) == len(sampler)  # iterated directly it runs


@pytest.mark.parametrize("split_batches", [False, True])
def test_accelerate_batch_sampler_shard_is_refused(split_batches):
    from accelerate import data_loader

    sampler = DistributedBalancedBatchSampler(LABELS, 4, 2, num_replicas=2, rank=0)
    shard = data_loader.BatchSamplerShard(sampler, num_processes=2, process_index=0, split_batches=split_batches)
    with pytest.raises(SamplerSetupError, match=r"Accelerate's BatchSamplerShard \(accelerator\.prepare\(loader\)\).*"
                                                r"leave the DataLoader out of accelerator\.prepare"):
        next(iter(shard))


def test_lightning_children_environment_gives_the_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "0")
    assert world_info() == (1, 2)
    sampler = DistributedBalancedBatchSampler(LABELS, 4, 2)
    assert (sampler.rank, sampler.num_replicas) == (1, 2)
    monkeypatch.setenv("NODE_RANK", "1")
    with pytest.raises(ValueError, match=r"NODE_RANK=1 and LOCAL_RANK=1 but no RANK or LOCAL_WORLD_SIZE"):
        world_info()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert world_info() == (3, 4)


def test_a_world_size_without_a_rank_is_refused_not_taken_as_one_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"num_replicas=None\) detected one process, but the environment says "
                                         r"WORLD_SIZE=2 and gives no rank"):
        DistributedBalancedBatchSampler(LABELS, 4, 2)
    DistributedBalancedBatchSampler(LABELS, 4, 2, num_replicas=1, rank=0)  # explicit values are trusted


def test_a_world_detected_before_the_launcher_spoke_is_refused_when_iterated(monkeypatch):
    sampler = DistributedBalancedBatchSampler(LABELS, 4, 2)  # detects rank 0 of 1
    assert (sampler.rank, sampler.num_replicas) == (0, 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SamplerSetupError, match=r"detected rank 0 of num_replicas=1 when it was built, but the "
                                                r"launcher's environment now says rank 0 of 2"):
        iter(sampler)
    explicit = DistributedBalancedBatchSampler(LABELS, 4, 2, num_replicas=1, rank=0)
    assert len(list(explicit)) == len(explicit)


class _DatasetFromSampler(torch.utils.data.Dataset):
    """catalyst 21.5's ``catalyst.data.dataset.torch.DatasetFromSampler``, copied faithfully (catalyst does not
    import on Python 3.11: ``collections.MutableMapping``)."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.sampler_list = None

    def __getitem__(self, index: int):
        if self.sampler_list is None:
            self.sampler_list = list(self.sampler)
        return self.sampler_list[index]

    def __len__(self) -> int:
        return len(self.sampler)


class CatalystDistributedSamplerWrapper(torch.utils.data.DistributedSampler):
    """catalyst 21.5's ``catalyst.data.sampler.DistributedSamplerWrapper``, its iteration copied faithfully."""

    def __init__(self, sampler, num_replicas=None, rank=None, shuffle=True):
        super().__init__(_DatasetFromSampler(sampler), num_replicas=num_replicas, rank=rank, shuffle=shuffle)
        self.sampler = sampler

    def __iter__(self):
        self.dataset = _DatasetFromSampler(self.sampler)
        indexes_of_indexes = super().__iter__()
        return iter(itemgetter(*indexes_of_indexes)(self.dataset))


CatalystDistributedSamplerWrapper.__module__ = "tests.catalyst_copy"  # not catalyst's: found by its behaviour


def test_ignite_proxy_and_a_catalyst_style_wrapper_are_refused_by_what_they_do():
    """Before: both re-sharded silently (half the indices, batches no longer P x K)."""
    from ignite.distributed.auto import DistributedProxySampler

    sampler = DistributedBalancedSampler(LABELS, 4, 2, num_replicas=2, rank=0)
    with pytest.raises(SamplerSetupError, match=r"^DistributedBalancedSampler is used through pytorch-ignite's "
                                                r"DistributedProxySampler \(idist.auto_dataloader\(\.\.\., sampler=\.\.\.\)\)"
                                                r".*idist.auto_dataloader\(dataset, batch_sampler="):
        list(DistributedProxySampler(sampler, num_replicas=2, rank=0))
    with pytest.raises(SamplerSetupError, match=r"^DistributedBalancedSampler is used through "
                                                r"tests.catalyst_copy.CatalystDistributedSamplerWrapper, a "
                                                r"DistributedSampler of 2 replicas iterating it \(it keeps one "
                                                r"index in 2\), which re-shards .*without a distributed wrapper"):
        list(CatalystDistributedSamplerWrapper(sampler, num_replicas=2, rank=1))
    whole = list(CatalystDistributedSamplerWrapper(sampler, num_replicas=1, rank=0, shuffle=False))
    assert whole == list(sampler)  # one replica keeps every index: nothing to refuse


class _PassThrough(torch.utils.data.DistributedSampler):
    """A DistributedSampler of 2 replicas that hands the whole stream on (it only forwards ``set_epoch``)."""

    def __init__(self, sampler):
        super().__init__(range(len(sampler)), num_replicas=2, rank=0, shuffle=False)
        self.sampler = sampler

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self):
        return len(self.sampler)

    def set_epoch(self, epoch):
        super().set_epoch(epoch)
        self.sampler.set_epoch(epoch)


class _Holder(torch.utils.data.DistributedSampler):
    """User code that happens to run inside a method (not ``__iter__``) of a DistributedSampler of 2 replicas."""

    def __init__(self):
        super().__init__(range(10), num_replicas=2, rank=0)

    def count(self, sampler):
        return len(list(sampler))


def test_a_distributed_sampler_that_does_not_re_shard_is_left_alone():
    """Before: any DistributedSampler of W > 1 on the stack was refused as keeping one index in W, although these
    two hand every index on."""
    sampler = DistributedBalancedSampler(LABELS, 4, 2, num_replicas=2, rank=0)
    wrapper = _PassThrough(sampler)
    wrapper.set_epoch(3)
    assert list(wrapper) == list(sampler) and sampler.epoch == 3
    assert _Holder().count(sampler) == len(sampler)
    resharding = torch.utils.data.DistributedSampler(sampler, num_replicas=2, rank=0)  # a dataset, not a wrapper
    assert len(list(resharding)) == len(sampler) // 2  # torch's own iterates no sampler: nothing for the guard

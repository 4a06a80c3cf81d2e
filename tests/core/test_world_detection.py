"""The one world detection (comm.detect_world): the runtime first, the launcher's environment for the host's share."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from pksampler import comm
from pksampler.samplers import world_info
from pksampler.world import World

_KEYS = [key for names in comm.LAUNCHER_ENVIRONMENT for key in names] + list(comm.LOCAL_SIZE_ENVIRONMENT) + [
    "NODE_RANK", "HOROVOD_HOSTNAME", "TORCHELASTIC_RUN_ID", "MASTER_ADDR"]


@pytest.fixture
def bare(monkeypatch):
    for key in _KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_the_launchers_environment_gives_rank_size_local_rank_and_ranks_per_host(bare):
    assert comm.detect_world() is None and World.detect() == World()
    bare.setenv("HOROVOD_RANK", "5")
    bare.setenv("HOROVOD_SIZE", "8")
    bare.setenv("HOROVOD_LOCAL_RANK", "1")
    bare.setenv("HOROVOD_LOCAL_SIZE", "4")
    assert comm.detect_world() == (5, 8, 1, 4, "the launcher's environment")
    assert World.detect() == World(rank=5, size=8, local_rank=1, local_size=4) and world_info() == (5, 8)


def test_under_a_process_group_its_rank_holds_and_the_environment_gives_only_the_hosts_share(bare, tmp_path):
    # Lightning's children on node 1 carry WORLD_SIZE, LOCAL_RANK and NODE_RANK but no RANK: read as a launcher's
    # world that cannot be known, yet once the process group runs its rank is the answer
    bare.setenv("WORLD_SIZE", "4")
    bare.setenv("NODE_RANK", "1")
    bare.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        comm.detect_world()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert comm.detect_world() == (0, 1, 1, 1, "torch.distributed") and world_info() == (0, 1)
        bare.setenv("LOCAL_WORLD_SIZE", "2")
        assert World.detect() == World(rank=0, size=1, local_rank=1, local_size=2)
    finally:
        dist.destroy_process_group()

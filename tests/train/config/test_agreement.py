"""Ranks agree on the configuration or stop together, told the key they differ on."""

from __future__ import annotations

import numpy as np
import pytest

from pksampler.train.config.agreement import check_ranks_agree, flatten
from pksampler.train.config.load import load_config
from pksampler.train.errors import ConfigError
from pksampler.train.runtime.distributed import Backend
from pksampler.world import World


class TwoRanks(Backend):
    """Rank 0 of two whose peer sent ``peer_config``: allgather_numpy returns both rows."""

    def __init__(self, peer_config: dict) -> None:
        super().__init__("cpu", "fp32")
        self.set_world(World(rank=0, size=2))
        self.peer_config = peer_config

    def allgather_numpy(self, row: np.ndarray) -> np.ndarray:
        peer = _row(self.peer_config)
        return np.stack([row, peer])


def _row(config: dict) -> np.ndarray:
    captured = {}

    class Capture(Backend):
        def allgather_numpy(self, row):
            captured["row"] = row
            return np.stack([row, row])

    capture = Capture("cpu", "fp32")
    capture.set_world(World(rank=0, size=2))
    check_ranks_agree(config, np.zeros(4, dtype=np.int64), capture)
    return captured["row"]


def test_ranks_that_differ_only_in_data_augment_are_told_the_key():
    mine = load_config(None, [], environ={}).to_dict()
    peer = load_config(None, ["data.augment={flip: 0}"], environ={}).to_dict()
    with pytest.raises(ConfigError, match=r"^ranks disagree on data\.augment:"):
        check_ranks_agree(mine, np.zeros(4, dtype=np.int64), TwoRanks(peer))
    assert flatten({"data": {"augment": {"flip": 0}, "args": {"a": {"b": 1}}}}) == {
        "data.augment": {"flip": 0}, "data.args": {"a": {"b": 1}}}

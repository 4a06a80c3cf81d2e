"""Distributed samplers for metric learning.

Pure plans (numpy in, numpy out) live in ``*_plan`` modules; the torch
``Sampler`` classes hold configuration, epoch and resume state.
"""

from __future__ import annotations

from ._labels import ClassIndex, group_labels
from ._world import rank_share, rank_shares, world_info
from .balanced import DistributedBalancedBatchSampler, DistributedBalancedSampler
from .pk_plan import PlanOptions, balanced_plan, epoch_layout, rank_batches
from .triplet import DistributedTripletBatchSampler, DistributedTripletSampler
from .triplet_plan import TripletOptions, triplet_batches
from ._guard import SamplerSetupError
from .consistency import SamplerMismatchError, check_consistent, consistency_row, sampler_fingerprint

__all__ = [
    "ClassIndex",
    "DistributedBalancedBatchSampler",
    "DistributedBalancedSampler",
    "DistributedTripletBatchSampler",
    "DistributedTripletSampler",
    "PlanOptions",
    "SamplerMismatchError",
    "SamplerSetupError",
    "TripletOptions",
    "balanced_plan",
    "check_consistent",
    "consistency_row",
    "epoch_layout",
    "group_labels",
    "rank_batches",
    "rank_share",
    "rank_shares",
    "sampler_fingerprint",
    "triplet_batches",
    "world_info",
]

"""Losses on the gathered global batch: pair losses (:mod:`.pair`, re-exported here), cross-batch
memory (:mod:`.memory`) and hard-negative mining of class neighbours (:mod:`.mining`).
"""

from __future__ import annotations

from pksampler.train.losses.pair import *  # noqa: F401,F403
from pksampler.train.losses.pair import __all__

"""pksampler: distributed P x K and triplet samplers for metric learning.

The subpackages live in the repository's top-level folders and are mapped into
this namespace by ``pyproject.toml``:

- :mod:`pksampler.samplers` -- the samplers (numpy plans + torch Sampler classes)
- :mod:`pksampler.datasets` -- labelled image datasets, transforms, synthetic data
- :mod:`pksampler.train` -- model, losses, evaluation and the Horovod trainer
"""

from __future__ import annotations

__version__ = "0.1.0"

from pksampler.samplers import (  # noqa: E402  (re-export of the headline API)
    DistributedBalancedBatchSampler,
    DistributedBalancedSampler,
)

__all__ = [
    "DistributedBalancedBatchSampler",
    "DistributedBalancedSampler",
    "__version__",
]

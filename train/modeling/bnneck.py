"""BNNeck: a batch normalisation between the pair loss's embeddings and the margin head's.

BoT (Luo et al., "Bag of Tricks and a Strong Baseline for Deep Person
Re-identification") found the pair loss and a classification head
"inconsistent in one embedding space": the pair loss pulls embeddings apart by
distance, the softmax by angle. The neck gives the head its own, normalised
features: the pair loss (and retrieval) read the embeddings ``f``, the head
reads ``BN(f)``.

The statistics are those of the gathered global batch, so the neck is the same
at every world size; its bias is frozen at zero (BoT: a bias would shift the
features away from the origin that the head's cosines measure from). Every
rank computes the head's loss on the same gathered batch, so every rank holds
the whole gradient of the neck's scale, times the trainer's gathered-loss
factor (Horovod: W; torchrun: 1, its all-gather sums gradients itself):
:class:`BNNeck` divides it back (``grad_divisor``), and then averaging over
ranks (Horovod) or not (torchrun: the neck is outside the DDP module) gives
the same gradient as one process.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pksampler.world import World

__all__ = ["BNNeck"]


class BNNeck(nn.Module):
    """``BatchNorm1d(dim)`` over the batch, zero frozen bias, the scale's gradient divided by ``grad_divisor``."""

    def __init__(self, dim: int, *, grad_divisor: float = 1.0) -> None:
        super().__init__()
        if not 0 < grad_divisor < float("inf"):  # a NaN fails this test too
            raise ValueError(f"BNNeck(grad_divisor=) must be a finite number > 0, got {grad_divisor!r}")
        # running statistics are never used: retrieval reads the embeddings before the neck
        self.norm = nn.BatchNorm1d(dim, track_running_stats=False)
        self.norm.bias.requires_grad_(False)
        self.grad_divisor = grad_divisor  # may change with the world size (a Horovod elastic reset)
        self.norm.weight.register_hook(self._rescale)

    def set_world(self, world: World) -> None:
        """The divisor of a new world: the loss scale its gathered batch carries (a Horovod elastic reset)."""
        self.grad_divisor = world.loss_scale

    def _rescale(self, grad: torch.Tensor) -> torch.Tensor:
        return grad / self.grad_divisor

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The batch-normalised embeddings (at least two rows: the statistics need a batch)."""
        if embeddings.shape[0] < 2:
            raise ValueError(f"head.bnneck: the neck normalises over the batch and needs at least 2 embeddings, "
                             f"got {embeddings.shape[0]}")
        return self.norm(embeddings)

    def fixed(self, embeddings: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        """The neck under given statistics (per-feature ``mean`` and biased ``var``), for any number of rows.

        Imprinting a continued run's new rows (``train.init_from``) embeds the new classes' images rank by rank
        in blocks: the block's own statistics would depend on the world size and fail on a block of one."""
        return F.batch_norm(embeddings, mean.to(embeddings), var.to(embeddings), self.norm.weight, self.norm.bias,
                            training=False, eps=self.norm.eps)

"""Fine-tuning a pretrained backbone: frozen BatchNorm, a slower backbone, a head warm-up.

* ``model.freeze_norm``: every BatchNorm layer of the backbone becomes a
  :class:`.frozen_norm.FrozenBatchNorm2d` when the model is built: its
  running statistics and affine parameters stay as loaded (the usual choice
  when a rank's batch is a few dozen images, too few for good batch
  statistics). The layer keeps BatchNorm's tensor names, so pretrained files
  and checkpoints load unchanged.
* ``optim.backbone_lr_scale``: the optimizer gets two parameter groups, the
  head's (pooling, head, neck and the loss's own parameters) at ``lr`` first
  and the backbone's at ``lr * scale``; the warm-up/cosine schedule
  multiplies both, and the groups (tagged ``name: head|backbone``) are saved
  and restored with the optimizer state.
* ``model.freeze_backbone_steps``: :class:`~pksampler.train.engine.hooks.FreezeBackboneHook` holds the
  backbone group's learning rate at 0 for the first N optimizer steps (a
  resumed run included), then leaves it to the schedule. The backbone's
  gradients are still computed and reduced during those steps, so every rank
  and every backend (Horovod's allreduce, DDP's buckets) runs the same
  collectives and nothing waits for a gradient that one rank skipped; the
  optimizer's moments warm up meanwhile, but with a learning rate of 0 (and
  so no weight decay step) the backbone's weights do not move.

A model exposes its backbone as a ``backbone`` sub-module, or through a
``backbone_parameters()`` method (the demo network, whose trunk predates the
convention); :func:`backbone_parameters` asks both.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from pksampler.train.errors import ConfigError

__all__ = ["backbone_parameters", "parameter_groups"]


def backbone_parameters(model: nn.Module) -> list[nn.Parameter] | None:
    """The backbone's parameters (``model.backbone_parameters()`` or ``model.backbone``), or None when it has none."""
    method = getattr(model, "backbone_parameters", None)
    if callable(method):
        return list(method())
    backbone = getattr(model, "backbone", None)
    return list(backbone.parameters()) if isinstance(backbone, nn.Module) else None


def parameter_groups(model: nn.Module, extra: Iterable[nn.Parameter], lr: float, *,
                     backbone_lr_scale: float, split: bool) -> list[dict]:
    """Optimizer groups: ``head`` (everything but the backbone) at ``lr``, then ``backbone`` at ``lr * scale``.

    Parameters that do not require gradients (frozen norms) are left out.
    With ``split`` False (no fine-tuning option set) one group holds all.
    """
    everything = [p for p in [*model.parameters(), *extra] if p.requires_grad]
    if not split:
        return [{"params": everything, "lr": lr}]
    backbone = backbone_parameters(model)
    if backbone is None:
        raise ConfigError("optim.backbone_lr_scale / model.freeze_backbone_steps: the model has no backbone to "
                          "treat apart (a custom model names it with a `backbone` sub-module or a "
                          "`backbone_parameters()` method)")
    inside = {id(p) for p in backbone}
    head = [p for p in everything if id(p) not in inside]
    trunk = [p for p in everything if id(p) in inside]
    return [{"params": head, "lr": lr, "name": "head"},
            {"params": trunk, "lr": lr * backbone_lr_scale, "name": "backbone"}]

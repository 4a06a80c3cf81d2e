"""Embedding networks in plain torch: a backbone, global pooling, a linear head (+ neck), L2-normalised.

Backbones (``model.backbone``):

* ``resnet``: the compact demo network (:class:`EmbeddingNet`; ``width`` and
  ``depth`` apply to it alone);
* ``resnet18``, ``resnet34``, ``resnet50``, ``resnet101``: torchvision's
  ResNets with torchvision's tensor names (:mod:`.resnet`), normalised by
  ``model.norm``;
* ``vit_small_patch16``, ``vit_base_patch16``: ViTs with timm's tensor names
  (:mod:`.vit`; LayerNorm whatever ``model.norm`` says), pooled over their
  patch tokens;
* ``torchvision:<name>``: any torchvision classification network with an
  ``fc`` layer, where torchvision imports.

The standard backbones take ``model.pretrained`` weights (:mod:`.pretrained`)
and the fine-tuning options of :mod:`.finetune`.
"""

from __future__ import annotations

import dataclasses

from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from pksampler.train.modeling.frozen_norm import freeze_batch_norm
from pksampler.train.modeling.resnet import RESNETS, resnet
from pksampler.train.errors import ConfigError
from pksampler.train.modeling.vit import VITS, vit

__all__ = ["BACKBONES", "BackboneEmbedding", "EmbeddingNet", "GeM", "NeckedEmbedding", "build_model", "global_neck"]

#: the demo network's ``model.backbone`` name
DEMO = "resnet"
#: the values of ``model.backbone`` (besides ``torchvision:<name>``)
BACKBONES = (DEMO, *RESNETS, *VITS)

NormFactory = Callable[[int], nn.Module]
POOLINGS = ("avg", "gem", "avgmax")
NECKS = ("none", "batch", "layer")


#: the values of ``model.norm``
NORMS = ("group", "batch", "sync_batch", "none")
#: what ``model.norm`` accepts: a layer, or ``auto`` for the backbone's own (:func:`resolve_norm`)
NORM_CHOICES = ("auto", *NORMS)


def norm_factory(kind: str, sync_batch_norm: type[nn.Module] | None = None) -> NormFactory:
    """A constructor for the chosen normalisation layer.

    ``group`` (GroupNorm) and ``none`` do not depend on the local batch, so W
    ranks train the same model as one process with the global batch; ``batch``
    normalises per rank; ``sync_batch`` uses the backend's SyncBatchNorm.
    """
    if kind == "group":
        return lambda channels: nn.GroupNorm(min(8, channels), channels)
    if kind == "batch":
        return nn.BatchNorm2d
    if kind == "sync_batch":
        if sync_batch_norm is None:
            raise ValueError("model.norm='sync_batch' needs a distributed backend with SyncBatchNorm")
        return sync_batch_norm
    if kind == "none":
        return lambda channels: nn.Identity()
    raise ValueError(f"model.norm must be one of ['group', 'batch', 'sync_batch', 'none'], got {kind!r}")


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (He et al. 2016)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: NormFactory) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.norm1 = norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.norm2 = norm(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), norm(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class GeM(nn.Module):
    """Generalised-mean pooling (Radenović et al. 2018): ``mean(x^p)^(1/p)`` over space, ``p`` learnt.

    p = 1 is average pooling and p -> infinity max pooling; starting at 3 lets
    the strongest local responses dominate, which suits retrieval of objects
    that fill only part of the image.
    """

    def __init__(self, p: float = 3.0, eps: float = 1e-6) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(float(p)))
        self.eps = eps

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        p = self.p.clamp(min=1.0)
        return features.clamp(min=self.eps).pow(p).mean(dim=(2, 3)).pow(1.0 / p)


def layer_norm_pooled(pooled: torch.Tensor) -> torch.Tensor:
    """LayerNorm without affine over each pooled feature (``model.pool_norm``, Zhai & Wu 2018).

    Pooled ReLU features are all positive, so every image shares a large
    component along the all-ones direction; centring and scaling each feature
    over its channels removes it before the projection, per image (the same at
    every world size and chunk size, no parameters)."""
    return F.layer_norm(pooled, pooled.shape[-1:])


class _Pool(nn.Module):
    """Global pooling of (N, C, H, W) to (N, C) or, for ``avgmax``, (N, 2C) (average and max concatenated),
    then, with ``layer_norm``, :func:`layer_norm_pooled`."""

    def __init__(self, kind: str, *, layer_norm: bool = False) -> None:
        super().__init__()
        if kind not in POOLINGS:
            raise ValueError(f"model.pooling must be one of {list(POOLINGS)}, got {kind!r}")
        self.kind, self.layer_norm = kind, layer_norm
        self.gem = GeM() if kind == "gem" else None

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.gem is not None:
            pooled = self.gem(features)
        else:
            pooled = features.mean(dim=(2, 3))
            if self.kind == "avgmax":
                pooled = torch.cat([pooled, features.amax(dim=(2, 3))], dim=1)
        return layer_norm_pooled(pooled) if self.layer_norm else pooled


def _neck(kind: str, dim: int) -> nn.Module:
    """Normalisation of the embedding before the L2 norm ("BN-neck", Luo et al. 2019).

    ``batch`` is BatchNorm1d; in training the step applies it to the
    all-gathered global batch (:meth:`NeckedEmbedding.finish`), so its
    statistics are one process's at every world size; ``layer`` is LayerNorm,
    per row, so it stays inside the forward pass unchanged.
    """
    if kind == "none":
        return nn.Identity()
    if kind == "batch":
        return nn.BatchNorm1d(dim)
    if kind == "layer":
        return nn.LayerNorm(dim)
    raise ValueError(f"model.neck must be one of {list(NECKS)}, got {kind!r}")


class NeckedEmbedding(nn.Module):
    """What the embedding networks share: ``forward`` is :meth:`finish` of :meth:`features`.

    A BatchNorm neck computes statistics over the rows it sees. With
    :attr:`neck_on_global_batch` set (:func:`global_neck`), ``forward`` in
    train mode stops before the neck and returns the projection's output; the
    training step all-gathers it and calls :meth:`finish` on the global batch.
    In eval mode (evaluation, export, the catalogue) ``forward`` finishes each
    batch itself with the running statistics, so one image embeds alone.
    """

    neck: nn.Module
    #: train-mode forward returns the pre-neck embedding, for the step to finish on the gathered batch
    neck_on_global_batch: bool = False

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """The embedding before the neck (pooling and the linear projection)."""
        raise NotImplementedError

    def finish(self, features: torch.Tensor) -> torch.Tensor:
        """The neck and the L2 norm."""
        return F.normalize(self.neck(features), dim=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.features(images)
        return features if self.training and self.neck_on_global_batch else self.finish(features)


def global_neck(model: nn.Module) -> nn.Module | None:
    """The BatchNorm neck of one of our networks, now applied by the step to the gathered batch; else None.

    Sets :attr:`NeckedEmbedding.neck_on_global_batch`. A LayerNorm neck, no
    neck, or a caller's own model are left as they are (nothing in them
    depends on the batch's other rows that the step could fix).
    """
    if not isinstance(model, NeckedEmbedding) or not isinstance(model.neck, nn.modules.batchnorm._BatchNorm):
        return None
    model.neck_on_global_batch = True
    return model.neck


class EmbeddingNet(NeckedEmbedding):
    """ResNet-style backbone (stages of width w, 2w, 4w, 8w...) + pooling + linear head (+ neck), L2-normalised.

    Args:
        width: channels of the first stage.
        depth: residual blocks per stage; each stage after the first halves the resolution.
        stem_stride: stride of the first convolution (2: the stages see half the
            input resolution, at about a quarter of the compute).
        embedding_dim: size of the output embedding.
        norm: normalisation layer constructor (see :func:`norm_factory`).
        pooling: ``avg`` (global average), ``gem`` (generalised mean, learnt p)
            or ``avgmax`` (average and max concatenated).
        neck: ``none``, ``batch`` or ``layer`` normalisation of the embedding
            before the L2 norm (:class:`NeckedEmbedding`).
        bias: the projection has a bias.
        pool_norm: LayerNorm without affine on the pooled feature (:func:`layer_norm_pooled`).
    """

    def __init__(self, width: int = 32, depth: tuple[int, ...] = (1, 1, 1, 1), embedding_dim: int = 64,
                 norm: NormFactory | None = None, *, pooling: str = "avg", neck: str = "none",
                 stem_stride: int = 1, bias: bool = True, pool_norm: bool = False) -> None:
        super().__init__()
        norm = norm or norm_factory("group")
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, stem_stride, 1, bias=False), norm(width), nn.ReLU(inplace=True))
        stages, channels = [], width
        for index, blocks in enumerate(depth):
            out_channels = width * 2**index
            for block in range(blocks):
                stride = 2 if (index > 0 and block == 0) else 1
                stages.append(BasicBlock(channels, out_channels, stride, norm))
                channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.pool = _Pool(pooling, layer_norm=pool_norm)
        self.head = nn.Linear(channels * (2 if pooling == "avgmax" else 1), embedding_dim, bias=bias)
        self.neck = _neck(neck, embedding_dim)
        self.embedding_dim = embedding_dim

    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.stages(self.stem(images))))

    def backbone_parameters(self) -> Iterator[nn.Parameter]:
        """The trunk's parameters (stem and stages), for the fine-tuning options."""
        yield from self.stem.parameters()
        yield from self.stages.parameters()


class BackboneEmbedding(NeckedEmbedding):
    """A backbone that returns a (N, C, H, W) map, then pooling, a linear head, the neck and the L2 norm.

    The backbone is the ``backbone`` sub-module, so its tensors are named
    ``backbone.<torchvision or timm name>`` in checkpoints.
    """

    def __init__(self, backbone: nn.Module, embedding_dim: int, *, pooling: str = "avg", neck: str = "none",
                 bias: bool = True, pool_norm: bool = False) -> None:
        super().__init__()
        self.backbone = backbone
        self.pool = _Pool(pooling, layer_norm=pool_norm)
        self.head = nn.Linear(backbone.num_features * (2 if pooling == "avgmax" else 1), embedding_dim, bias=bias)
        self.neck = _neck(neck, embedding_dim)
        self.embedding_dim = embedding_dim

    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.backbone(images)))


class TorchvisionEmbedding(NeckedEmbedding):
    """A torchvision backbone (when torchvision imports) with the same embedding head and neck."""

    def __init__(self, name: str, embedding_dim: int, neck: str = "none", *, bias: bool = True,
                 pool_norm: bool = False) -> None:
        super().__init__()
        self.pool_norm = pool_norm
        try:
            import torchvision.models as models
        except Exception as error:  # torchvision missing or built for another torch
            raise ConfigError(f"model.backbone={'torchvision:' + name!r} needs a working torchvision: {error}") from None
        constructor = getattr(models, name, None)
        if not callable(constructor):
            raise ConfigError(f"model.backbone: torchvision has no model {name!r}")
        backbone = constructor(weights=None)
        if not isinstance(getattr(backbone, "fc", None), nn.Linear):
            raise ConfigError(f"model.backbone: torchvision:{name} has no `fc` classifier to replace; use a "
                             "ResNet-like torchvision model (resnet*, resnext*, wide_resnet*, regnet*)")
        features = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.backbone, self.head = backbone, nn.Linear(features, embedding_dim, bias=bias)
        self.neck = _neck(neck, embedding_dim)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        pooled = self.backbone(images)
        return self.head(layer_norm_pooled(pooled) if self.pool_norm else pooled)


def build_model(config, sync_batch_norm: type[nn.Module] | None = None, *, image_size: int = 224) -> nn.Module:
    """The model a ModelConfig describes, for ``image_size`` px images (a ViT's position grid).

    Pretrained weights are not loaded here (:func:`.pretrained.load_pretrained` does, on rank 0).
    ``model.norm: auto`` and ``model.freeze_norm: null`` resolve to the
    backbone's own choices first (:func:`resolve_norm`).
    """
    config = resolve_norm(config)
    _check_pretrained(config)
    name = config.backbone
    bias = getattr(config, "projection_bias", None) is not False  # null (unresolved): the bias, as before the key
    pool_norm = bool(getattr(config, "pool_norm", False))
    if name.startswith("torchvision:"):
        if config.pooling != "avg":
            raise ConfigError(f"model.pooling={config.pooling!r} applies to our own backbones only; "
                             f"torchvision backbones pool with their own layer (use 'avg')")
        model: nn.Module = TorchvisionEmbedding(name.split(":", 1)[1], config.embedding_dim, config.neck, bias=bias,
                                                pool_norm=pool_norm)
    elif name == DEMO:
        model = EmbeddingNet(config.width, tuple(config.depth), config.embedding_dim,
                             norm_factory(config.norm, sync_batch_norm),
                             pooling=config.pooling, neck=config.neck, stem_stride=config.stem_stride, bias=bias,
                             pool_norm=pool_norm)
    elif name in RESNETS or name in VITS:
        if name in VITS and config.pooling == "gem":
            raise ConfigError(f"model.pooling: 'gem' needs non-negative features and a ViT's tokens are not; "
                              f"use 'avg' (mean of the patch tokens) or 'avgmax' with backbone {name!r}")
        trunk = (resnet(name, norm_factory(config.norm, sync_batch_norm)) if name in RESNETS
                 else vit(name, image_size=image_size))
        model = BackboneEmbedding(trunk, config.embedding_dim, pooling=config.pooling, neck=config.neck, bias=bias,
                                  pool_norm=pool_norm)
    else:
        raise ConfigError(f"model.backbone must be one of {list(BACKBONES)} or 'torchvision:<name>', got {name!r}")
    if config.freeze_norm:
        _freeze_norm(model, config)
    return model


def resolve_norm(config: Any) -> Any:
    """``config`` with ``norm: auto`` and ``freeze_norm: null`` replaced by what the backbone was made with.

    ``auto`` is the backbone's own normalisation: BatchNorm for torchvision's
    ResNets (so their pretrained files load unchanged), group norm for the
    demo network (P×K batches of a few dozen images per rank are too small
    for batch statistics), nothing for the ViTs (their LayerNorms are part of
    the architecture). ``freeze_norm: null`` freezes BatchNorm exactly when
    ``pretrained`` weights are given (detectron2's ``FrozenBatchNorm2d``
    default for fine-tuning): their statistics come from millions of images,
    a rank's batch would only add noise. An explicit value wins either way.
    """
    norm = config.norm
    if norm == "auto":
        norm = "group" if config.backbone == DEMO else "none" if config.backbone in VITS else "batch"
    freeze = config.freeze_norm
    if freeze is None:
        freeze = bool(config.pretrained) and norm in ("batch", "sync_batch") and config.backbone != DEMO \
            and config.backbone not in VITS
    return dataclasses.replace(config, norm=norm, freeze_norm=freeze)


def _check_pretrained(config) -> None:
    """Pretrained weights need a backbone that has them, with the layers they were trained with."""
    if not config.pretrained:
        return
    if config.backbone == DEMO:
        raise ConfigError(f"model.pretrained: the demo backbone {DEMO!r} has no published weights; use one of "
                          f"{list(BACKBONES[1:])} or torchvision:<name>")
    if config.backbone in RESNETS and config.norm not in ("batch", "sync_batch"):
        raise ConfigError(f"model.norm: pretrained ResNet weights were trained with BatchNorm (bn1.running_mean, "
                          f"...), which model.norm={config.norm!r} has no place for; set model.norm: batch (or "
                          "sync_batch on GPUs), usually with model.freeze_norm: true")


def _freeze_norm(model: nn.Module, config) -> None:
    trunks = [model.stem, model.stages] if isinstance(model, EmbeddingNet) else [model.backbone]
    if sum(freeze_batch_norm(trunk) for trunk in trunks) == 0:
        raise ConfigError(f"model.freeze_norm: backbone {config.backbone!r} with model.norm={config.norm!r} has no "
                          "BatchNorm layer to freeze (use model.norm: batch, or leave freeze_norm off)")

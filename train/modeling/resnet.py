"""ResNet-18/34/50/101 in plain torch with torchvision's tensor names and shapes.

Every pretrained ResNet file people have (torchvision's ``resnet50.pth``,
timm's ResNets, most self-supervised checkpoints) names its tensors
``conv1``, ``bn1``, ``layer{1..4}.{i}.conv{k}`` / ``bn{k}`` /
``downsample.{0,1}`` and ``fc``; this module keeps those names, so such a
file loads without a conversion script (:mod:`.pretrained`). The classifier
``fc`` is left out: the embedding head replaces it.

torchvision's ``Bottleneck`` puts the stride on the 3x3 convolution
("ResNet v1.5"); so does this one, and so do timm's ResNets.

The normalisation layer is a parameter: ``batch`` (BatchNorm2d, what the
published weights were trained with: ``bnK.weight``, ``bias``,
``running_mean``, ``running_var``, ``num_batches_tracked``), ``group``
(GroupNorm: the same ``weight``/``bias`` names but no running statistics, so
BatchNorm weights do not load into it), ``sync_batch`` or ``none``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["RESNETS", "ResNet", "resnet"]

NormFactory = Callable[[int], nn.Module]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int, norm: NormFactory,
                 downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = norm(channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, and a residual connection (ResNet-50/101)."""

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int, norm: NormFactory,
                 downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride, 1, bias=False)
        self.bn2 = norm(channels)
        self.conv3 = nn.Conv2d(channels, channels * 4, 1, bias=False)
        self.bn3 = norm(channels * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """The convolutional trunk of torchvision's ResNet: input (N, 3, H, W), output the layer4 map (N, C, H/32, W/32).

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        layers: blocks per stage, e.g. (3, 4, 6, 3) for ResNet-50.
        norm: the normalisation layer's constructor (channels -> module).
    """

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: tuple[int, int, int, int],
                 norm: NormFactory | None = None) -> None:
        super().__init__()
        norm = norm or nn.BatchNorm2d
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = norm(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self._in_channels = 64
        self.layer1 = self._stage(block, 64, layers[0], 1, norm)
        self.layer2 = self._stage(block, 128, layers[1], 2, norm)
        self.layer3 = self._stage(block, 256, layers[2], 2, norm)
        self.layer4 = self._stage(block, 512, layers[3], 2, norm)
        self.num_features = 512 * block.expansion
        self._initialise()

    def _stage(self, block, channels: int, blocks: int, stride: int, norm: NormFactory) -> nn.Sequential:
        downsample = None
        if stride != 1 or self._in_channels != channels * block.expansion:
            downsample = nn.Sequential(nn.Conv2d(self._in_channels, channels * block.expansion, 1, stride, bias=False),
                                       norm(channels * block.expansion))
        stage = [block(self._in_channels, channels, stride, norm, downsample)]
        self._in_channels = channels * block.expansion
        stage += [block(self._in_channels, channels, 1, norm, None) for _ in range(1, blocks)]
        return nn.Sequential(*stage)

    def _initialise(self) -> None:
        """torchvision's initialisation, for training from scratch (He-normal convolutions, unit norms)."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


#: ``model.backbone`` name -> (block, blocks per stage), as torchvision defines them
RESNETS: dict[str, tuple[type[BasicBlock] | type[Bottleneck], tuple[int, int, int, int]]] = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
    "resnet101": (Bottleneck, (3, 4, 23, 3)),
}


def resnet(name: str, norm: NormFactory | None = None) -> ResNet:
    """``resnet18`` ... ``resnet101`` without the classifier, with ``norm`` layers (default BatchNorm2d)."""
    if name not in RESNETS:
        raise ValueError(f"model.backbone must be one of {list(RESNETS)} for a ResNet, got {name!r}")
    block, layers = RESNETS[name]
    return ResNet(block, layers, norm)

"""Networks: the demo network, ResNets and ViTs with torchvision/timm tensor names, pretrained
weight loading, frozen BatchNorm, pooling and necks.
"""

from __future__ import annotations

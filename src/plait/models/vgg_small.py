"""A VGG-style convolutional network for small images, written as pipeline blocks.

Simonyan & Zisserman, "Very Deep Convolutional Networks for Large-Scale Image Recognition"
(ICLR 2015): stacks of 3×3 convolutions with ReLU, a 2×2 max-pool closing each stack,
channels doubling from stack to stack, then fully connected layers. PipeDream, SpecTrain
and XPipe report VGG-16 among their models; this is the same shape at the size of 8×8
images (scikit-learn's digits): three stacks of two convolutions (w, 2w, 4w channels;
8×8 → 4×4 → 2×2 → 1×1) and two linear layers, eight blocks, so it can be cut into up to
eight pipeline stages, each boundary one tensor.

Why not `ResNet18`: its last stage works at 1×1 on 8×8 inputs, where GroupNorm with few
channels per group normalises single values to zero, and BatchNorm makes every stage's
activations depend on the micro-batch. This network has no normalisation layer at all
(as VGG-16 without BN), so a micro-batch computes the same alone or in any company.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.blocks import BlockChain

__all__ = ["SmallVGG"]


class _Conv(nn.Module):
    """3×3 convolution (padding 1) and ReLU, then a 2×2 max-pool when `pool`."""

    def __init__(self, in_channels: int, out_channels: int, *, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.conv(x))  # [b, out, h, w]
        return F.max_pool2d(y, 2) if self.pool else y


class _Linear(nn.Module):
    """Flatten, linear, and ReLU unless it is the classifier."""

    def __init__(self, features: int, out: int, *, relu: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(features, out)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x.flatten(1))
        return F.relu(y) if self.relu else y


class SmallVGG(BlockChain):
    """Six 3×3 convolutions in three pooled stacks (w, 2w, 4w channels) and two linear
    layers (`hidden`, then `num_classes`) for `image_size`² images, 8 blocks."""

    def __init__(
        self,
        *,
        num_classes: int = 10,
        width: int = 16,
        hidden: int = 128,
        in_channels: int = 1,
        image_size: int = 8,
    ) -> None:
        for name, value in (("num_classes", num_classes), ("width", width), ("hidden", hidden),
                            ("in_channels", in_channels)):  # fmt: skip
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if image_size < 8 or image_size % 8:
            raise ValueError(
                f"image_size={image_size}: three 2×2 pools need a multiple of 8 (8 for digits)"
            )
        layers: list[nn.Module] = []
        channels = in_channels
        for stack in range(3):
            out = width * 2**stack
            layers += [_Conv(channels, out, pool=False), _Conv(out, out, pool=True)]
            channels = out
        features = channels * (image_size // 8) ** 2
        layers += [_Linear(features, hidden, relu=True), _Linear(hidden, num_classes, relu=False)]
        super().__init__(layers)
        for module in self.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)  # type: ignore[arg-type]

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of logits [batch, classes] against class ids [batch]."""
        return F.cross_entropy(logits, targets)

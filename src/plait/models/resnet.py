"""ResNet-18 for 32×32 images (the CIFAR variant), written as ten pipeline blocks.

He et al., "Deep Residual Learning for Image Recognition" (CVPR 2016). The CIFAR variant
replaces ImageNet's 7×7 stride-2 stem and max-pool with one 3×3 stride-1 convolution, so
a 32×32 image keeps its resolution through the first stage; four stages of two
BasicBlocks (channels w, 2w, 4w, 8w; stages 2-4 halve the resolution) follow, then global
average pooling and a linear classifier. Blocks: stem, the eight BasicBlocks, head — so
the model can be cut into up to ten pipeline stages; every boundary carries one tensor
[batch, channels, height, width].

Limits: with `norm="batch"` (the paper's BatchNorm) the normalisation statistics are
computed per micro-batch in training mode, so a pipeline that splits a batch into
micro-batches computes different activations, running statistics and gradients than one
full-batch step, and results depend on the micro-batch count. Use `norm="group"`
(GroupNorm, Wu & He, ECCV 2018) for a variant whose every sample is normalised on its
own, so micro-batching changes nothing but the summation order.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from plait.blocks import BlockChain

__all__ = ["BasicBlock", "ResNet18", "ResNetHead", "ResNetStem"]

Norm = Literal["batch", "group"]
_GROUPS = 32  # GroupNorm's default group count (Wu & He); fewer when channels < 32


def _norm(kind: Norm, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(math.gcd(_GROUPS, channels), channels)


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


class ResNetStem(nn.Module):
    """Images [b, 3, 32, 32] -> features [b, width, 32, 32]: 3×3 conv, norm, ReLU."""

    def __init__(self, width: int, norm: Norm, in_channels: int = 3) -> None:
        super().__init__()
        self.conv = _conv3x3(in_channels, width)
        self.norm = _norm(norm, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class BasicBlock(nn.Module):
    """Two 3×3 convolutions and a shortcut (1×1 conv + norm when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: Norm) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_channels, out_channels, stride)
        self.norm1 = _norm(norm, out_channels)
        self.conv2 = _conv3x3(out_channels, out_channels)
        self.norm2 = _norm(norm, out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                _norm(norm, out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return F.relu(y + self.shortcut(x))  # [b, out_channels, h/stride, w/stride]


class ResNetHead(nn.Module):
    """Features [b, channels, h, w] -> logits [b, num_classes]: global average pool, linear."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


class ResNet18(BlockChain):
    """CIFAR ResNet-18: stem, 4 stages × 2 BasicBlocks, head — ten pipeline blocks.

    `width` is the first stage's channel count (64 in the paper; use 4-8 in tests);
    `norm` picks BatchNorm (the paper's, micro-batch dependent) or GroupNorm (micro-batch
    invariant), see the module docstring.
    """

    def __init__(
        self,
        *,
        num_classes: int = 100,
        width: int = 64,
        norm: Norm = "batch",
        in_channels: int = 3,
    ) -> None:
        for name, value in (("num_classes", num_classes), ("width", width)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if norm not in ("batch", "group"):
            raise ValueError(
                f"norm={norm!r} is not a ResNet normalisation: use 'batch' (BatchNorm) or "
                "'group' (GroupNorm, independent of the micro-batch size)"
            )
        layers: list[nn.Module] = [ResNetStem(width, norm, in_channels)]
        channels = width
        for stage in range(4):
            out = width * 2**stage
            for index in range(2):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(BasicBlock(channels, out, stride, norm))
                channels = out
        layers.append(ResNetHead(channels, num_classes))
        super().__init__(layers)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of logits [batch, classes] against class ids [batch]."""
        return F.cross_entropy(logits, targets)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

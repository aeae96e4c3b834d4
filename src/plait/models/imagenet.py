"""ImageNet-style classifiers (ResNet-34/50, VGG-19, MobileNetV2), each as pipeline blocks.

The architectures of torchvision's `resnet34`, `resnet50`, `vgg19` and `mobilenet_v2`,
written here so that plait needs no torchvision wheel matching its torch build; no weights
are downloaded (random initialisation). References: He et al., "Deep Residual Learning
for Image Recognition" (CVPR 2016: BasicBlock and Bottleneck ResNets); Simonyan &
Zisserman, "Very Deep Convolutional Networks for Large-Scale Image Recognition" (ICLR
2015: VGG-19, configuration E, without batch norm as torchvision's `vgg19`); Sandler et
al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks" (CVPR 2018).

Every model has `blocks()` (stem, its residual/conv groups, head) so it can be cut into
stages, and `width_mult` scales every channel count (1.0 is the published model; smaller
values make CPU-sized models of the same shape). Limits: VGG's classifier assumes the
7×7 adaptive pool of torchvision (any input size works, the head stays 25088 × 4096 at
width 1.0); dropout is kept as published (0.5 in VGG, 0.2 in MobileNetV2).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from plait.blocks import BlockChain
from plait.models.resnet import BasicBlock, ResNetHead

__all__ = ["IMAGENET_MODELS", "VGG19", "MobileNetV2", "ResNetImageNet", "build_imagenet_model"]


def _ch(channels: int, width_mult: float, divisor: int = 1) -> int:
    scaled = max(divisor, int(channels * width_mult + divisor / 2) // divisor * divisor)
    return max(1, scaled)


def _bn_relu(conv: nn.Conv2d) -> nn.Sequential:
    return nn.Sequential(conv, nn.BatchNorm2d(conv.out_channels), nn.ReLU(inplace=True))


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)  # stride on 3×3 (v1.5)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.shortcut = _shortcut(cin, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.shortcut(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNetImageNet(BlockChain):
    """ResNet with the 7×7 stride-2 stem and max-pool; `depth` 34 (BasicBlocks 3-4-6-3) or
    50 (Bottlenecks 3-4-6-3). Blocks: stem, each residual block, head."""

    def __init__(self, depth: int = 50, *, num_classes: int = 1000, width_mult: float = 1.0):
        if depth not in (34, 50):
            raise ValueError(f"depth={depth}: use 34 (BasicBlock) or 50 (Bottleneck)")
        expansion = 1 if depth == 34 else _Bottleneck.expansion
        cin = _ch(64, width_mult)
        stem = _bn_relu(nn.Conv2d(3, cin, 7, 2, 3, bias=False))
        layers: list[nn.Module] = [nn.Sequential(stem, nn.MaxPool2d(3, 2, 1))]
        for stage, count in enumerate((3, 4, 6, 3)):
            width = _ch(64 * 2**stage, width_mult)
            for index in range(count):
                stride = 2 if stage > 0 and index == 0 else 1
                if depth == 34:
                    layers.append(BasicBlock(cin, width, stride, norm="batch"))
                else:
                    layers.append(_Bottleneck(cin, width, stride))
                cin = width * expansion
        layers.append(ResNetHead(cin, num_classes))
        super().__init__(layers)


_VGG19 = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
          512, 512, 512, 512, "M")  # fmt: skip


class _VGGHead(nn.Module):
    def __init__(self, channels: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(7)
        self.fc = nn.Sequential(
            nn.Linear(channels * 49, hidden), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(hidden, num_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(x), 1))


class VGG19(BlockChain):
    """VGG-19 (configuration E, no batch norm). Blocks: the five conv groups (each ending
    in its max-pool), then the classifier."""

    def __init__(self, *, num_classes: int = 1000, width_mult: float = 1.0) -> None:
        groups: list[nn.Module] = []
        group: list[nn.Module] = []
        cin = 3
        for item in _VGG19:
            if item == "M":
                groups.append(nn.Sequential(*group, nn.MaxPool2d(2, 2)))
                group = []
                continue
            cout = _ch(int(item), width_mult)
            group += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True)]
            cin = cout
        groups.append(_VGGHead(cin, _ch(4096, width_mult), num_classes))
        super().__init__(groups)


class _Inverted(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout),
        ]  # fmt: skip
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return x + y if self.residual else y


# (expansion t, channels c, repeats n, stride s) of the paper's Table 2
_MOBILENET_V2 = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                 (6, 160, 3, 2), (6, 320, 1, 1))  # fmt: skip


class _MobileHead(nn.Module):
    def __init__(self, cin: int, last: int, num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(cin, last, 1, bias=False), nn.BatchNorm2d(last),
                                  nn.ReLU6())  # fmt: skip
        self.fc = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean(dim=(2, 3)))


class MobileNetV2(BlockChain):
    """MobileNetV2 (width multiplier `width_mult`, channels rounded to multiples of 8 as
    the paper's code). Blocks: stem, the 17 inverted residuals, head."""

    def __init__(self, *, num_classes: int = 1000, width_mult: float = 1.0) -> None:
        cin = _ch(32, width_mult, 8)
        layers: list[nn.Module] = [_bn_relu6(nn.Conv2d(3, cin, 3, 2, 1, bias=False))]
        for t, c, n, s in _MOBILENET_V2:
            cout = _ch(c, width_mult, 8)
            for index in range(n):
                layers.append(_Inverted(cin, cout, s if index == 0 else 1, t))
                cin = cout
        layers.append(_MobileHead(cin, _ch(1280, max(1.0, width_mult), 8), num_classes))
        super().__init__(layers)


def _bn_relu6(conv: nn.Conv2d) -> nn.Sequential:
    return nn.Sequential(conv, nn.BatchNorm2d(conv.out_channels), nn.ReLU6())


IMAGENET_MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet34": lambda **kw: ResNetImageNet(34, **kw),
    "resnet50": lambda **kw: ResNetImageNet(50, **kw),
    "vgg19": VGG19,
    "mobilenet_v2": MobileNetV2,
}


def build_imagenet_model(
    name: str, *, num_classes: int = 1000, width_mult: float = 1.0
) -> nn.Module:
    """One of `IMAGENET_MODELS` by name, or an error listing them."""
    if name not in IMAGENET_MODELS:
        raise ValueError(f"model {name!r} is unknown: use one of {sorted(IMAGENET_MODELS)}")
    if not width_mult > 0:
        raise ValueError(f"width_mult={width_mult} must be > 0 (1.0 is the published model)")
    return IMAGENET_MODELS[name](num_classes=num_classes, width_mult=width_mult)

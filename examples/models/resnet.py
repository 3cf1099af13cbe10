"""Bottleneck ResNets with torchvision's module layout (conv1/bn1/relu/maxpool/layer1-4/avgpool/fc)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .example_io import ImageClassifierIO
from .weight_init import init_cnn_


def conv3x3(in_planes: int, out_planes: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding 1 and no bias."""
    return nn.Conv2d(
        in_planes, out_planes, kernel_size=3, stride=stride, padding=1, groups=groups, bias=False
    )


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution with no bias."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1 -> 3x3 (strided) -> 1x1 (x4), plus identity/downsample skip."""

    expansion = 4

    def __init__(
        self,
        inplanes: int,
        planes: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
        width_per_group: int = 64,
    ) -> None:
        super().__init__()
        width = int(planes * (width_per_group / 64.0))
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        """Residual block forward; output has ``planes * 4`` channels."""
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        return self.relu(out)


class ResNet(ImageClassifierIO, nn.Module):
    """Bottleneck ResNet.

    ``base_planes`` is the stem width (64 in torchvision); the four stages use
    ``base_planes`` x1/x2/x4/x8 planes (output channels x4).
    """

    def __init__(
        self,
        layers: Sequence[int],
        num_classes: int = 1000,
        width_per_group: int = 64,
        base_planes: int = 64,
        input_size: int = 224,
        in_channels: int = 3,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.input_size = input_size
        self.num_classes = num_classes
        self.width_per_group = width_per_group
        self.inplanes = base_planes
        self.conv1 = nn.Conv2d(in_channels, base_planes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base_planes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(base_planes, layers[0])
        self.layer2 = self._make_layer(base_planes * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(base_planes * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(base_planes * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(base_planes * 8 * Bottleneck.expansion, num_classes)
        init_cnn_(self)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        """Stack ``blocks`` bottlenecks; the first gets a conv1x1+BN ``downsample`` when shapes change."""
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * Bottleneck.expansion, stride),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample, self.width_per_group)]
        self.inplanes = planes * Bottleneck.expansion
        layers.extend(
            Bottleneck(self.inplanes, planes, width_per_group=self.width_per_group)
            for _ in range(1, blocks)
        )
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``[B, C, H, W]`` to logits ``[B, num_classes]``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 ([3, 4, 6, 3] bottlenecks), 3x224x224 inputs; 25,557,032 parameters at 1000 classes."""
    return ResNet([3, 4, 6, 3], num_classes=num_classes)


def resnet101(num_classes: int = 1000) -> ResNet:
    """ResNet-101 ([3, 4, 23, 3] bottlenecks), 3x224x224 inputs; 44,549,160 parameters at 1000 classes."""
    return ResNet([3, 4, 23, 3], num_classes=num_classes)


def resnet152(num_classes: int = 1000) -> ResNet:
    """ResNet-152 ([3, 8, 36, 3] bottlenecks), 3x224x224 inputs; 60,192,808 parameters at 1000 classes."""
    return ResNet([3, 8, 36, 3], num_classes=num_classes)


def wide_resnet101_2(num_classes: int = 1000) -> ResNet:
    """Wide ResNet-101-2 ([3, 4, 23, 3], width_per_group 128); 126,886,696 parameters at 1000 classes."""
    return ResNet([3, 4, 23, 3], num_classes=num_classes, width_per_group=128)


def resnet50_small(num_classes: int = 10) -> ResNet:
    """Tiny bottleneck ResNet ([2, 1, 1, 1], stem width 8) for 3x32x32 inputs."""
    return ResNet([2, 1, 1, 1], num_classes=num_classes, base_planes=8, input_size=32)


def wrn_small(num_classes: int = 10) -> ResNet:
    """Tiny wide ResNet ([1, 2, 1, 1], stem width 8, width_per_group 128) for 3x32x32 inputs."""
    return ResNet(
        [1, 2, 1, 1], num_classes=num_classes, width_per_group=128, base_planes=8, input_size=32
    )

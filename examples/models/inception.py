"""Inception-v3 (no auxiliary head, no input transform) with torchvision's block structure.

Every block takes a ``width`` factor that scales all of its internal channel
counts (torchvision's numbers are the ``width=1.0`` case), so a narrow model
keeps exactly the same branches and joins.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .example_io import ImageClassifierIO
from .weight_init import init_cnn_


def scaled(channels: int, width: float) -> int:
    """Scale a nominal channel count by ``width`` (rounded, at least 1)."""
    return max(1, int(round(channels * width)))


class BasicConv2d(nn.Module):
    """Conv2d (no bias) + BatchNorm2d(eps=0.001) + ReLU."""

    def __init__(self, in_channels: int, out_channels: int, **kwargs: Any) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, bias=False, **kwargs)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)

    def forward(self, x: Tensor) -> Tensor:
        """Apply conv, batch norm and ReLU."""
        return F.relu(self.bn(self.conv(x)), inplace=True)


class InceptionA(nn.Module):
    """Four branches (1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1) concatenated on channels."""

    def __init__(self, in_channels: int, pool_features: int, width: float = 1.0) -> None:
        super().__init__()
        c = partial(scaled, width=width)
        self.branch1x1 = BasicConv2d(in_channels, c(64), kernel_size=1)
        self.branch5x5_1 = BasicConv2d(in_channels, c(48), kernel_size=1)
        self.branch5x5_2 = BasicConv2d(c(48), c(64), kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, c(64), kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(c(64), c(96), kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(c(96), c(96), kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(in_channels, c(pool_features), kernel_size=1)
        self.out_channels = c(64) + c(64) + c(96) + c(pool_features)

    def forward(self, x: Tensor) -> Tensor:
        """Run the four branches and concatenate them."""
        branch1x1 = self.branch1x1(x)
        branch5x5 = self.branch5x5_2(self.branch5x5_1(x))
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        branch_pool = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([branch1x1, branch5x5, branch3x3dbl, branch_pool], 1)


class InceptionB(nn.Module):
    """Grid reduction: (3x3/2 | 1x1-3x3-3x3/2 | maxpool/2) concatenated on channels."""

    def __init__(self, in_channels: int, width: float = 1.0) -> None:
        super().__init__()
        c = partial(scaled, width=width)
        self.branch3x3 = BasicConv2d(in_channels, c(384), kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, c(64), kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(c(64), c(96), kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(c(96), c(96), kernel_size=3, stride=2)
        self.out_channels = c(384) + c(96) + in_channels

    def forward(self, x: Tensor) -> Tensor:
        """Run the three branches and concatenate them."""
        branch3x3 = self.branch3x3(x)
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        branch_pool = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([branch3x3, branch3x3dbl, branch_pool], 1)


class InceptionC(nn.Module):
    """Factorised 7x7 block: (1x1 | 1x1-1x7-7x1 | 1x1-7x1-1x7-7x1-1x7 | avgpool-1x1) concatenated."""

    def __init__(self, in_channels: int, channels_7x7: int, width: float = 1.0) -> None:
        super().__init__()
        c = partial(scaled, width=width)
        c7 = c(channels_7x7)
        self.branch1x1 = BasicConv2d(in_channels, c(192), kernel_size=1)
        self.branch7x7_1 = BasicConv2d(in_channels, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, c(192), kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(in_channels, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, c(192), kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(in_channels, c(192), kernel_size=1)
        self.out_channels = 4 * c(192)

    def forward(self, x: Tensor) -> Tensor:
        """Run the four branches and concatenate them."""
        branch1x1 = self.branch1x1(x)
        branch7x7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        branch7x7dbl = self.branch7x7dbl_1(x)
        branch7x7dbl = self.branch7x7dbl_3(self.branch7x7dbl_2(branch7x7dbl))
        branch7x7dbl = self.branch7x7dbl_5(self.branch7x7dbl_4(branch7x7dbl))
        branch_pool = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([branch1x1, branch7x7, branch7x7dbl, branch_pool], 1)


class InceptionD(nn.Module):
    """Grid reduction: (1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool/2) concatenated on channels."""

    def __init__(self, in_channels: int, width: float = 1.0) -> None:
        super().__init__()
        c = partial(scaled, width=width)
        self.branch3x3_1 = BasicConv2d(in_channels, c(192), kernel_size=1)
        self.branch3x3_2 = BasicConv2d(c(192), c(320), kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(in_channels, c(192), kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(c(192), c(192), kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(c(192), c(192), kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(c(192), c(192), kernel_size=3, stride=2)
        self.out_channels = c(320) + c(192) + in_channels

    def forward(self, x: Tensor) -> Tensor:
        """Run the three branches and concatenate them."""
        branch3x3 = self.branch3x3_2(self.branch3x3_1(x))
        branch7x7x3 = self.branch7x7x3_2(self.branch7x7x3_1(x))
        branch7x7x3 = self.branch7x7x3_4(self.branch7x7x3_3(branch7x7x3))
        branch_pool = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([branch3x3, branch7x7x3, branch_pool], 1)


class InceptionE(nn.Module):
    """Expanded filter bank: (1x1 | 1x1-[1x3, 3x1] | 1x1-3x3-[1x3, 3x1] | avgpool-1x1).

    The two middle branches split again into parallel 1x3/3x1 convs that are
    concatenated before the outer concatenation (nested joins).
    """

    def __init__(self, in_channels: int, width: float = 1.0) -> None:
        super().__init__()
        c = partial(scaled, width=width)
        self.branch1x1 = BasicConv2d(in_channels, c(320), kernel_size=1)
        self.branch3x3_1 = BasicConv2d(in_channels, c(384), kernel_size=1)
        self.branch3x3_2a = BasicConv2d(c(384), c(384), kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(c(384), c(384), kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(in_channels, c(448), kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(c(448), c(384), kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(c(384), c(384), kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(c(384), c(384), kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(in_channels, c(192), kernel_size=1)
        self.out_channels = c(320) + 4 * c(384) + c(192)

    def forward(self, x: Tensor) -> Tensor:
        """Run the branches (with their nested splits) and concatenate them."""
        branch1x1 = self.branch1x1(x)

        branch3x3 = self.branch3x3_1(x)
        branch3x3 = torch.cat([self.branch3x3_2a(branch3x3), self.branch3x3_2b(branch3x3)], 1)

        branch3x3dbl = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        branch3x3dbl = torch.cat(
            [self.branch3x3dbl_3a(branch3x3dbl), self.branch3x3dbl_3b(branch3x3dbl)], 1
        )

        branch_pool = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([branch1x1, branch3x3, branch3x3dbl, branch_pool], 1)


class Inception3(ImageClassifierIO, nn.Module):
    """Inception-v3 trunk (Conv2d_1a_3x3 ... Mixed_7c) + avgpool + dropout + fc; no AuxLogits."""

    def __init__(
        self,
        num_classes: int = 1000,
        width: float = 1.0,
        dropout: float = 0.5,
        input_size: int = 299,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        c = partial(scaled, width=width)
        self.in_channels = in_channels
        self.input_size = input_size
        self.num_classes = num_classes
        self.Conv2d_1a_3x3 = BasicConv2d(in_channels, c(32), kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(c(32), c(32), kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(c(32), c(64), kernel_size=3, padding=1)
        self.maxpool1 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.Conv2d_3b_1x1 = BasicConv2d(c(64), c(80), kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(c(80), c(192), kernel_size=3)
        self.maxpool2 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.Mixed_5b = InceptionA(c(192), pool_features=32, width=width)
        self.Mixed_5c = InceptionA(self.Mixed_5b.out_channels, pool_features=64, width=width)
        self.Mixed_5d = InceptionA(self.Mixed_5c.out_channels, pool_features=64, width=width)
        self.Mixed_6a = InceptionB(self.Mixed_5d.out_channels, width=width)
        self.Mixed_6b = InceptionC(self.Mixed_6a.out_channels, channels_7x7=128, width=width)
        self.Mixed_6c = InceptionC(self.Mixed_6b.out_channels, channels_7x7=160, width=width)
        self.Mixed_6d = InceptionC(self.Mixed_6c.out_channels, channels_7x7=160, width=width)
        self.Mixed_6e = InceptionC(self.Mixed_6d.out_channels, channels_7x7=192, width=width)
        self.Mixed_7a = InceptionD(self.Mixed_6e.out_channels, width=width)
        self.Mixed_7b = InceptionE(self.Mixed_7a.out_channels, width=width)
        self.Mixed_7c = InceptionE(self.Mixed_7b.out_channels, width=width)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(self.Mixed_7c.out_channels, num_classes)
        init_cnn_(self)

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``[B, C, H, W]`` (H, W >= 75) to logits ``[B, num_classes]``."""
        x = self.Conv2d_1a_3x3(x)
        x = self.Conv2d_2a_3x3(x)
        x = self.Conv2d_2b_3x3(x)
        x = self.maxpool1(x)
        x = self.Conv2d_3b_1x1(x)
        x = self.Conv2d_4a_3x3(x)
        x = self.maxpool2(x)
        x = self.Mixed_5b(x)
        x = self.Mixed_5c(x)
        x = self.Mixed_5d(x)
        x = self.Mixed_6a(x)
        x = self.Mixed_6b(x)
        x = self.Mixed_6c(x)
        x = self.Mixed_6d(x)
        x = self.Mixed_6e(x)
        x = self.Mixed_7a(x)
        x = self.Mixed_7b(x)
        x = self.Mixed_7c(x)
        x = self.avgpool(x)
        x = self.dropout(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def inception_v3(num_classes: int = 1000) -> Inception3:
    """Inception-v3 without aux logits, 3x299x299 inputs; 23,834,568 parameters at 1000 classes."""
    return Inception3(num_classes=num_classes)


def inception_small(num_classes: int = 10) -> Inception3:
    """Inception-v3 block structure at 1/8 width, 3x75x75 inputs (the minimum size), no dropout."""
    return Inception3(num_classes=num_classes, width=0.125, dropout=0.0, input_size=75)

"""VGG networks without batch norm, laid out like torchvision's ``VGG`` (configs "D" and "E")."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .example_io import ImageClassifierIO
from .weight_init import init_cnn_

# Feature-extractor layouts: an int is a 3x3 conv with that many output channels, "M" a 2x2 max-pool.
CFG_D: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)
CFG_E: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
    512, 512, 512, 512, "M", 512, 512, 512, 512, "M",
)


def scale_cfg(cfg: Sequence[int | str], divisor: int) -> tuple[int | str, ...]:
    """Divide every conv width in ``cfg`` by ``divisor`` (at least 1), keeping the pools."""
    return tuple(v if v == "M" else max(1, int(v) // divisor) for v in cfg)


def make_features(cfg: Sequence[int | str], in_channels: int = 3) -> nn.Sequential:
    """Build the ``features`` Sequential: Conv3x3(pad 1) + ReLU per int, MaxPool2d(2, 2) per "M"."""
    layers: list[nn.Module] = []
    channels = in_channels
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers.append(nn.Conv2d(channels, int(v), kernel_size=3, padding=1))
            layers.append(nn.ReLU(inplace=True))
            channels = int(v)
    return nn.Sequential(*layers)


def _last_width(cfg: Sequence[int | str]) -> int:
    return int([v for v in cfg if v != "M"][-1])


class VGG(ImageClassifierIO, nn.Module):
    """VGG: ``features`` -> ``avgpool`` (AdaptiveAvgPool2d) -> flatten -> ``classifier``.

    The classifier is Linear-ReLU-Dropout, Linear-ReLU-Dropout, Linear, as in torchvision.
    """

    def __init__(
        self,
        cfg: Sequence[int | str],
        num_classes: int = 1000,
        pool_size: int = 7,
        hidden_features: int = 4096,
        dropout: float = 0.5,
        input_size: int = 224,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.input_size = input_size
        self.num_classes = num_classes
        self.features = make_features(cfg, in_channels)
        self.avgpool = nn.AdaptiveAvgPool2d((pool_size, pool_size))
        self.classifier = nn.Sequential(
            nn.Linear(_last_width(cfg) * pool_size * pool_size, hidden_features),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden_features, hidden_features),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden_features, num_classes),
        )
        init_cnn_(self)

    def forward(self, x: Tensor) -> Tensor:
        """Map images ``[B, C, H, W]`` to logits ``[B, num_classes]``."""
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def vgg16(num_classes: int = 1000) -> VGG:
    """VGG-16 (config "D", no BN) for 3x224x224 inputs; 138,357,544 parameters at 1000 classes."""
    return VGG(CFG_D, num_classes=num_classes)


def vgg19(num_classes: int = 1000) -> VGG:
    """VGG-19 (config "E", no BN) for 3x224x224 inputs; 143,667,240 parameters at 1000 classes."""
    return VGG(CFG_E, num_classes=num_classes)


def vgg16_small(num_classes: int = 10) -> VGG:
    """VGG-16 structure (13 convs, 3 linears) at 1/8 width for 3x32x32 inputs; 1x1 pool, no dropout."""
    return VGG(
        scale_cfg(CFG_D, 8),
        num_classes=num_classes,
        pool_size=1,
        hidden_features=128,
        dropout=0.0,
        input_size=32,
    )

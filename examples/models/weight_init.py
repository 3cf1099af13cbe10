"""Weight initialisation schemes shared by the zoo models."""

from __future__ import annotations

from torch import nn


def init_cnn_(module: nn.Module) -> None:
    """Initialise a CNN in place: Kaiming-normal (fan_out) convs, unit norms, N(0, 0.01) linears.

    This keeps activations of the deep ReLU networks (VGG, ResNet, Inception)
    at a stable scale. Biases are zeroed.
    """
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def init_transformer_(module: nn.Module, std: float = 0.02) -> None:
    """Initialise a transformer in place (HF style): N(0, std) linears/embeddings, zero biases,
    unit LayerNorms."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

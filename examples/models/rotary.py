"""Rotary position embeddings (RoPE) in the Llama / Hugging Face "rotate half" convention."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    """Map the last-dim halves ``(x1, x2)`` to ``(-x2, x1)``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, H, T, D]`` by the per-position angles in ``cos``/``sin`` ``[T, D]``."""
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables ``[max_position_embeddings, head_dim]`` (non-persistent buffers).

    ``forward(position_ids)`` looks the tables up by position, so callers may
    start at any offset (e.g. the length of a KV cache).
    """

    def __init__(self, head_dim: int, max_position_embeddings: int, base: float) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (base**exponents)
        positions = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", angles.cos(), persistent=False)
        self.register_buffer("sin_cached", angles.sin(), persistent=False)

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Return ``(cos, sin)``, each ``[len(position_ids), head_dim]``."""
        return self.cos_cached[position_ids], self.sin_cached[position_ids]

"""Tensor helpers for explicit multi-head attention (no fused SDPA kernels).

Attention is spelled out as ``q @ k^T * scale -> softmax -> @ v`` so that FLOP
counters and head-level passes can see every matmul in a traced graph.
"""

from __future__ import annotations

from torch import Tensor


def split_heads(x: Tensor, num_heads: int, head_dim: int) -> Tensor:
    """Reshape ``[B, T, num_heads * head_dim]`` to ``[B, num_heads, T, head_dim]``."""
    return x.unflatten(-1, (num_heads, head_dim)).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """Reshape ``[B, H, T, head_dim]`` back to ``[B, T, H * head_dim]``."""
    return x.transpose(1, 2).flatten(2)


def attention_scores(query: Tensor, key: Tensor, scale: float) -> Tensor:
    """Scaled dot-product scores ``query @ key^T * scale`` of shape ``[B, H, Tq, Tk]``."""
    return query @ key.transpose(-1, -2) * scale

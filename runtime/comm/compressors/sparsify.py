"""Sparsification: Top-K (largest magnitudes, all-gather) and random-K (shared random
coordinates, all-reduce), both with error feedback.

``fraction`` is K as a fraction of the tensor's elements, in (0, 1]; ``K = ceil(fraction n)``.
Top-K's coordinates differ by rank, so each rank sends (values, int32 indices) and the ranks'
sparse vectors are summed after an all-gather. Random-K draws the same coordinates on every
rank (seeded by ``(seed, key, step)``), so only the values are all-reduced. Both return the
average over ranks of the sparse vectors; the rest stays in the residual.

Example:
    >>> import torch
    >>> from tidal.runtime.comm.compressors import TopK, synchronize
    >>> c = TopK(0.25)
    >>> synchronize(c, {"g": torch.tensor([0.1, -2.0, 0.3, 1.0])})["g"].tolist()
    [0.0, -2.0, 0.0, 0.0]
    >>> c.payload_bytes((100,))       # 25 float32 values + 25 int32 indices
    200
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from tidal.ir.compression_model import sparse_k
from tidal.runtime.comm.compressors.base import (ALL_GATHER, ALL_REDUCE, Compressor, Message, World,
                                           seeded_generator)


class _Sparsifier(Compressor):
    """Shared parts of Top-K and random-K: the fraction knob and ``K``."""

    def __init__(self, fraction: float = 0.01, *, error_feedback: bool = True, seed: int = 0):
        super().__init__(error_feedback=error_feedback, seed=seed)
        self.fraction = self.check_level(fraction)

    @property
    def default_level(self) -> float:
        return self.fraction

    def k(self, numel: int, level: Any = None) -> int:
        """How many coordinates are kept of ``numel``."""
        return sparse_k(numel, self.fraction if level is None else level)

    def _keep_sparse_error(self, key: str, m: torch.Tensor, idx: torch.Tensor,
                           shape: tuple[int, ...]) -> None:
        """Keep ``m`` with the sent coordinates ``idx`` zeroed as the residual (in place)."""
        if self.error_feedback:
            self._keep_error(key, m.index_fill_(0, idx, 0.0), None, shape)


class TopK(_Sparsifier):
    """Top-K sparsification with error feedback; all-gather of values and indices."""

    name = "topk"

    def encode(self, key: str, tensor: torch.Tensor, world: World) -> Message:
        m = self._with_error(key, tensor).reshape(-1)
        idx = torch.topk(m.abs(), self.k(m.numel(), self.level(key)), sorted=False).indices
        vals = m[idx]
        self._keep_sparse_error(key, m, idx, tuple(tensor.shape))
        self._next_step(key)
        return Message((vals, idx.to(torch.int32)), ALL_GATHER, ctx=tuple(tensor.shape))

    def decode(self, key: str, message: Message, reduced: tuple[torch.Tensor, ...],
               world: World, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        vals, idx = reduced
        total = torch.zeros(math.prod(message.ctx), dtype=torch.float32, device=vals.device)
        for r in range(world.size):                       # in rank order: deterministic sums
            total.index_add_(0, idx[r].long(), vals[r])
        return (total / world.size).reshape(message.ctx)


class RandomK(_Sparsifier):
    """Random-K sparsification with error feedback; the coordinates are shared by all ranks, so
    the values are all-reduced."""

    name = "randomk"

    def indices(self, key: str, step: int, numel: int, k: int) -> torch.Tensor:
        """The ``k`` coordinates of ``key`` at ``step`` (the same on every rank)."""
        gen = seeded_generator(self.seed, key, step)
        return torch.randperm(numel, generator=gen)[:k]     # on the CPU: alike on every device

    def encode(self, key: str, tensor: torch.Tensor, world: World) -> Message:
        m = self._with_error(key, tensor).reshape(-1)
        idx = self.indices(key, self._next_step(key), m.numel(), self.k(m.numel(),
                                                                         self.level(key)))
        idx = idx.to(m.device)
        vals = m[idx]
        self._keep_sparse_error(key, m, idx, tuple(tensor.shape))
        return Message((vals,), ALL_REDUCE, ctx=(tuple(tensor.shape), idx))

    def decode(self, key: str, message: Message, reduced: tuple[torch.Tensor, ...],
               world: World, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        shape, idx = message.ctx
        total = torch.zeros(math.prod(shape), dtype=torch.float32, device=reduced[0].device)
        total[idx] = reduced[0] / world.size
        return total.reshape(shape)

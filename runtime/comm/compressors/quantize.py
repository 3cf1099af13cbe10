"""Quantization: signSGD with majority vote and QSGD with ``s`` levels (both all-gather).

signSGD (Bernstein et al.) sends one bit per element (packed eight to a byte); the ranks' signs
are combined by majority vote, ``sign(sum_i sign(g_i))`` (0 on a tie). Majority vote is not a
sum, so it needs all-gather. With ``error_feedback=True`` each rank also sends the scale
``mean|M|`` and keeps ``M - scale sign(M)`` as residual (EF-signSGD); the vote is then scaled by
the mean of the ranks' scales.

QSGD (Alistarh et al.) sends ``||v||_2`` and, per element, ``sign(v_i) xi_i`` with
``xi_i in {0, .., s}`` drawn so that ``E[||v|| sign(v_i) xi_i / s] = v_i``: with
``r = |v_i| s / ||v||`` and ``l = floor(r)``, ``xi_i = l + 1`` with probability ``r - l``, else
``l``. The norm is per rank, so the ranks' vectors are dequantized after an all-gather and
averaged. Levels go on the wire as int8 (s <= 127) or int16 (s <= 32767).

Example:
    >>> import torch
    >>> from tidal.runtime.comm.compressors import SignSGD, synchronize
    >>> synchronize(SignSGD(), {"g": torch.tensor([0.5, -2.0, 0.0])})["g"].tolist()
    [1.0, -1.0, 1.0]
    >>> SignSGD().payload_bytes((1000,))          # 1000 bits
    125
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from tidal.ir.compression_model import qsgd_value_bytes
from tidal.runtime.comm.compressors.base import ALL_GATHER, Compressor, Message, World, seeded_generator

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool vector into uint8, most significant bit first (zero-padded to 8)."""
    pad = (-bits.numel()) % 8
    b = torch.cat([bits.reshape(-1), bits.new_zeros(pad)]).view(-1, 8).to(torch.int32)
    w = torch.tensor(_BIT_WEIGHTS, dtype=torch.int32, device=bits.device)
    return (b * w).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` bits as a bool vector."""
    w = torch.tensor(_BIT_WEIGHTS, dtype=torch.int32, device=packed.device)
    return ((packed.to(torch.int32).unsqueeze(-1) & w) != 0).reshape(*packed.shape[:-1], -1)[
        ..., :numel]


class SignSGD(Compressor):
    """signSGD with majority vote (optionally EF-signSGD scaling)."""

    name = "signsgd"

    def __init__(self, *, error_feedback: bool = False, seed: int = 0):
        super().__init__(error_feedback=error_feedback, seed=seed)

    def encode(self, key: str, tensor: torch.Tensor, world: World) -> Message:
        m = self._with_error(key, tensor).reshape(-1)
        positive = m >= 0
        self._next_step(key)
        tensors = (pack_bits(positive),)
        if self.error_feedback:
            scale = m.abs().mean().reshape(1)
            self._keep_error(key, m, scale * (positive.to(torch.float32) * 2 - 1),
                             tuple(tensor.shape))
            tensors += (scale,)
        return Message(tensors, ALL_GATHER, ctx=tuple(tensor.shape))

    def decode(self, key: str, message: Message, reduced: tuple[torch.Tensor, ...],
               world: World, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        shape = message.ctx
        signs = unpack_bits(reduced[0], math.prod(shape)).to(torch.float32) * 2 - 1
        vote = torch.sign(signs.sum(0))
        if self.error_feedback:
            vote = vote * reduced[1].mean()
        return vote.reshape(shape)


class QSGD(Compressor):
    """QSGD with ``levels`` (s) quantization levels per sign; unbiased stochastic rounding
    seeded by ``(seed, key, step, rank)``."""

    name = "qsgd"

    def __init__(self, levels: int = 4, *, error_feedback: bool = False, seed: int = 0):
        super().__init__(error_feedback=error_feedback, seed=seed)
        self.levels = self.check_level(levels)

    @property
    def default_level(self) -> int:
        return self.levels

    @staticmethod
    def _dtype(levels: int) -> torch.dtype:
        """The wire dtype of the levels (as many bytes as ``qsgd_value_bytes`` counts)."""
        return torch.int8 if qsgd_value_bytes(levels) == 1 else torch.int16

    @staticmethod
    def quantize(v: torch.Tensor, uniforms: torch.Tensor, levels: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm, signed levels)`` of ``v`` given uniform draws in [0, 1) per element."""
        norm = torch.linalg.vector_norm(v)
        if norm == 0:
            return norm.reshape(1), torch.zeros_like(v, dtype=torch.int32)
        r = v.abs() / norm * levels
        low = torch.floor(r)
        xi = low + (uniforms < (r - low)).to(v.dtype)
        return norm.reshape(1), (torch.sign(v) * xi).to(torch.int32)

    def encode(self, key: str, tensor: torch.Tensor, world: World) -> Message:
        m = self._with_error(key, tensor).reshape(-1)
        s = self.level(key)
        gen = seeded_generator(self.seed, key, self._next_step(key), world.rank)
        uniforms = torch.rand(m.numel(), generator=gen).to(m.device)   # alike on every device
        norm, q = self.quantize(m, uniforms, s)
        self._keep_error(key, m, norm * q.to(torch.float32) / s, tuple(tensor.shape))
        return Message((norm, q.to(self._dtype(s))), ALL_GATHER, ctx=(tuple(tensor.shape), s))

    def decode(self, key: str, message: Message, reduced: tuple[torch.Tensor, ...],
               world: World, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        shape, s = message.ctx
        norms, q = reduced
        deq = norms.reshape(-1, 1) * q.to(torch.float32) / s
        return (deq.sum(0) / world.size).reshape(shape)

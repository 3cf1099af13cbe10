"""PowerSGD (Vogels et al., 2019): rank-r power iteration with error feedback and warm start.

A gradient of shape ``(n, ...)`` is viewed as an ``n x m`` matrix ``M`` (plus the residual). One
step: ``P = M Q`` -> all-reduce -> ``P^ = orthogonalize(P)`` -> ``Q = M^T P^`` -> all-reduce ->
result ``P^ Q^T / world``. Both collectives are sums, so PowerSGD is all-reduce compatible.
The residual kept is ``M - P^ (M^T P^)^T``, this rank's own approximation, so that the average
of the ranks' approximations is exactly what is returned. With warm start the aggregated ``Q``
seeds the next step. Tensors with one dimension, or whose compression rate
``n m / ((n + m) r)`` is below ``min_compression_rate``, are all-reduced uncompressed.

Example:
    >>> import torch
    >>> from tidal.runtime.comm.compressors import PowerSGD, synchronize
    >>> c = PowerSGD(rank=2, min_compression_rate=0)
    >>> g = torch.randn(6, 2) @ torch.randn(2, 5)            # a rank-2 gradient
    >>> torch.allclose(synchronize(c, {"w": g})["w"], g, atol=1e-5)
    True
    >>> c.payload_bytes((64, 64)), c.payload_bytes((64,))   # (n + m) r floats; 1-d: as is
    (1024, 256)
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch

from tidal.ir.compression_model import check_option, matrix_dims, powersgd_rank
from tidal.runtime.comm.compressors.base import (ALL_REDUCE, Compressor, Message, World, plain_decode,
                                            plain_message, seeded_generator)


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p``'s columns (reduced QR; n >= r)."""
    return torch.linalg.qr(p, mode="reduced").Q


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD. ``min_compression_rate``: compress a tensor only when
    ``n m >= min_compression_rate (n + m) r`` (0: every matrix). ``warm_start``: reuse the last
    ``Q``. ``seed``: the initial ``Q`` (identical on all ranks)."""

    name = "powersgd"

    def __init__(self, rank: int = 4, *, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True, seed: int = 0):
        super().__init__(error_feedback=error_feedback, seed=seed)
        self.rank = self.check_level(rank)
        self.min_compression_rate = check_option(self.name, "min_compression_rate",
                                                 min_compression_rate)
        self.warm_start = bool(warm_start)
        self._qs: dict[str, torch.Tensor] = {}

    @property
    def default_level(self) -> int:
        return self.rank

    def _q(self, key: str, m: int, r: int, device: torch.device) -> torch.Tensor:
        """The ``m x r`` float32 starting ``Q`` on ``device``: the warm-start one (columns
        added or dropped when the rank changed), else fresh standard normal columns seeded by
        (seed, key, step) (drawn on the CPU, so every device starts alike)."""
        step = self._next_step(key)
        old = self._qs.get(key) if self.warm_start else None
        if old is not None and old.shape[0] == m and old.shape[1] >= r:
            return old[:, :r].to(device)
        tag = "init" if self.warm_start else step
        fresh = torch.randn(m, r, generator=seeded_generator(self.seed, key, tag),
                            dtype=torch.float32)
        if old is not None and old.shape[0] == m:
            fresh[:, :old.shape[1]] = old
        return fresh.to(device)

    def encode(self, key: str, tensor: torch.Tensor, world: World) -> Message:
        shape = tuple(tensor.shape)
        level = self.level(key)
        if self.uncompressed(shape, level):
            return plain_message(tensor)
        n, m = matrix_dims(shape)
        mat = self._with_error(key, tensor).reshape(n, m)
        q = self._q(key, m, powersgd_rank(shape, level), mat.device)
        return Message((mat @ q,), ALL_REDUCE, ctx=("p", shape, mat))

    def decode(self, key: str, message: Message, reduced: tuple[torch.Tensor, ...],
               world: World, out: Optional[torch.Tensor] = None) -> Union[torch.Tensor, Message]:
        stage, shape = message.ctx[0], message.ctx[1]
        if stage == "plain":
            return plain_decode(message, reduced, world, out)
        mat = message.ctx[2]
        if stage == "p":
            p_hat = orthogonalize(reduced[0])
            return Message((mat.t() @ p_hat,), ALL_REDUCE, ctx=("q", shape, mat, p_hat))
        p_hat, q_local = message.ctx[3], message.tensors[0]
        self._keep_error(key, mat, (p_hat, q_local), shape)
        q_mean = reduced[0] / world.size
        if self.warm_start:
            self._qs[key] = q_mean
        if out is not None and out.dtype == torch.float32 and out.is_contiguous():
            torch.mm(p_hat, q_mean.t(), out=out.view(p_hat.shape[0], -1))
            return out
        return (p_hat @ q_mean.t()).reshape(shape)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["qs"] = {k: v.clone() for k, v in self._qs.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._qs = {k: v.clone() for k, v in state.get("qs", {}).items()}

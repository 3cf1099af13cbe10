"""Running compressors' messages through ``torch.distributed``: one collective per round and dtype.

:class:`Comm` wraps a process group (None: the default group, or a single process when no group
is initialised). :func:`synchronize` drives a compressor over a set of named tensors: every
tensor's message of the current round is packed, by collective and dtype, into one flat buffer
(so a bucket costs one all-reduce per round, as in DDP), the results are split back and decoded.

Example:
    >>> import torch
    >>> from tidal.runtime.compressors import make_compressor, synchronize
    >>> out = synchronize(make_compressor("powersgd:1", min_compression_rate=0),
    ...                   {"w": torch.ones(4, 3)})
    >>> torch.allclose(out["w"], torch.ones(4, 3))   # a rank-1 matrix survives rank 1
    True
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.distributed as dist

from tidal.runtime.compressors.base import ALL_REDUCE, Compressor, Message, World


class Comm:
    """Collectives on ``group``. ``all_gather=False`` declares a group on which all-gather is not
    available; a compressor that needs it is then refused with a ``ValueError``."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, all_gather: bool = True):
        self.group = group
        self.all_gather_available = all_gather
        self.bytes_sent = 0

    @property
    def world(self) -> World:
        """Rank and size in the group ((0, 1) with no process group)."""
        if not (dist.is_available() and dist.is_initialized()):
            return World(0, 1)
        return World(dist.get_rank(self.group), dist.get_world_size(self.group))

    def check(self, compressor: Compressor) -> None:
        """Refuse a compressor that needs all-gather on a group without it."""
        if not compressor.all_reduce_compatible and not self.all_gather_available:
            raise ValueError(f"compressor {compressor.spec()!r} needs all-gather, which is not "
                             f"available on process group {self.group!r}")

    def run(self, messages: list[Message]) -> list[tuple[torch.Tensor, ...]]:
        """Run every message's collective; one flat collective per (op, dtype)."""
        world = self.world
        groups: dict[tuple[str, torch.dtype], list[tuple[int, int]]] = {}
        for i, msg in enumerate(messages):
            for j, t in enumerate(msg.tensors):
                groups.setdefault((msg.op, t.dtype), []).append((i, j))
        results: list[list] = [[None] * len(m.tensors) for m in messages]
        for (op, _dtype), slots in groups.items():
            parts = [messages[i].tensors[j].reshape(-1) for i, j in slots]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
            self.bytes_sent += flat.numel() * flat.element_size()
            if op == ALL_REDUCE:
                if world.size > 1:
                    dist.all_reduce(flat, group=self.group)
                out = flat
                pieces = torch.split(out, [p.numel() for p in parts])
            else:
                if world.size > 1:
                    out = torch.empty(world.size * flat.numel(), dtype=flat.dtype)
                    dist.all_gather_single(out, flat, group=self.group)
                    out = out.view(world.size, -1)
                else:
                    out = flat.view(1, -1)
                pieces = torch.split(out, [p.numel() for p in parts], dim=1)
            for (i, j), piece in zip(slots, pieces):
                shape = messages[i].tensors[j].shape
                results[i][j] = (piece.reshape(shape) if op == ALL_REDUCE
                                 else piece.reshape((world.size, *shape)))
        return [tuple(r) for r in results]


class LocalComm(Comm):
    """A :class:`Comm` of one process whatever the process group: the collectives are the
    identity, so :func:`synchronize` does all of a compressor's local work (encode, packing,
    decode) and no communication. Used to time encode + decode."""

    @property
    def world(self) -> World:
        return World(0, 1)


def synchronize(compressor: Compressor, tensors: Mapping[str, torch.Tensor],
                comm: Optional[Comm] = None) -> dict[str, torch.Tensor]:
    """Compress, communicate and decode ``tensors`` (name -> local gradient); returns name ->
    synchronized tensor (float32, the input's shape). Collective: every rank must call it with
    the same names in the same order."""
    comm = comm or Comm()
    comm.check(compressor)
    world = comm.world
    pending = {k: compressor.encode(k, t, world) for k, t in tensors.items()}
    done: dict[str, torch.Tensor] = {}
    while pending:
        keys = list(pending)
        reduced = comm.run([pending[k] for k in keys])
        nxt = {}
        for k, r in zip(keys, reduced):
            out = compressor.decode(k, pending[k], r, world)
            if isinstance(out, Message):
                nxt[k] = out
            else:
                done[k] = out
        pending = nxt
    return {k: done[k] for k in tensors}

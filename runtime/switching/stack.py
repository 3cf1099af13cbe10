"""A worker's allocator: tensors carved stack-wise from its arena lease (a model's weights, then
its activations), with AntMan's memory cap and the fallback of a job over it.

:class:`ArenaStack` never calls the device allocator: :meth:`~ArenaStack.take` returns a view of
the arena block at the stack top, :meth:`~ArenaStack.mark`/:meth:`~ArenaStack.pop` free stack-wise
(an iteration's activations are popped at its end). The ``cap`` (bytes, ``None``: the whole
lease) bounds what the job may hold in the arena; a request past it (or past the lease) is
served outside the arena instead, by the ordinary allocator of the region's device, and
counted in ``spills``/``spilled_bytes``: the job runs on, correct, outside its cap. On a GPU a
kernel takes no host tensor (AntMan's Universal Memory reads host memory over the bus through
mapped memory, which PyTorch does not allocate), so a spill is device memory the arena does not
hold; on the CPU it is host memory. ``set_cap`` changes the cap between iterations; a lowered
cap applies to the next requests (what is already carved stays).

Example:
    >>> import torch
    >>> from tidal.runtime.switching.stack import ArenaStack
    >>> block = torch.zeros(4096, dtype=torch.uint8)
    >>> s = ArenaStack(block, cap=1024)
    >>> w = s.take((64,), torch.float32)      # 256 bytes in the arena
    >>> a = s.take((256,), torch.float32)     # 1024 more: past the cap, a spill
    >>> s.used, s.spills, s.spilled_bytes
    (256, 1, 1024)
    >>> w.data_ptr() == block.data_ptr(), a.data_ptr() == block.data_ptr()
    (True, False)
"""
from __future__ import annotations

from typing import Optional

import torch

from tidal.runtime.switching.arena import round_up

TENSOR_ALIGN = 64
"""Alignment of each carved tensor (bytes)."""


class ArenaStack:
    """Stack allocator over ``region`` (a ``uint8`` tensor: a worker's lease of the arena); see
    the module docstring."""

    def __init__(self, region: torch.Tensor, cap: Optional[int] = None):
        if region.dtype != torch.uint8 or region.dim() != 1:
            raise ValueError("ArenaStack: region must be a 1-D uint8 tensor")
        self.region = region
        self.used = 0
        self.cap = cap
        self.spills = 0
        self.spilled_bytes = 0
        self.high_water = 0

    @property
    def limit(self) -> int:
        """Bytes of the region the job may hold (its cap, at most the region)."""
        n = self.region.numel()
        return n if self.cap is None else min(n, self.cap)

    def set_cap(self, cap: Optional[int]) -> None:
        """Raise or lower the cap (between iterations)."""
        if cap is not None and cap < 0:
            raise ValueError(f"ArenaStack: cap={cap} must be >= 0")
        self.cap = cap

    def take_bytes(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` as a ``uint8`` tensor at the stack top, or a spill when the cap or the
        region would be exceeded: ``nbytes`` on the region's device from its ordinary allocator,
        outside the arena (counted)."""
        start = round_up(self.used, TENSOR_ALIGN)
        if start + nbytes > self.limit:
            self.spills += 1
            self.spilled_bytes += nbytes
            return torch.empty(nbytes, dtype=torch.uint8, device=self.region.device)
        self.used = start + nbytes
        self.high_water = max(self.high_water, self.used)
        # a tensor of its own on the region's bytes: its own autograd version counter, so
        # writing one carved tensor (a weight transfer) does not invalidate another (inputs
        # autograd saved); no memory is allocated
        carved = torch.empty(0, dtype=torch.uint8, device=self.region.device)
        return carved.set_(self.region.untyped_storage(), self.region.storage_offset() + start,
                           (nbytes,))

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` (see :meth:`take_bytes`)."""
        n = 1
        for d in shape:
            n *= int(d)
        raw = self.take_bytes(n * dtype.itemsize)
        return raw.view(dtype).reshape(shape)

    def like(self, t: torch.Tensor) -> torch.Tensor:
        """A carved copy of ``t``."""
        out = self.take(tuple(t.shape), t.dtype)
        out.copy_(t)
        return out

    def mark(self) -> int:
        """The stack top now (pass it to :meth:`pop` to free what is carved after it)."""
        return self.used

    def pop(self, mark: int) -> None:
        """Free everything carved after ``mark``."""
        if not 0 <= mark <= self.used:
            raise ValueError(f"ArenaStack.pop: mark {mark} is not on the stack (top {self.used})")
        self.used = mark

    def on_arena(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in the region (not spilled)."""
        base = self.region.data_ptr()
        return t.device == self.region.device and base <= t.data_ptr() < base + self.region.numel()

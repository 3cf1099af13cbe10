"""The memory daemon's arena: one block of device memory per device, allocated once, from which
every job's memory is carved (PipeSwitch's unified memory management).

:class:`Arena` calls the allocator exactly once (``allocations`` counts it; tests check it stays
1 however many switches follow). A job's memory is a :class:`Lease`, a byte range of the block
placed first-fit among the ranges no other job holds; the worker that runs the job carves its
tensors from the lease stack-wise (:class:`tidal.runtime.switching.stack.ArenaStack`). On a GPU the
block is a CUDA tensor the worker processes map by CUDA IPC; on the CPU it is a shared-memory
tensor, so the semantics (one block, leases, no allocation after start) are the same.

Example:
    >>> from tidal.runtime.switching.arena import Arena
    >>> arena = Arena(4096)
    >>> a = arena.lease("a", 1000)
    >>> b = arena.lease("b", 1000)
    >>> (a.offset, a.nbytes), (b.offset, b.nbytes)
    ((0, 1024), (1024, 1024))
    >>> arena.release(a); arena.lease("c", 512).offset, arena.allocations
    (0, 1)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from tidal.runtime.switching.device import resolve_device
from tidal.runtime.switching.errors import SwitchingError

ALIGN = 512
"""Lease alignment in bytes (PipeSwitch's transfer block)."""


def round_up(x: int, unit: int) -> int:
    """``x`` rounded up to a multiple of ``unit``."""
    return (x + unit - 1) // unit * unit


@dataclass(frozen=True)
class Lease:
    """Bytes ``[offset, offset + nbytes)`` of the arena, held by ``owner``."""

    owner: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class Arena:
    """One block of ``capacity`` bytes on ``device``, allocated at construction (the only
    allocator call: ``allocations``), handed out as :class:`Lease` ranges. ``block`` is the
    ``uint8`` tensor the workers receive; ``device`` is indexed (a bare ``"cuda"``: the
    current CUDA device)."""

    def __init__(self, capacity: int, device: Any = "cpu"):
        if capacity <= 0:
            raise ValueError(f"Arena: capacity={capacity} must be > 0")
        self.device = resolve_device(device)
        self.capacity = round_up(capacity, ALIGN)
        self.allocations = 0
        self.block = self._allocate(self.capacity)
        self._leases: dict[str, Lease] = {}

    def _allocate(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        block = block.share_memory_() if self.device.type == "cpu" else block
        return block.zero_()  # touch every page now, not during a switch

    def lease(self, owner: str, nbytes: int) -> Lease:
        """The first free range of ``nbytes`` (rounded up to :data:`ALIGN`) for ``owner``;
        raises ``SwitchingError`` when no free range is large enough (``fits`` asks first)."""
        if owner in self._leases:
            raise SwitchingError(f"arena: {owner!r} already holds {self._leases[owner]}")
        where = self.find(nbytes)
        if where is None:
            raise SwitchingError(f"arena: no free range of {round_up(nbytes, ALIGN)} bytes for "
                                 f"{owner!r} ({self.describe()})")
        self._leases[owner] = Lease(owner, where, round_up(nbytes, ALIGN))
        return self._leases[owner]

    def find(self, nbytes: int) -> Optional[int]:
        """The offset a lease of ``nbytes`` would get now, or None if none fits."""
        need, at = round_up(max(nbytes, 1), ALIGN), 0
        for held in sorted(self._leases.values(), key=lambda l: l.offset):
            if held.offset - at >= need:
                return at
            at = max(at, held.end)
        return at if self.capacity - at >= need else None

    def release(self, lease: Lease) -> None:
        """Give ``lease`` back (its owner's tensors must no longer be used)."""
        if self._leases.get(lease.owner) != lease:
            raise SwitchingError(f"arena: {lease} is not held")
        del self._leases[lease.owner]

    def holder(self, owner: str) -> Optional[Lease]:
        """The lease ``owner`` holds, if any."""
        return self._leases.get(owner)

    def describe(self) -> str:
        held = ", ".join(f"{l.owner} [{l.offset}, {l.end})" for l in
                         sorted(self._leases.values(), key=lambda l: l.offset))
        return f"{self.capacity} bytes on {self.device}, held: {held or 'none'}"

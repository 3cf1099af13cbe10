"""A trainer's embedding cache for one table: row storage, id -> slot, TTL.

Rows live in one growing tensor; freed slots are reused. Updates use exactly the reference
optimizer's arithmetic (``row.add_(g, alpha=-lr)``), so a cached row ends bit for bit where the
same row of a full table would.

Example:
    >>> import torch
    >>> c = TableCache("tables.0", dim=2, dtype=torch.float64)
    >>> c.insert([5, 7], torch.tensor([[1., 2.], [3., 4.]], dtype=torch.float64), ttl=3)
    >>> c.update([7], torch.tensor([[10., 10.]], dtype=torch.float64), lr=0.5)
    >>> c.rows([7, 5]).tolist()
    [[-2.0, -1.0], [1.0, 2.0]]
    >>> c.evict([5]).tolist(), 5 in c, len(c)
    ([[1.0, 2.0]], False, 1)
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["TableCache"]


class TableCache:
    """Cached rows of table ``name`` (``dim`` wide, ``dtype``) on one trainer."""

    def __init__(self, name: str, dim: int, dtype: torch.dtype):
        self.name = name
        self.dim = dim
        self.dtype = dtype
        self._store = torch.empty(0, dim, dtype=dtype)
        self._slot: dict[int, int] = {}
        self._ttl: dict[int, int] = {}
        self._free: list[int] = []

    def __contains__(self, i: int) -> bool:
        return int(i) in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def ids(self) -> list[int]:
        """Cached ids, ascending."""
        return sorted(self._slot)

    def ttl(self, i: int) -> int:
        """The TTL of cached id ``i`` (the batch after which it is evicted)."""
        return self._ttl[int(i)]

    def set_ttl(self, ids: Sequence[int], ttl: int) -> None:
        """TTL update of cached ids."""
        for i in ids:
            self._ttl[int(i)] = ttl

    def _slots(self, ids: Sequence[int]) -> torch.Tensor:
        try:
            return torch.tensor([self._slot[int(i)] for i in ids], dtype=torch.long)
        except KeyError as e:
            raise KeyError(f"bagpipe cache: table {self.name!r} has no cached row for id "
                           f"{e.args[0]}") from None

    def insert(self, ids: Sequence[int], rows: torch.Tensor, ttl: int = -1) -> None:
        """Cache ``rows[k]`` as the row of ``ids[k]`` (replacing a cached copy)."""
        ids = [int(i) for i in ids]
        if rows.shape != (len(ids), self.dim):
            raise ValueError(f"bagpipe cache: table {self.name!r} got rows of shape "
                             f"{tuple(rows.shape)} for {len(ids)} ids of width {self.dim}")
        new = [i for i in ids if i not in self._slot]
        need = len(new) - len(self._free)
        if need > 0:
            base = self._store.shape[0]
            grow = max(need, base)
            self._store = torch.cat([self._store, torch.zeros(grow, self.dim, dtype=self.dtype)])
            self._free.extend(range(base + grow - 1, base - 1, -1))
        for i in new:
            self._slot[i] = self._free.pop()
        for i in ids:
            self._ttl[i] = ttl
        if ids:
            self._store[self._slots(ids)] = rows.to(self.dtype)

    def rows(self, ids: Sequence[int]) -> torch.Tensor:
        """A copy of the cached rows of ``ids`` (KeyError naming the table for a missing id)."""
        return self._store[self._slots(ids)]

    def assign(self, ids: Sequence[int], rows: torch.Tensor) -> None:
        """Overwrite cached rows (a promoted id's value from its owner)."""
        if len(ids):
            self._store[self._slots(ids)] = rows

    def update(self, ids: Sequence[int], grad: torch.Tensor, lr: float) -> None:
        """SGD step of cached rows: ``row.add_(g, alpha=-lr)``."""
        if not len(ids):
            return
        slots = self._slots(ids)
        rows = self._store[slots]
        rows.add_(grad, alpha=-lr)
        self._store[slots] = rows

    def evict(self, ids: Sequence[int]) -> torch.Tensor:
        """Remove ``ids``; returns their rows (for the write-back)."""
        rows = self.rows(ids)
        for i in ids:
            self._free.append(self._slot.pop(int(i)))
            self._ttl.pop(int(i), None)
        return rows

"""Per-iteration statistics of a Bagpipe run (one trainer's, or summed over trainers).

Example:
    >>> a = IterationStats(iteration=0, lookups=10, hits=4, bytes_fetched=48)
    >>> b = IterationStats(iteration=0, lookups=10, hits=6, bytes_fetched=16)
    >>> s = IterationStats.total([a, b])
    >>> s.hit_rate, s.bytes_fetched, s.bytes_moved
    (0.5, 64, 64)
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

__all__ = ["IterationStats"]


@dataclass
class IterationStats:
    """Counters of one iteration: ``lookups`` (distinct ids used, per trainer), ``hits`` (of
    those, already cached), rows/bytes prefetched, rows synced on / off the critical path,
    rows promoted (LRPP local -> shared), rows/bytes written back, bytes all-reduced for rows
    (``bytes_synced``), bytes on the critical path (synchronous fetches, critical syncs,
    write-backs the next prefetch waits for; the dense all-reduce, the same under every
    policy, is not counted) and the iteration's seconds (max over trainers in a total)."""

    iteration: int
    lookups: int = 0
    hits: int = 0
    rows_fetched: int = 0
    bytes_fetched: int = 0
    rows_synced_critical: int = 0
    rows_synced_background: int = 0
    rows_promoted: int = 0
    bytes_synced: int = 0
    rows_written: int = 0
    bytes_written: int = 0
    bytes_critical: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Fraction of lookups served by the cache (1.0 with no lookups)."""
        return self.hits / self.lookups if self.lookups else 1.0

    @property
    def bytes_moved(self) -> int:
        """Bytes fetched, written back and synced."""
        return self.bytes_fetched + self.bytes_written + self.bytes_synced

    @classmethod
    def total(cls, per_trainer: Sequence["IterationStats"]) -> "IterationStats":
        """Sum over trainers (seconds: the slowest)."""
        out = cls(iteration=per_trainer[0].iteration)
        for f in fields(cls):
            if f.name in ("iteration", "seconds"):
                continue
            setattr(out, f.name, sum(getattr(s, f.name) for s in per_trainer))
        out.seconds = max(s.seconds for s in per_trainer)
        return out

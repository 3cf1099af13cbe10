"""AntMan's limits of a background job, read at each iteration boundary: a memory cap against
the job's ``memory_bytes`` (above it the job is held until the cap is raised) and a compute
share (the fraction of device time it may use).

Example:
    >>> Limits(memory_bytes=100).holds(need=1000), Limits().holds(need=1000)
    (True, False)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tidal.runtime.scheduling.records import JobStats


@dataclass
class Limits:
    """AntMan-style limits of a background job, read at each iteration boundary:
    ``memory_bytes`` (None: no cap) and ``compute_share`` (fraction of device time, 1.0: any)."""

    memory_bytes: Optional[int] = None
    compute_share: float = 1.0

    def holds(self, need: int) -> bool:
        """Whether the memory cap holds back an iteration that needs ``need`` bytes."""
        return self.memory_bytes is not None and need > self.memory_bytes

    def over_share(self, stats: JobStats, now: float) -> bool:
        """Whether the job already used more than its compute share of the time since its
        first piece."""
        return self.compute_share < 1.0 and stats.first_us is not None and \
            stats.busy_us > self.compute_share * (now - stats.first_us)

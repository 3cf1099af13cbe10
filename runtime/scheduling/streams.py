"""The backend streams of a runtime: one per job role (foreground or background), stream name
and whether it occupies the device. Compute streams take the role's priority, communication
streams (pieces that leave the device free) the low one; ``priorities=False`` makes all
equal. A ``pool`` dict keeps them for the next runtime on the same backend.

Example:
    >>> from tidal.runtime.backend import LogicalBackend
    >>> pool = StreamPool(LogicalBackend(lambda label, collocated: 1.0), priorities=True)
    >>> pool.stream(True, "compute", True) is pool.stream(True, "compute", True)
    True
"""
from __future__ import annotations

from typing import Any, Optional

from tidal.runtime.backend import HIGH, LOW, Backend
from tidal.runtime.scheduling.handle import JobHandle, Queued


class StreamPool:
    """Streams by (foreground, name, occupies the device), made on first use."""

    def __init__(self, backend: Backend, priorities: bool, pool: Optional[dict] = None):
        self.backend = backend
        self.priorities = priorities
        self.streams: dict = pool if pool is not None else {}

    def stream(self, foreground: bool, name: str, uses_device: bool) -> Any:
        """The stream of a job role (``foreground``) and stream name (see the module
        docstring)."""
        key = (foreground, name, uses_device)
        if key not in self.streams:
            urgent = foreground and self.priorities and uses_device
            self.streams[key] = self.backend.stream(HIGH if urgent else LOW)
        return self.streams[key]

    def of(self, h: JobHandle, q: Queued) -> Any:
        """The stream piece ``q`` of job ``h`` runs on, at the job's current role."""
        return self.stream(h.foreground, q.piece.stream, q.uses_device)

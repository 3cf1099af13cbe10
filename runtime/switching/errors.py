"""The error of task switching: a worker died, stalled or failed, or a request cannot be met.

Example:
    >>> from tidal.runtime.switching.errors import SwitchingError
    >>> str(SwitchingError("worker 1 (job 'bert') died (exit code -9)"))
    "worker 1 (job 'bert') died (exit code -9)"
"""
from __future__ import annotations

from tidal.ir.errors import TidalError


class SwitchingError(TidalError):
    """A switch failed: a worker process died, stalled past its timeout or raised, or the
    arena has no room for a job."""

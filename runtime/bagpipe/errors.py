"""Errors of the Bagpipe runtime.

Example:
    >>> from tidal.runtime.bagpipe.errors import BagpipeError
    >>> str(BagpipeError("trainer 1 died at iteration 3", trainer=1, iteration=3))
    'trainer 1 died at iteration 3'
"""
from __future__ import annotations

from typing import Optional

from tidal.ir.errors import TidalError

__all__ = ["BagpipeError"]


class BagpipeError(TidalError):
    """A Bagpipe run failed: a process died or stalled, or the inputs were wrong. ``trainer``
    and ``iteration`` name the trainer and iteration at fault when known; ``checkpoint`` is the
    last complete checkpoint directory (None when there is none)."""

    def __init__(self, message: str, *, trainer: Optional[int] = None,
                 iteration: Optional[int] = None, checkpoint: Optional[str] = None):
        super().__init__(message)
        self.trainer = trainer
        self.iteration = iteration
        self.checkpoint = checkpoint

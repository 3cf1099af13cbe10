"""Errors of the Bagpipe runtime.

Example:
    >>> from tidal.runtime.bagpipe.errors import BagpipeError, BagpipePeerFailure
    >>> str(BagpipeError("trainer 1 died at iteration 3", trainer=1, iteration=3))
    'trainer 1 died at iteration 3'
    >>> e = BagpipePeerFailure("trainer 1 stalled", peer_name="trainer 1", trainer=1,
    ...                        timeout_s=20.0)
    >>> isinstance(e, BagpipeError), e.pass_name, e.peer, e.peer_name
    (True, 'bagpipe', 1, 'trainer 1')
"""
from __future__ import annotations

from typing import Optional

from tidal.ir.errors import TidalError
from tidal.runtime.peer_failures import PeerFailureError

__all__ = ["BagpipeError", "BagpipePeerFailure"]


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


class BagpipePeerFailure(BagpipeError, PeerFailureError):
    """A Bagpipe process (a trainer, the Oracle Cacher or an embedding server) died or stalled,
    told by the one that waited for it: ``peer_name`` names it ("trainer 1", "oracle cacher",
    "embedding server 0"), ``peer`` is a trainer's rank (None for the others), ``what`` the RPC
    or collective that did not complete, ``timeout_s`` the timeout of the run; the error the
    waiting process saw is its ``__cause__``. ``pass_name`` is "bagpipe"."""

    def __init__(self, message: str, *, what: str = "", peer_name: str = "",
                 trainer: Optional[int] = None, iteration: Optional[int] = None,
                 checkpoint: Optional[str] = None, timeout_s: Optional[float] = None):
        PeerFailureError.__init__(self, message, pass_name="bagpipe", what=what, peer=trainer,
                                  timeout_s=timeout_s, peer_name=peer_name)
        self.trainer, self.iteration, self.checkpoint = trainer, iteration, checkpoint

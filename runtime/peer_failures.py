"""A collective that failed or timed out (a peer rank or process stalled or died), told as
one error: :class:`PeerFailureError` naming who ran it (a pass, Bagpipe), the piece, the peer
and the process group's timeout, the gloo/NCCL error chained (:func:`peer_failure`);
:func:`is_peer_failure` tells such an error apart, :func:`peer_of` the peer it names. The
programs' step failures (``tidal.runtime.programs.step_failures``) and Bagpipe both raise it.
"""
from __future__ import annotations

import re
from typing import Optional

import torch.distributed as dist

from tidal.ir.errors import TidalError
from tidal.runtime.distributed import group_timeout_s

PEER_SIGNS = ("connection closed by peer", "timed out waiting", "connection reset by peer",
              "broken pipe", "gloo", "nccl", "socket timeout", "connection refused",
              "timeout caused pair closure")
"""Text of a failed collective (lower case) in a ``RuntimeError`` that is not a
``torch.distributed.DistError``."""


class PeerFailureError(TidalError, RuntimeError):
    """A collective of a step failed or timed out: a peer rank stalled or died. Names the pass
    (``pass_name``), the piece (``piece``, '' if none), the peer (``peer``: its rank, None when
    unknown) and the group's timeout (``timeout_s``, None when unknown); the gloo/NCCL error is
    its ``__cause__``. ``peer_name`` names the peer process where a rank does not say it all
    (Bagpipe's "trainer 1", "oracle cacher", "embedding server 0"; '' when unknown)."""

    def __init__(self, message: str, *, pass_name: str = "", piece: str = "", what: str = "",
                 peer: Optional[int] = None, timeout_s: Optional[float] = None,
                 peer_name: str = ""):
        super().__init__(message)
        self.pass_name, self.piece, self.what = pass_name, piece, what
        self.peer, self.timeout_s, self.peer_name = peer, timeout_s, peer_name


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's failure (a ``DistError``, or gloo/NCCL text).

    Example:
        >>> is_peer_failure(RuntimeError("[pair.cc:534] Connection closed by peer [::1]:5"))
        True
        >>> is_peer_failure(RuntimeError("shape mismatch"))
        False
    """
    if isinstance(exc, PeerFailureError):
        return True
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc).lower() for s in PEER_SIGNS)


def peer_of(text: str) -> Optional[int]:
    """The peer rank a failed collective's ``text`` names, else the other rank of a 2-rank
    world, else None.

    Example:
        >>> peer_of("[rank 3] Timed out waiting 15000ms for recv")   # no process group
        3
        >>> peer_of("Connection closed by peer [127.0.0.1]:5000") is None
        True
    """
    me, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and \
        dist.is_initialized() else (None, 1)
    named = [int(r) for r in re.findall(r"\brank\s*[:=]?\s*(\d+)", text, re.IGNORECASE)
             if int(r) != me]
    if named:
        return named[0]
    return 1 - me if world == 2 and me is not None else None


def peer_failure(who: str, what: str, exc: BaseException, piece: str = "") -> PeerFailureError:
    """The :class:`PeerFailureError` for collective ``what`` of pass ``who`` (in piece
    ``piece``) failing with ``exc`` (itself a ``PeerFailureError`` without a piece: given one).

    Example:
        >>> e = peer_failure("round_robin", "the loss all-reduce", RuntimeError("Timed out"), "L")
        >>> print(e)    # doctest: +NORMALIZE_WHITESPACE
        round_robin: piece 'L': the loss all-reduce did not complete: a peer rank stalled or
        died (a peer; the process group's timeout: unknown): RuntimeError: Timed out
    """
    if isinstance(exc, PeerFailureError):
        if exc.piece or not piece:
            return exc
        what, exc = exc.what, exc.__cause__ or exc
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    first = re.sub(r"(Got the following error when running the callback: \w+: )+", "",
                   first)[:200]   # a future's callbacks (a compressor's) wrap it
    peer, timeout = peer_of(str(exc)), group_timeout_s()
    where = f"piece {piece!r}: " if piece else ""
    error = PeerFailureError(
        f"{who}: {where}{what} did not complete: a peer rank stalled or died "
        f"({'a peer' if peer is None else f'rank {peer}'}; the process group's timeout: "
        f"{'unknown' if timeout is None else f'{timeout:g} s'}): {type(exc).__name__}: "
        f"{first}", pass_name=who, piece=piece, what=what, peer=peer, timeout_s=timeout)
    error.__cause__ = exc
    return error

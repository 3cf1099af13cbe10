"""What ``Runtime.submit`` takes: a :class:`Job` (a name, the memory it needs, the bound pieces
of each iteration), and the usual ones: :class:`FunctionJob`, :func:`step_job` and
:func:`lowered_job`.

Example:
    >>> job = step_job("train", lambda: None, iterations=2)
    >>> [b.piece.name for b in job.iteration(0)], job.iteration(2)
    (['train'], None)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

from tidal.ir.program import COMPUTE, Piece
from tidal.runtime.scheduling.pieces import BoundPiece


class Job(Protocol):
    """What ``Runtime.submit`` takes: a ``name``, ``memory_bytes`` it needs per iteration, and
    ``iteration(i)`` returning the bound pieces of iteration ``i`` (None when the job is done).
    A job may also have ``ready(i)``: iteration ``i`` is asked for only once it returns True
    (a training step built from the state the previous step left)."""

    name: str
    memory_bytes: int

    def iteration(self, index: int) -> Optional[Sequence[BoundPiece]]: ...


@dataclass
class FunctionJob:
    """A job whose iteration ``i`` is ``make_pieces(i)``, for ``iterations`` iterations (None:
    until the runtime stops)."""

    name: str
    make_pieces: Callable[[int], Sequence[BoundPiece]]
    iterations: Optional[int] = None
    memory_bytes: int = 0

    def iteration(self, index: int) -> Optional[Sequence[BoundPiece]]:
        """The pieces of iteration ``index``, or None past the last iteration."""
        if self.iterations is not None and index >= self.iterations:
            return None
        return self.make_pieces(index)


def step_job(name: str, fn: Callable[[], Any], iterations: Optional[int] = None,
             memory_bytes: int = 0, piece: Optional[Piece] = None) -> FunctionJob:
    """A job of one piece per iteration running ``fn()`` (e.g. ``lambda: compiled.step(x,
    y)``): ``piece``, by default a segment named ``name`` on the compute stream."""
    bound = BoundPiece(piece if piece is not None else Piece(name, COMPUTE), fn)
    return FunctionJob(name, lambda i: [bound], iterations, memory_bytes)


def lowered_job(name: str, lowered: Any, inputs: Sequence[Any],
                iterations: Optional[int] = None, memory_bytes: int = 0,
                extra: Callable[[int], Sequence[BoundPiece]] = lambda i: ()) -> FunctionJob:
    """A job running the pieces of ``lowered`` (a ``LoweredModule``) on ``inputs`` each
    iteration, followed by ``extra(i)`` pieces (e.g. a host-side wait for peers)."""
    return FunctionJob(name, lambda i: list(lowered.pieces(*inputs).pieces) + list(extra(i)),
                       iterations, memory_bytes)

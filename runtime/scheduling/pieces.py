"""What the scheduler dispatches: a :class:`~tidal.ir.program.Piece` paired with the function
that runs it (:class:`BoundPiece`), and what the scheduler derives from the piece's kind and
stream: whether it occupies the device (:func:`uses_device`) and its operator class
(:func:`operator_class`, what ``sensitive_kinds`` and the trace name).

Example:
    >>> from tidal.ir.program import COMM, COMPUTE, HOST, Piece
    >>> [(uses_device(p), operator_class(p)) for p in (Piece("f", COMPUTE),
    ...  Piece("ar", COMM), Piece("wait", COMPUTE, kind=HOST))]
    [(True, 'compute'), (False, 'collective'), (False, 'host')]
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

from tidal.ir.program import COMM, COMPUTE, HOST, LOAD, OPTIMIZER, SEGMENT, TRANSFER, Piece
from tidal.runtime.backend import HIGH, LOW

STREAMS = {COMPUTE: (HIGH, True), COMM: (LOW, False), LOAD: (LOW, False),
           TRANSFER: (HIGH, False)}
"""Stream name -> (priority, occupies the device). ``transfer``: the foreground's own sample
transfers between GPU sets (burst parallelism's scatter/gather), which mostly wait for other
ranks: the device is idle meanwhile (the spans a background job fills). A stream a program
names that is not here (a wave's own compute stream, ``"tick"``/``"tock"``) is a
high-priority compute stream."""


def stream_kind(name: str) -> tuple[int, bool]:
    """(priority, occupies the device) of the stream ``name`` (see :data:`STREAMS`).

    Example:
        >>> stream_kind("comm"), stream_kind("tick")
        ((0, False), (-1, True))
    """
    return STREAMS.get(name, (HIGH, True))


class BoundPiece(NamedTuple):
    """A piece of one iteration and the function that runs it (``fn()`` on the piece's
    stream). The piece's ``deps`` index the iteration's list of bound pieces."""

    piece: Piece
    fn: Callable[[], Any]


def uses_device(piece: Piece) -> bool:
    """Whether ``piece`` occupies the device while it runs: any piece on a compute stream
    (:func:`stream_kind`) but host work; communication and loads on their own streams leave it
    free (host-side waiting, for peers or data)."""
    return piece.kind != HOST and stream_kind(piece.stream)[1]


def operator_class(piece: Piece) -> str:
    """The operator class the scheduler knows ``piece`` by (``Runtime(sensitive_kinds=...)``,
    ``TraceRecord.kind``): ``compute`` for a segment or the optimizer step, else the piece's
    kind (``collective``, ``point_to_point``, ``load``, ``host``)."""
    return "compute" if piece.kind in (SEGMENT, OPTIMIZER) else piece.kind

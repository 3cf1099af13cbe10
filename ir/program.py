"""The Program: the one IR from plan to execution and simulation.

A :class:`Program` is one rank's step as :class:`Piece` objects: each has a ``kind`` (what it
is: a ``segment`` of the captured graph, a ``collective`` or ``point_to_point`` transfer, a
weight ``load``, the ``optimizer`` update, or ``host`` work), the ``stream`` it runs on, the
indices of the pieces it waits for (``deps``, always earlier pieces) and an estimated
``duration_us``. Builders make Programs from a graph and a plan; the runtime's interpreter runs
them on a backend, the scheduler dispatches them beside other jobs, and the simulator runs the
same objects with modelled durations.

Example:
    >>> p = Program((Piece("segment 0", COMPUTE, (), ("a", "b")),
    ...              Piece("all_reduce 0", COMM, (0,), grads=(0, 1)),
    ...              Piece("optimizer", COMPUTE, (0, 1), kind=OPTIMIZER)), world=2)
    >>> [q.kind for q in p.pieces]
    ['segment', 'collective', 'optimizer']
"""
from __future__ import annotations

from dataclasses import dataclass

SEGMENT, COLLECTIVE, POINT_TO_POINT = "segment", "collective", "point_to_point"
LOAD, OPTIMIZER, HOST = "load", "optimizer", "host"
KINDS = (SEGMENT, COLLECTIVE, POINT_TO_POINT, LOAD, OPTIMIZER, HOST)

COMPUTE, COMM, TRANSFER = "compute", "comm", "transfer"
"""Stream names: ``compute`` (a wave may name its own compute stream, e.g. ``tick``), ``comm``
(collectives), ``transfer`` (point-to-point sample transfers) and ``load`` (weight loads)."""

_KIND_OF_STREAM = {COMM: COLLECTIVE, TRANSFER: POINT_TO_POINT, LOAD: LOAD}


@dataclass(frozen=True)
class Piece:
    """One unit of a program: ``name``, its ``stream``, the indices of the pieces it waits for
    (``deps``), the joint-graph nodes of a segment (``nodes``), the gradient indices a
    collective averages (``grads``, positions in the captured step's parameters), its
    ``kind`` (one of :data:`KINDS`; left empty it follows the stream: ``comm`` a collective,
    ``transfer`` point-to-point, ``load`` a load, any other a segment), the estimated
    ``duration_us`` and the ``ranks`` a collective or transfer involves (empty: not known
    here, e.g. every rank of the world)."""

    name: str
    stream: str
    deps: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    grads: tuple[int, ...] = ()
    kind: str = ""
    duration_us: float = 0.0
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", _KIND_OF_STREAM.get(self.stream, SEGMENT))
        if self.kind not in KINDS:
            raise ValueError(f"piece {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.duration_us < 0:
            raise ValueError(f"piece {self.name!r}: negative duration {self.duration_us}")


@dataclass(frozen=True)
class Program:
    """A rank's pieces for one step on ``world`` ranks."""

    pieces: tuple[Piece, ...]
    world: int

    def __post_init__(self) -> None:
        for i, p in enumerate(self.pieces):
            bad = [d for d in p.deps if not 0 <= d < i]
            if bad:
                raise ValueError(f"piece {i} {p.name!r} waits for piece {bad[0]}, which is "
                                 f"not an earlier piece")

    def table(self) -> str:
        """One line per piece: stream, name, what it waits for and its size."""
        rows = []
        width = max((len(p.name) for p in self.pieces), default=0)
        for i, p in enumerate(self.pieces):
            what = f"{len(p.nodes)} nodes" if p.nodes else f"{len(p.grads)} gradients" \
                if p.grads else ""
            deps = ", ".join(self.pieces[d].name for d in p.deps)
            rows.append(f"{i:3d} {p.stream:7s} {p.name:{width}s} {what:14s} after: {deps or '-'}")
        return "\n".join(rows)

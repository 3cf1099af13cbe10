"""The Program: the one IR from plan to execution and simulation.

A :class:`Program` is one rank's step as :class:`Piece` objects: each has a ``kind`` (what it
is: a ``segment`` of the captured graph, a ``collective`` or ``point_to_point`` transfer, a
weight ``load``, the ``optimizer`` update, or ``host`` work), the ``stream`` it runs on, the
indices of the pieces it waits for (``deps``, always earlier pieces) and an estimated
``duration_us``. Builders make Programs from a graph and a plan; the runtime's interpreter runs
them on a backend, the scheduler dispatches them beside other jobs, and the simulator runs the
same objects with modelled durations.

A Program of the whole cluster (what the simulator's engine runs, ``tidal.sim.engine``) *places*
every piece: its ``ranks`` are the GPUs it occupies (one for a segment, every participant of a
collective), and its ``deps`` may be pieces of other ranks. The simulator joins per-rank
Programs into one (``tidal.sim.programs.join_ranks``: the collectives of the same name on
several ranks become one piece on all of them).

The pure rules behind Programs live here: :func:`data_parallel_program` (the data-parallel
schedule that the runtime builds from a captured step and the simulator from per-layer costs),
:func:`split_pieces` (segments cut to a bounded duration) and :func:`node_pieces` (one piece per
node of each segment).

Example:
    >>> p = Program((Piece("segment 0", COMPUTE, (), ("a", "b")),
    ...              Piece("all_reduce 0", COMM, (0,), grads=(0, 1)),
    ...              Piece("optimizer", COMPUTE, (0, 1), kind=OPTIMIZER)), world=2)
    >>> [q.kind for q in p.pieces]
    ['segment', 'collective', 'optimizer']
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from tidal.ir.comm_cost import DDP_BUCKET_BYTES, gradient_buckets

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
    world: int = 1

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


EVERY_RANK = "every rank"
"""The bucket key of data parallelism: every rank syncs every gradient."""


def data_parallel_program(units: Sequence[str], grads: Sequence[tuple[int, float, int]],
                          world: int, bucket_bytes: float = DDP_BUCKET_BYTES,
                          overlap: bool = True, sync: str = "all_reduce") -> Program:
    """The data-parallel schedule of one training step, the one rule the runtime (from a
    captured step) and the simulator (from per-layer costs) build it by.

    ``units`` are the step's compute in execution order (the joint graph's nodes; the
    simulator's per-layer forwards and backwards); ``grads`` are, in the order backward issues
    them, ``(index, bytes, unit)`` per gradient: the index a sync piece lists in ``grads``, its
    bytes and the position in ``units`` of the unit that finishes it. The gradients go into
    buckets closed at ``bucket_bytes`` by the one bucket rule
    (:func:`tidal.ir.comm_cost.gradient_buckets`; every rank syncs every gradient, a gradient
    of 0 bytes has nothing to sync). The units are cut into ``segment k`` pieces after the unit
    that finishes each bucket's last gradient, so the bucket's ``<sync> b`` piece (``comm``
    stream) runs while the compute stream goes on with the rest of backward;
    ``overlap=False`` syncs every bucket after the last segment (the baseline). The
    ``optimizer`` piece comes last, after every sync.

    Example: two gradients of 8 bytes, one bucket each; the second finishes with the last unit:
        >>> p = data_parallel_program(["f", "b1", "b0"], [(1, 8.0, 1), (0, 8.0, 2)], world=2,
        ...                           bucket_bytes=8)
        >>> [(q.name, q.deps, q.nodes or q.grads) for q in p.pieces]  # doctest: +NORMALIZE_WHITESPACE
        [('segment 0', (), ('f', 'b1')), ('all_reduce 0', (0,), (1,)),
         ('segment 1', (0,), ('b0',)), ('all_reduce 1', (2,), (0,)),
         ('optimizer', (1, 2, 3), ())]
    """
    last = len(units) - 1
    unit_of = {index: unit for index, _, unit in grads}
    buckets = [tuple(b) for _, b in gradient_buckets(
        [(EVERY_RANK, index, nbytes) for index, nbytes, _ in grads], bucket_bytes)]
    ready = [max(unit_of[i] for i in b) if overlap else last for b in buckets]
    pieces: list[Piece] = []
    start, previous, syncs = 0, None, []
    for k, cut in enumerate(sorted(set(ready) | {last})):
        pieces.append(Piece(f"segment {k}", COMPUTE, () if previous is None else (previous,),
                            tuple(units[start:cut + 1])))
        previous, start = len(pieces) - 1, cut + 1
        for b in (b for b, r in enumerate(ready) if r == cut):
            pieces.append(Piece(f"{sync} {b}", COMM, (previous,), grads=buckets[b]))
            syncs.append(len(pieces) - 1)
    pieces.append(Piece("optimizer", COMPUTE, tuple(sorted(syncs + [previous])),
                        kind=OPTIMIZER))
    return Program(tuple(pieces), world)


def split_pieces(program: Program, time_us: Callable[[str], float], piece_us: float
                 ) -> Program:
    """``program`` with each compute segment split into consecutive pieces whose predicted
    duration (``time_us(node name)``, summed) stays under ``piece_us`` where a node allows
    (DeepPool splits background graphs at 0.5 ms), so the scheduler can fit other work between
    them. A piece that waited for a segment waits for its last part; names get ``.k``.

    Example:
        >>> p = Program((Piece("segment 0", COMPUTE, (), ("a", "b", "c")),
        ...              Piece("all_reduce 0", COMM, (0,), grads=(0,))), world=2)
        >>> [(q.name, q.deps) for q in split_pieces(p, lambda n: 10.0, 25.0).pieces]
        [('segment 0.0', ()), ('segment 0.1', (0,)), ('all_reduce 0', (1,))]
    """
    if not piece_us > 0:
        raise ValueError(f"split_pieces(piece_us={piece_us!r}): must be > 0")

    def parts(piece: Piece) -> list[Piece]:
        groups = _bounded_runs(piece.nodes, time_us, piece_us)
        if len(groups) == 1:
            return [piece]
        return [replace(piece, name=f"{piece.name}.{k}", nodes=nodes)
                for k, nodes in enumerate(groups)]

    return _expand(program, parts)


def node_pieces(program: Program, duration_us: Callable[[str], float]) -> Program:
    """``program`` with each segment replaced by one piece per node, named by the node, of
    ``duration_us(node)`` (in order, each after the one before); a piece that waited for the
    segment waits for its last node's piece. The simulator's granularity: one piece per layer's
    forward or backward.

    Example:
        >>> p = Program((Piece("segment 0", COMPUTE, (), ("F:a", "B:a")),
        ...              Piece("all_reduce 0", COMM, (0,), grads=(0,))), world=2)
        >>> [(q.name, q.deps, q.duration_us) for q in node_pieces(p, len).pieces]
        [('F:a', (), 3.0), ('B:a', (0,), 3.0), ('all_reduce 0', (1,), 0.0)]
    """
    def parts(piece: Piece) -> list[Piece]:
        return [replace(piece, name=node, nodes=(node,), duration_us=float(duration_us(node)))
                for node in piece.nodes]

    return _expand(program, parts)


def without(program: Program, drop: set[int], swap: Callable[[Piece], Piece] = lambda p: p
            ) -> tuple[Program, tuple[int, ...]]:
    """``program`` without the pieces whose indices are in ``drop`` (whatever depended on one
    depends on its dependencies instead), every other piece through ``swap`` (its
    dependencies are set here). Returns it and, per piece, its index in ``program``.

    Example:
        >>> p = Program((Piece("a", "s"), Piece("b", "s", (0,)), Piece("c", "s", (1,))))
        >>> q, origin = without(p, {1})
        >>> [(x.name, x.deps) for x in q.pieces], origin
        ([('a', ()), ('c', (0,))], (0, 2))
    """
    pieces = program.pieces
    index: dict[int, int] = {}
    out: list[Piece] = []

    def deps_of(deps: Sequence[int]) -> set[int]:
        return {k for d in deps for k in (deps_of(pieces[d].deps) if d in drop else {index[d]})}

    for i, p in enumerate(pieces):
        if i in drop:
            continue
        index[i] = len(out)
        out.append(replace(swap(p), deps=tuple(sorted(deps_of(p.deps)))))
    return Program(tuple(out), program.world), tuple(index)


def _expand(program: Program, parts_of: Callable[[Piece], list[Piece]]) -> Program:
    """``program`` with each piece that has nodes replaced by ``parts_of(piece)`` (consecutive,
    each after the one before, the first after what the piece waited for); what waited for
    the piece waits for its last part."""
    pieces: list[Piece] = []
    last_part: dict[int, int] = {}
    for i, piece in enumerate(program.pieces):
        deps = tuple(last_part[d] for d in piece.deps)
        for k, part in enumerate(parts_of(piece) if piece.nodes else [piece]):
            pieces.append(replace(part, deps=deps if k == 0 else (len(pieces) - 1,)))
        last_part[i] = len(pieces) - 1
    return Program(tuple(pieces), program.world)


def _bounded_runs(nodes: Sequence[str], time_us: Callable[[str], float], piece_us: float
                  ) -> list[tuple[str, ...]]:
    parts: list[list[str]] = [[]]
    spent = 0.0
    for name in nodes:
        t = time_us(name)
        if parts[-1] and spent + t > piece_us:
            parts.append([])
            spent = 0.0
        parts[-1].append(name)
        spent += t
    return [tuple(part) for part in parts]

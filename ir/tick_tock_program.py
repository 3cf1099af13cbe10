"""The program of one tick-tock step (Wavelet §3.2), pure: from the plan's schedule to pieces.

One piece per action of the first iteration of each wave (:func:`first_iteration`): ``F``,
``B`` and ``U`` on the wave's compute stream (``tick``/``tock``), ``A`` (Eq. 1's average and
the wave's all-reduce) on ``comm``, each after its lane's previous action; the tock's ``F``
after the tick's ``F``, its ``A`` after the tick's ``B``; the ``loss`` last.
``tidal.runtime.programs.tick_tock`` runs it, the simulator runs the same object.
:func:`open_step` makes the open step's program from it (``Compiled.backward``: no ``U``).

Example:
    >>> from tidal.passes.tick_tock import tick_tock_schedule
    >>> [p.name for p in tick_tock(tick_tock_schedule(ranks=1, fwd_us=1.0, bwd_us=2.0,
    ...                                                steps=2), world=1).pieces][:4]
    ['tick F', 'tick B', 'tock F', 'tock B']
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from tidal.ir.program import COMM, OPTIMIZER, Piece, Program, without
from tidal.ir.schedule import Action, Schedule

WAVES = ("T", "K")
"""The schedule's lanes: ``T`` the tick wave, ``K`` the tock wave."""
STREAMS = ("tick", "tock")
"""Each wave's compute stream (and the word its pieces' names start with), in WAVES order."""
LOSS = "loss"


def wave_stream(wave: str) -> str:
    """The compute stream of ``wave`` (``T``: ``tick``, ``K``: ``tock``)."""
    return STREAMS[WAVES.index(wave)]


def first_iteration(schedule: Schedule) -> list[Action]:
    """The actions of rank 0's first iteration of each wave (lanes ``T`` and ``K``), in the
    schedule's order. Raises ``ValueError`` naming the schedule when a lane is missing or an
    iteration lacks one of ``F``, ``B``, ``A``, ``U``."""
    acts = schedule.for_rank(0)
    first: dict[str, int] = {}
    for a in acts:
        if a.kind == "F" and a.lane in WAVES:
            first[a.lane] = min(first.get(a.lane, a.batch), a.batch)
    out = [a for a in acts if a.lane in first and a.batch == first[a.lane]]
    for wave in WAVES:
        kinds = sorted(a.kind for a in out if a.lane == wave)
        if kinds != sorted("FBAU"):
            raise ValueError(f"tick_tock: schedule {schedule.name!r} lane {wave!r} has actions "
                             f"{kinds} in its first iteration; expected one each of F, B, A, U")
    return out


def tick_tock(schedule: Schedule, world: int, forward: Sequence[str] = (),
              backward: Sequence[str] = (), grads: int = 0) -> Program:
    """The program of one tick-tock step on ``world`` ranks from the plan's ``schedule`` (see
    the module docstring): one piece per action of :func:`first_iteration`, ``F``/``B``/``U`` on
    the wave's stream, ``A`` on ``comm``, each after its lane's previous action, the tock's
    ``F`` after the tick's ``F`` and its ``A`` after the tick's ``B`` (Eq. 1), and the ``loss``
    last. ``forward``/``backward`` name the joint-graph nodes of the ``F``/``B`` segments
    (empty: eager pieces); ``grads`` is how many gradients an ``A`` averages.

    Example:
        >>> from tidal.passes.tick_tock import tick_tock_schedule
        >>> p = tick_tock(tick_tock_schedule(ranks=2, fwd_us=1.0, bwd_us=2.0, steps=2), world=2)
        >>> [(x.name, x.stream, x.deps) for x in p.pieces]  # doctest: +NORMALIZE_WHITESPACE
        [('tick F', 'tick', ()), ('tick B', 'tick', (0,)), ('tock F', 'tock', (0,)),
         ('tock B', 'tock', (2,)), ('tick A', 'comm', (1,)), ('tick U', 'tick', (4,)),
         ('tock A', 'comm', (1, 3)), ('tock U', 'tock', (6,)), ('loss', 'comm', (0, 2))]
    """
    pieces: list[Piece] = []
    index: dict[tuple[str, str], int] = {}
    last: dict[str, int] = {}
    cross = {("K", "F"): ("T", "F"), ("K", "A"): ("T", "B")}  # tock F: F_end; tock A: Eq. 1
    nodes = {"F": tuple(forward), "B": tuple(backward)}
    for a in first_iteration(schedule):
        deps = [last[a.lane]] if a.lane in last else []
        if (a.lane, a.kind) in cross:
            other = cross[(a.lane, a.kind)]
            if other not in index:
                raise ValueError(f"tick_tock: schedule {schedule.name!r} runs {a.label(False)} "
                                 f"before the {wave_stream(other[0])} wave's {other[1]}, which it "
                                 f"waits for")
            deps.append(index[other])
        pieces.append(Piece(f"{wave_stream(a.lane)} {a.kind}",
                            COMM if a.kind == "A" else wave_stream(a.lane), tuple(sorted(deps)),
                            nodes.get(a.kind, ()), tuple(range(grads)) if a.kind == "A" else (),
                            kind=OPTIMIZER if a.kind == "U" else ""))
        index[(a.lane, a.kind)] = last[a.lane] = len(pieces) - 1
    pieces.append(Piece(LOSS, COMM, (index[("T", "F")], index[("K", "F")])))
    return Program(tuple(pieces), world)


def open_step(program: Program, finish: str, sync: bool) -> tuple[Program, tuple[int, ...]]:
    """The open step's program (``Compiled.backward``) made from a step's ``program``
    (:func:`tick_tock`): each wave's ``U`` becomes ``<stream> <finish>`` on the wave's stream
    (no optimizer piece: the loop steps its optimizers), and without ``sync`` the ``A`` pieces
    (Eq. 1 and the waves' all-reduces) are left out, their dependencies passed on. Returns it
    and, per piece, its index in ``program`` (where a captured segment's steps are found).

    Example:
        >>> from tidal.passes.tick_tock import tick_tock_schedule
        >>> step = tick_tock(tick_tock_schedule(ranks=2, fwd_us=1.0, bwd_us=2.0, steps=2), 2)
        >>> p, origin = open_step(step, "accumulate", sync=False)
        >>> [(x.name, x.stream, x.deps) for x in p.pieces]  # doctest: +NORMALIZE_WHITESPACE
        [('tick F', 'tick', ()), ('tick B', 'tick', (0,)), ('tock F', 'tock', (0,)),
         ('tock B', 'tock', (2,)), ('tick accumulate', 'tick', (1,)),
         ('tock accumulate', 'tock', (1, 3)), ('loss', 'comm', (0, 2))]
        >>> origin
        (0, 1, 2, 3, 5, 7, 8)
        >>> [x.name for x in open_step(step, "grads", sync=True)[0].pieces][4:8]
        ['tick A', 'tick grads', 'tock A', 'tock grads']
    """
    drop = {i for i, p in enumerate(program.pieces) if not sync and p.name.endswith(" A")}

    def swap(p: Piece) -> Piece:  # a wave's update: a segment of the wave's stream now
        return replace(p, name=f"{p.name.split()[0]} {finish}", kind="") \
            if p.kind == OPTIMIZER else p

    return without(program, drop, swap)

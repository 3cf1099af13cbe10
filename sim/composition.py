"""The simulator's composition, checked against a measured run: the engine given each piece's
*measured* duration, compared with the executor's trace piece by piece.

What remains between the two is the model of streams, links, dependencies and the host (the
*composition* error), apart from the durations a cost model or profiler assumes (the
end-to-end error). The inputs are the per-rank Programs the executor ran (the same objects,
``ProgramExecutor.last_program``) and their traces (``last_trace``: one
``tidal.runtime.program.PieceTrace`` per piece, in program order) put on one clock
(:func:`on_one_clock`). :func:`measured_pieces` reads from them, per piece:

* its *own* duration: from the moment it could do its own work to its end. For a collective or
  transfer (a piece :func:`tidal.sim.programs.join_ranks` joins across ranks) that moment is
  the *last* participant's issue: an early rank's trace also times its wait for the others,
  which is the late rank's compute, not the collective. A piece after an asynchronous
  collective (the optimizer after a sync issued with ``async_op``, whose trace only times the
  issue) waits inside for the collective too: its own work starts no earlier than that
  collective's last issue, so the transfer lands in the piece that waited for it;
* its *dispatch gap*: how long after its dependencies and its stream were done on its rank it
  started (the host issuing it, a thread hand-off; the last rank to issue a joined piece has
  one too: the simulated piece starts when every rank's dispatch of it is done);
* its rank's *release*: when the rank began the step, after the earliest rank did (binding the
  step's tensors on the host; ranks that share cores start apart).

:func:`compose` runs the engine on the joined Programs with the own durations plus the terms
asked for (a dispatch delay per piece, the ranks' releases, each rank's side of a joined
piece: :func:`sides_us`), :func:`departure` finds the
first piece whose simulated start departs from the measured one and says by how much and
after what, and :func:`overlaps` says which compute and communication pieces overlap.

Example: two ranks of a step whose all-reduce rank 1 reaches 3 us late; rank 0 timed the wait:
    >>> from tidal.ir.program import Piece, Program
    >>> from tidal.runtime.program import PieceTrace
    >>> p = Program((Piece("b", "compute"), Piece("ar", "comm", (0,)),
    ...              Piece("opt", "compute", (1,))), world=2)
    >>> traces = {0: [PieceTrace("b", "compute", 0, 4), PieceTrace("ar", "comm", 4, 9),
    ...               PieceTrace("opt", "compute", 9, 10)],
    ...           1: [PieceTrace("b", "compute", 0, 7), PieceTrace("ar", "comm", 7, 9),
    ...               PieceTrace("opt", "compute", 9, 10)]}
    >>> own = {(m.rank, m.name): m.own_us for m in measured_pieces(p, traces)}
    >>> own[(0, "ar")], own[(1, "ar")]
    (2.0, 2.0)
    >>> step_us(compose(p, traces)), measured_step_us(traces)
    (10.0, 10.0)
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from tidal.ir.program import HOST, Piece, Program
from tidal.runtime.program import PieceTrace
from tidal.sim.engine import Interval, is_compute_lane, lane_of, simulate
from tidal.sim.programs import join_ranks, rank_programs, shared_keys

Traces = Mapping[int, Sequence[PieceTrace]]
"""Measured traces by rank, on one clock (:func:`on_one_clock`)."""

RELEASE = "release"
"""The name of the host piece :func:`compose` puts before each rank's step (its release)."""

ALONE = "alone"
"""The suffix of the stream :func:`compose` runs a shared piece on when it waited for no peer."""

DISPATCH = "dispatch"
"""The name and stream prefix of the host pieces :func:`compose` puts before a piece to delay
its start by its dispatch gap (``dispatch <stream>``)."""

SIDE = "side"
"""The name and stream prefix of the host piece :func:`compose` puts after a rank's side of a
joined piece that took longer than the shortest side (:func:`sides_us`)."""


def on_one_clock(traces: Traces, origins_us: Mapping[int, float]) -> dict[int, list[PieceTrace]]:
    """``traces`` on the clock all ranks share, starting at 0 with the earliest piece.
    ``origins_us[r]``: the zero of rank ``r``'s backend clock on a clock every rank reads
    alike, e.g. ``time.perf_counter() * 1e6 - backend.now_us()`` taken on the rank (one
    machine: ``perf_counter`` is the system's monotonic clock).

    Example:
        >>> t = on_one_clock({0: [PieceTrace("a", "compute", 5, 6)],
        ...                   1: [PieceTrace("a", "compute", 1, 3)]}, {0: 100.0, 1: 102.0})
        >>> [(r, x.start_us, x.end_us) for r, tr in t.items() for x in tr]
        [(0, 2.0, 3.0), (1, 0.0, 2.0)]
    """
    missing = sorted(set(traces) - set(origins_us))
    if missing:
        raise ValueError(f"on_one_clock: no clock origin for rank(s) {missing}")
    zero = min((t.start_us + origins_us[r] for r, trace in traces.items() for t in trace),
               default=0.0)
    return {r: [_shifted(t, origins_us[r] - zero) for t in trace]
            for r, trace in sorted(traces.items())}


def _shifted(trace: PieceTrace, by_us: float) -> PieceTrace:
    """``trace`` with every time it carries (start, end, ready, done) moved by ``by_us``."""
    def moved(t: Optional[float]) -> Optional[float]:
        return None if t is None else t + by_us
    return replace(trace, start_us=trace.start_us + by_us, end_us=trace.end_us + by_us,
                   ready_us=moved(trace.ready_us), done_us=moved(trace.done_us))


@dataclass(frozen=True)
class Measured:
    """One measured piece of a rank (see the module docstring): program index, name, stream,
    measured start and end, ``ready_us`` (when its dependencies and its stream were done on
    its rank), ``own_us`` (its own duration), ``gap_us`` (start - ready, at least 0) and
    ``joined``: a shared piece whose work ended after its last participant issued it (one
    that ended before, an empty broadcast or an asynchronous issue, waited for nobody)."""

    rank: int
    index: int
    name: str
    stream: str
    start_us: float
    end_us: float
    ready_us: float
    own_us: float
    joined: bool = False

    @property
    def gap_us(self) -> float:
        """The dispatch gap: how long it waited after it could start."""
        return max(0.0, self.start_us - self.ready_us)


def _checked(programs, traces: Traces) -> dict[int, Program]:
    by_rank = rank_programs(programs)
    for r, program in by_rank.items():
        if r not in traces:
            raise ValueError(f"composition: no trace for rank {r} of the programs")
        names = [t.name for t in traces[r]]
        want = [p.name for p in program.pieces]
        if names != want:
            at = next((i for i, (a, b) in enumerate(zip(names, want)) if a != b),
                      min(len(names), len(want)))
            raise ValueError(f"composition: the trace of rank {r} is not its program's run "
                             f"(piece {at}: trace {names[at:at + 1]}, program {want[at:at + 1]}"
                             f"; {len(names)} traced, {len(want)} pieces): trace the step "
                             f"that ran these Program objects")
    return by_rank


def ended_us(trace: PieceTrace) -> float:
    """When the work of a traced piece ended: the asynchronous collective it issued
    (``done_us``) when it issued one, else the piece itself.

    Example:
        >>> ended_us(PieceTrace("sync 0", "comm", 1, 2)), ended_us(
        ...     PieceTrace("sync 0", "comm", 1, 2, done_us=5))
        (2, 5)
    """
    return trace.end_us if trace.done_us is None else max(trace.end_us, trace.done_us)


def measured_pieces(programs, traces: Traces, gate_issue: bool = True) -> list[Measured]:
    """Every piece of every rank as measured (``programs`` as ``join_ranks`` takes them;
    ``traces`` on one clock, one entry per piece in program order), in rank and program
    order. Raises ``ValueError`` naming the rank and piece where a trace is not its
    program's run.

    A shared piece is taken to have waited for its last peer's issue only when its work
    ended after that issue (an empty broadcast, or an asynchronous collective's issue that
    ended before a peer issued, waited for nobody); a piece after an asynchronous collective
    whose end is known (``done_us``) does its own work from that end at the earliest, and
    (``gate_issue``) a piece after a shared piece whose end is not known from that piece's
    last issue at the earliest (right when the shared piece was an issue whose collective the
    piece waits for inside; wrong, and shortening the piece, when it was an empty or blocking
    one)."""
    by_rank = _checked(programs, traces)
    keys = {r: shared_keys(p) for r, p in by_rank.items()}
    last_issue: dict[tuple[str, int], float] = {}
    for r, k in keys.items():
        for i, key in k.items():
            last_issue[key] = max(last_issue.get(key, float("-inf")), traces[r][i].start_us)
    out = []
    for r, program in by_rank.items():
        trace, previous = traces[r], {}
        for i, piece in enumerate(program.pieces):
            t = trace[i]
            gates = [_dep_gate(trace[d], last_issue[keys[r][d]], gate_issue)
                     for d in piece.deps if d in keys[r]]
            joined = i in keys[r] and ended_us(t) > last_issue[keys[r][i]]
            # ready: this rank's own dependencies and stream (not its peers' issues: the last
            # rank to issue a joined piece has a dispatch gap of its own, which the simulated
            # piece waits for on that rank)
            before = [trace[d].end_us for d in piece.deps] + gates
            if joined:
                gates.append(last_issue[keys[r][i]])
            if piece.stream in previous:
                before.append(trace[previous[piece.stream]].end_us)
            previous[piece.stream] = i
            out.append(Measured(r, i, piece.name, piece.stream, t.start_us, t.end_us,
                                max(before, default=min(x.start_us for x in trace)),
                                float(max(0.0, ended_us(t) - max([t.start_us] + gates))),
                                joined))
    return out


def _dep_gate(dep: PieceTrace, last_issue_us: float, gate_issue: bool) -> float:
    """The earliest a piece after the shared piece ``dep`` does its own work: when ``dep``'s
    asynchronous collective ended (``done_us``), else (``gate_issue``) when its last
    participant issued it."""
    if dep.done_us is not None:
        return ended_us(dep)
    return last_issue_us if gate_issue else float("-inf")


DispatchClass = tuple[str, bool]
"""A piece's class for host dispatch: its stream, and whether it waits for a piece of another
stream (an event between threads: a hand-off that an inline piece on an idle stream does not
pay)."""


def dispatch_class(program: Program, index: int) -> DispatchClass:
    """The :data:`DispatchClass` of piece ``index`` of ``program``.

    Example:
        >>> from tidal.ir.program import Piece, Program
        >>> p = Program((Piece("a", "compute"), Piece("ar", "comm", (0,))))
        >>> dispatch_class(p, 0), dispatch_class(p, 1)
        (('compute', False), ('comm', True))
    """
    piece = program.pieces[index]
    return piece.stream, any(program.pieces[d].stream != piece.stream for d in piece.deps)


def dispatch_means(programs, measured: Sequence[Measured]) -> dict[DispatchClass, float]:
    """The host's dispatch per piece class (:func:`dispatch_class`): the *mean* measured gap
    (:attr:`Measured.gap_us`) of the class's pieces of ``measured`` over every rank, e.g. the
    other steps of a run (:func:`dispatch_model` applies it to a step). The mean, not the
    median: a step is a sum of gaps along its longest path, whose expectation is the sum of
    the means; most hand-offs are quick and a few wait long for a core or the interpreter (a
    skewed distribution), so medians under-predict every plan kind, all one way.

    Example: piece ``b`` waits for ``a`` on another stream; it starts 1 us after ``a``
    ended on rank 0, 7 us after on rank 1:
        >>> from tidal.ir.program import Piece, Program
        >>> p = Program((Piece("a", "compute"), Piece("b", "comm", (0,))), world=2)
        >>> m = [Measured(0, 0, "a", "compute", 0, 1, 0, 1.0),
        ...      Measured(0, 1, "b", "comm", 2, 3, 1, 1.0),
        ...      Measured(1, 1, "b", "comm", 8, 9, 1, 1.0)]
        >>> dispatch_means(p, m)
        {('compute', False): 0.0, ('comm', True): 4.0}
    """
    by_rank = rank_programs(programs)
    gaps: dict[DispatchClass, list[float]] = {}
    for m in measured:
        gaps.setdefault(dispatch_class(by_rank[m.rank], m.index), []).append(m.gap_us)
    return {k: float(statistics.fmean(v)) for k, v in gaps.items()}


def dispatch_model(programs, measured: Sequence[Measured],
                   means: Optional[Mapping[DispatchClass, float]] = None
                   ) -> dict[tuple[int, int], float]:
    """Host dispatch per piece, *modelled* rather than read piece by piece: each piece of
    ``measured`` (one step's pieces) gets the mean gap of its class, ``means``
    (:func:`dispatch_means`, calibrated on other steps; None: on ``measured`` itself). A class
    ``means`` lacks gets the mean of the classes it has. By ``(rank, index)``.

    Example: two compute pieces, the second after a comm piece (another stream):
        >>> from tidal.ir.program import Piece, Program
        >>> p = Program((Piece("a", "compute"), Piece("ar", "comm", (0,)),
        ...              Piece("b", "compute", (1,))))
        >>> m = [Measured(0, 0, "a", "compute", 0, 1, 0, 1.0),
        ...      Measured(0, 1, "ar", "comm", 1, 2, 1, 1.0),
        ...      Measured(0, 2, "b", "compute", 5.0, 6.0, 2.0, 1.0)]
        >>> dispatch_model(p, m)
        {(0, 0): 0.0, (0, 1): 0.0, (0, 2): 3.0}
        >>> dispatch_model(p, m, {("compute", True): 2.0, ("comm", True): 1.0})
        {(0, 0): 1.5, (0, 1): 1.0, (0, 2): 2.0}
    """
    by_rank = rank_programs(programs)
    if means is None:
        means = dispatch_means(by_rank, measured)
    fallback = statistics.fmean(means.values()) if means else 0.0
    return {(m.rank, m.index): means.get(dispatch_class(by_rank[m.rank], m.index), fallback)
            for m in measured}


def releases_us(traces: Traces) -> dict[int, float]:
    """When each rank began its step (its first piece's start) after the earliest rank did."""
    first = {r: min(t.start_us for t in trace) for r, trace in traces.items() if trace}
    zero = min(first.values(), default=0.0)
    return {r: s - zero for r, s in first.items()}


@dataclass(frozen=True)
class _Terms:
    """What :func:`compose` adds to one rank's program, by piece index: ``delays`` (each
    piece's dispatch gap), ``alone`` (the shared pieces that waited for no peer) and
    ``sides`` (how much longer the rank's side of a joined piece took than the shortest
    side, :func:`sides_us`)."""

    delays: Mapping[int, float]
    alone: frozenset
    sides: Mapping[int, float]


def _unique_names(program: Program) -> list[str]:
    """A name per piece that no other piece of the rank has and that the k-th shared piece
    of a name has on every rank (``"<name> #k"``; the others ``"<name> @<index>"``), so
    that each piece gets its own measured duration."""
    keys = shared_keys(program)
    return [f"{p.name} #{keys[i][1]}" if i in keys else f"{p.name} @{i}"
            for i, p in enumerate(program.pieces)]


def _timed(program: Program, terms: _Terms, release: bool) -> Program:
    """``program`` (its pieces renamed by :func:`_unique_names`) with the host's delays and
    the ranks' sides of joined pieces as pieces of their own: with ``release``, a host piece
    :data:`RELEASE` on its own stream heads the step (every piece without dependencies waits
    for it); before piece ``i`` of ``terms.delays``, a host piece ``"dispatch i"`` that
    starts once piece ``i`` could (its dependencies and its stream's previous piece ended),
    takes the delay and lets piece ``i`` start, on a stream per piece stream (``dispatch
    <stream>``: the delays of different streams apart). After a
    joined piece ``i`` of ``terms.sides``, a host piece ``"side i"`` (stream ``side
    <stream>``) takes the rank's longer side: what waits for piece ``i`` on this rank, its
    dependents and its stream's next piece, waits for it. The shared pieces of
    ``terms.alone`` waited for no peer: each runs on a stream of its own
    (``<stream> ALONE``), which joins no other rank's piece."""
    pieces: list[Piece] = [Piece(RELEASE, RELEASE, kind=HOST)] if release else []
    names = _unique_names(program)
    at: dict[int, int] = {}
    last: dict[str, int] = {}
    sides: set[int] = set()
    for i, p in enumerate(program.pieces):
        deps = tuple(at[d] for d in p.deps) or ((0,) if release else ())
        before = {last[p.stream]} if p.stream in last else set()
        if terms.delays.get(i, 0.0) > 0.0:
            pieces.append(Piece(f"{DISPATCH} {i}", f"{DISPATCH} {p.stream}",
                                tuple(sorted(set(deps) | before)), kind=HOST))
            deps = (len(pieces) - 1,)
        elif before & sides:
            deps = tuple(sorted(set(deps) | before))
        at[i] = last[p.stream] = len(pieces)
        pieces.append(replace(p, name=names[i], deps=deps, stream=f"{p.stream} {ALONE}"
                              if i in terms.alone else p.stream))
        if terms.sides.get(i, 0.0) > 0.0:
            pieces.append(Piece(f"{SIDE} {i}", f"{SIDE} {p.stream}", (at[i],), kind=HOST))
            at[i] = last[p.stream] = len(pieces) - 1
            sides.add(at[i])
    return Program(tuple(pieces), program.world)


def sides_us(programs, measured: Sequence[Measured]) -> dict[int, dict[int, float]]:
    """``{rank: {piece index: us}}``: how much longer each rank's side of a joined piece
    (:attr:`Measured.joined`) took than the shortest side of it. A collective or transfer
    does not end at once on its ranks: a transfer's receiver ends after its sender handed
    the data off, a ring all-reduce's ranks receive their last chunk one after another, and
    each rank's thread sees the end when it is woken. The engine runs a joined piece on all
    its ranks for the shortest side (``join_ranks``); the rest is the rank's own.

    Example: rank 1 receives what rank 0 sends; both issued at 2, the send ends at 3, the
    receive at 6:
        >>> p = Program((Piece("f", "compute"), Piece("x", "transfer", (0,))), world=2)
        >>> traces = {0: [PieceTrace("f", "compute", 0, 2), PieceTrace("x", "transfer", 2, 3)],
        ...           1: [PieceTrace("f", "compute", 0, 2), PieceTrace("x", "transfer", 2, 6)]}
        >>> sides_us(p, measured_pieces(p, traces))
        {0: {1: 0.0}, 1: {1: 3.0}}
        >>> [(i.gpu, i.name, i.end_us) for i in compose(p, traces) if i.name == "x"]
        [(0, 'x', 3.0), (1, 'x', 6.0)]
        >>> step_us(compose(p, traces)), step_us(compose(p, traces, sides=False))
        (6.0, 3.0)
    """
    by_rank = rank_programs(programs)
    keys = {r: shared_keys(p) for r, p in by_rank.items()}
    joined = [m for m in measured if m.joined]
    shortest: dict[tuple[str, int], float] = {}
    for m in joined:
        key = keys[m.rank][m.index]
        shortest[key] = min(shortest.get(key, float("inf")), m.own_us)
    out: dict[int, dict[int, float]] = {r: {} for r in by_rank}
    for m in joined:
        out[m.rank][m.index] = m.own_us - shortest[keys[m.rank][m.index]]
    return out


def compose(programs, traces: Traces, release: bool = False,
            gaps: bool = False, job: str = "fg",
            cores: Optional[float] = None, gate_issue: bool = False,
            sides: bool = True, delays: Optional[Mapping[tuple[int, int], float]] = None
            ) -> list[Interval]:
    """The engine's run of ``programs`` (as ``join_ranks`` takes them) with each piece's own
    measured duration (:func:`measured_pieces`; each piece its own, a name that repeats
    included), after each rank's measured
    release (``release``: the :data:`RELEASE` host piece of that duration heads each rank's
    step). ``gaps``: each piece's own measured dispatch gap delays its start (a ``dispatch``
    host piece before it, see :func:`_timed`), rather than lengthening the piece. ``sides``: a joined piece runs on its ranks
    for its shortest side, then each rank's longer side on that rank (:func:`sides_us`; False:
    the shortest side ends it on every rank). ``cores``: the engine's processor sharing of
    compute lanes (``simulate(cores=)``): for durations measured *alone*; measured own
    durations already include the sharing of the run they come from, so leave it None for
    them. ``delays``: a modelled dispatch delay per ``(rank, index)`` in place of each
    piece's measured gap (:func:`dispatch_model`; delays as ``gaps`` does). ``traces`` on one
    clock. A shared piece that waited for no peer
    (:attr:`Measured.joined` false) is simulated on its rank alone. ``gate_issue``: as
    :func:`measured_pieces` takes it. Intervals of :data:`RELEASE`, dispatch and side pieces
    are left out; the others keep their piece's name and the lane of its stream, and a
    joined piece's ends where its rank's side ended."""
    by_rank = _checked(programs, traces)
    measured = measured_pieces(by_rank, traces, gate_issue)
    shared = {r: shared_keys(p) for r, p in by_rank.items()}
    own = {(m.rank, m.index): m.own_us for m in measured}
    longer = sides_us(by_rank, measured) if sides else {}
    terms = {r: _Terms({m.index: m.gap_us if delays is None else
                        delays.get((m.rank, m.index), 0.0) for m in measured
                        if (gaps or delays is not None) and m.rank == r},
                       frozenset(m.index for m in measured if m.rank == r
                                 and m.index in shared[r] and not m.joined),
                       longer.get(r, {}))
             for r in by_rank}
    start = releases_us(traces)
    original = {(r, n): (i, p.name) for r, program in by_rank.items()
                for i, (n, p) in enumerate(zip(_unique_names(program), program.pieces))}

    def duration(rank: int, name: str) -> float:
        if name == RELEASE:
            return start[rank]
        if (rank, name) in original:
            return own[(rank, original[(rank, name)][0])]
        what, index = name.rsplit(" ", 1)
        return (terms[rank].delays if what == DISPATCH else terms[rank].sides)[int(index)]

    placed = join_ranks({r: _timed(p, terms[r], release) for r, p in by_rank.items()},
                        duration)
    return _reported(simulate({job: placed}, cores=cores), original)


def _reported(intervals: Sequence[Interval], original: Mapping) -> list[Interval]:
    """:func:`compose`'s intervals of the programs' own pieces (``original``: ``{(rank,
    unique name): (index, name)}``), named as the program names them, on the lane of their
    stream (an ``ALONE`` one's too), each ending where its rank's side of it ended (its
    ``side`` piece)."""
    side_end = {(i.gpu, int(i.name.rsplit(" ", 1)[1])): i.end_us for i in intervals
                if (i.gpu, i.name) not in original and i.name.startswith(SIDE + " ")}
    suffix = f" {ALONE}"
    out = []
    for i in intervals:
        if (i.gpu, i.name) not in original:
            continue
        index, name = original[(i.gpu, i.name)]
        lane = (lane_of(Piece(name, i.lane[:-len(suffix)])) if i.lane.endswith(suffix)
                else i.lane)
        out.append(replace(i, name=name, lane=lane,
                           end_us=side_end.get((i.gpu, index), i.end_us)))
    return out


def step_us(intervals: Sequence[Interval]) -> float:
    """The simulated step of :func:`compose`: from 0, where its clock starts (the earliest
    rank's release; the measured step starts there too, :func:`measured_step_us`), to the last
    end. Not from the first simulated start: a rank that reaches a collective first and waits
    there for a late peer (a broadcast heading the step) shows no interval while it waits,
    yet the measured step counts that wait.

    Example: rank 0 waits 2 us in a broadcast for rank 1, released 2 us later:
        >>> from tidal.ir.program import Piece, Program
        >>> p = Program((Piece("b", "comm"), Piece("f", "compute", (0,))), world=2)
        >>> traces = {0: [PieceTrace("b", "comm", 0, 3), PieceTrace("f", "compute", 3, 5)],
        ...           1: [PieceTrace("b", "comm", 2, 3), PieceTrace("f", "compute", 3, 5)]}
        >>> step_us(compose(p, traces, release=True)), measured_step_us(traces)
        (5.0, 5.0)
    """
    return max(i.end_us for i in intervals) - min([0.0] + [i.start_us for i in intervals])


def measured_step_us(traces: Traces) -> float:
    """The measured step (``traces`` on one clock): from the first start to the last end."""
    every = [t for trace in traces.values() for t in trace]
    return float(max(t.end_us for t in every) - min(t.start_us for t in every))


Span = tuple[str, str, float, float]
"""A piece as it ran or was simulated: name, stream, start, end."""


def simulated_spans(programs, intervals: Sequence[Interval]) -> dict[int, list[Span]]:
    """``{rank: [(name, stream, start, end)]}`` of simulated ``intervals``, the stream named as
    the rank's program names it (the link lanes back to ``comm``, ``transfer``, ``load``)."""
    by_rank = rank_programs(programs)
    stream_of = {(r, lane_of(p)): p.stream for r, program in by_rank.items()
                 for p in program.pieces}
    out: dict[int, list[Span]] = {r: [] for r in by_rank}
    for i in intervals:
        out[i.gpu].append((i.name, stream_of[(i.gpu, i.lane)], i.start_us, i.end_us))
    return out


def traced_spans(traces: Traces) -> dict[int, list[Span]]:
    """:func:`simulated_spans`' shape for measured traces."""
    return {r: [(t.name, t.stream, t.start_us, t.end_us) for t in trace]
            for r, trace in traces.items()}


def _keyed(spans: Sequence[Span]) -> dict[tuple[str, int], Span]:
    """Spans by (name, k): the k-th span of that name, in the order given."""
    seen: dict[str, int] = {}
    out = {}
    for s in spans:
        out[(s[0], seen.get(s[0], 0))] = s
        seen[s[0]] = seen.get(s[0], 0) + 1
    return out


def overlaps(spans: Mapping[int, Sequence[Span]], margin_us: float = 0.0
             ) -> tuple[set, set]:
    """Which compute pieces overlap which communication pieces (``comm``, ``transfer``,
    ``load`` streams), per rank: ``(overlapping, apart)``, sets of ``(rank, compute piece,
    communication piece)`` that overlap by more than ``margin_us``, and that are apart by more
    than it (pairs within the margin are in neither: too close to call).

    Example:
        >>> spans = {0: [("b", "compute", 0, 5), ("ar", "comm", 4, 9),
        ...              ("opt", "compute", 10, 11)]}
        >>> overlaps(spans, 0.5)
        ({(0, 'b', 'ar')}, {(0, 'opt', 'ar')})
        >>> overlaps(spans, 2.0)
        (set(), set())
    """
    on, off = set(), set()
    for r, ranked in spans.items():
        comp = [s for s in ranked if is_compute_lane(lane_of(Piece(s[0], s[1])))]
        comm = [s for s in ranked if not is_compute_lane(lane_of(Piece(s[0], s[1])))]
        for a in comp:
            for b in comm:
                ov = min(a[3], b[3]) - max(a[2], b[2])
                if ov > margin_us and min(a[3] - a[2], b[3] - b[2]) > margin_us:
                    on.add((r, a[0], b[0]))
                elif ov < -margin_us:
                    off.add((r, a[0], b[0]))
    return on, off


@dataclass(frozen=True)
class Departure:
    """Where the simulated timeline first departs from the measured one: the piece (rank,
    name, stream), its measured and simulated start, what it waited for last in the measured
    run (``after``: the dependency or stream predecessor that ended last) with that one's
    measured and simulated end, and its measured dispatch gap."""

    rank: int
    name: str
    stream: str
    measured_us: float
    simulated_us: float
    after: str
    after_measured_us: float
    after_simulated_us: float
    gap_us: float

    def __str__(self) -> str:
        delta = self.simulated_us - self.measured_us
        why = (f"after {self.after!r} (ends {self.after_measured_us / 1e3:.2f} ms measured, "
               f"{self.after_simulated_us / 1e3:.2f} simulated)" if self.after else
               "at the rank's start")
        return (f"rank {self.rank} {self.name!r} ({self.stream}) starts {delta / 1e3:+.2f} ms "
                f"off: measured {self.measured_us / 1e3:.2f} ms, simulated "
                f"{self.simulated_us / 1e3:.2f} ms, {why}; measured dispatch gap "
                f"{self.gap_us / 1e3:.2f} ms")


def _work_start_us(m: Measured, traces: Traces) -> float:
    """When piece ``m`` started its own work (its end less its own duration): its start, or
    for a joined piece the moment its last participant issued it, for a piece after an
    asynchronous collective that collective's end (an early rank's trace starts with its
    wait, which the simulated piece, starting on all its ranks at once or after the
    collective, does not show)."""
    return max(m.start_us, ended_us(traces[m.rank][m.index]) - m.own_us)


def departure(programs, traces: Traces, intervals: Sequence[Interval], tolerance_us: float,
              gate_issue: bool = False) -> Optional[Departure]:
    """The first piece, in measured start order over all ranks, whose simulated start
    (``intervals``, e.g. :func:`compose`'s) is more than ``tolerance_us`` from its measured one
    (``traces`` on one clock; of a piece that waited inside for peers or for an asynchronous
    collective, when its own work started); None when every piece starts within it.
    ``gate_issue``: as the :func:`compose` that made ``intervals`` took it."""
    by_rank = _checked(programs, traces)
    sim = {r: _keyed(s) for r, s in simulated_spans(by_rank, intervals).items()}
    real = {r: _keyed(s) for r, s in traced_spans(traces).items()}
    key_of = {r: list(real[r]) for r in real}  # program order: the trace lists it so
    measured = sorted(measured_pieces(by_rank, traces, gate_issue),
                      key=lambda m: (m.start_us, m.rank))
    for m in measured:
        key = key_of[m.rank][m.index]
        got = sim[m.rank].get(key)
        if got is None or abs(got[2] - _work_start_us(m, traces)) <= tolerance_us:
            continue
        piece = by_rank[m.rank].pieces[m.index]
        before = [d for d in piece.deps] + [j for j in range(m.index)
                                             if by_rank[m.rank].pieces[j].stream == m.stream]
        last = max(before, key=lambda j: real[m.rank][key_of[m.rank][j]][3], default=None)
        if last is None:
            return Departure(m.rank, m.name, m.stream, m.start_us, got[2], "", 0.0, 0.0,
                             m.gap_us)
        lk = key_of[m.rank][last]
        return Departure(m.rank, m.name, m.stream, _work_start_us(m, traces), got[2], lk[0],
                         real[m.rank][lk][3], sim[m.rank].get(lk, (0, 0, 0, 0.0))[3], m.gap_us)
    return None

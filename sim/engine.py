"""Discrete-event execution of a Program of the whole cluster on N GPUs, each with compute
lanes and three links.

The engine runs the one Program type (``tidal.ir.program``) with every piece *placed*: its
``ranks`` are the GPUs it occupies, its ``deps`` may be pieces of other ranks
(``tidal.sim.programs.join_ranks`` makes such a Program from the ranks' own Programs, the
strategies of ``tidal.sim.programs`` build one directly). Pieces are issued in program order
(each lane is a FIFO, like a CUDA stream). A piece starts when its lanes are free and all its
dependencies have ended, and takes its ``duration_us``.

Lanes follow the piece's stream (:func:`lane_of`): the ``comm`` stream is the GPU's network
link (``"link"``), the ``load`` stream its host-to-device link (``"h2d"``, weight loads), the
``transfer`` stream its peer link (``"peer"``, burst parallelism's sample transfers); the links
are separate resources, each a FIFO, and a piece on a link occupies it on all its GPUs at once
(a collective starts when every participant's link is free). Any other stream is a compute
lane of the same name, on one GPU: ``compute``, or e.g. the ``tick`` and ``tock`` streams of two
waves, which then run *at the same time* on that GPU, as separate compute resources (the engine
does not slow down concurrent compute lanes of one GPU, except through ``cores`` below).

With ``cores`` set, the compute lanes of all GPUs share that many processors: while ``n``
compute pieces run, each progresses at ``min(1, cores / n)`` of its full speed (processor
sharing), the model of ranks oversubscribing a CPU's cores. Communication keeps its duration,
unless ``link_load`` is given: ``link_load(piece)`` is a link piece's duration inside the step's
computation (its ``duration_us`` being the one after it, on idle processors), and while any
computation remains, running or still to run on any GPU (the optimizer step aside: it waits for
the links), the link piece progresses at ``duration_us / link_load(piece)`` of its idle speed.
The model of collectives whose threads share a host's cores with the ranks' computation and
whose ranks arrive from it at different times (gloo on a CPU: a collective issued beside a
training step takes several times one on idle cores; a data-parallel bucket issued after the
backward takes about its idle time), measured by two link fits (``tidal.sim.programs.
link_load`` pairs the Programs built with each). The engine's ranks run in lock step, so a link
piece between two compute pieces is rarely beside one in the model though, on the machine,
some rank is still computing: hence "remaining", not "running".

Several jobs may share the GPUs: ``simulate({job: program, ...})`` issues them in that order,
each interval naming its job.

Example:
    >>> from tidal.ir.program import COMM, COMPUTE, Piece, Program
    >>> p = Program((Piece("f0", COMPUTE, duration_us=5.0, ranks=(0,)),
    ...              Piece("f1", COMPUTE, duration_us=7.0, ranks=(1,)),
    ...              Piece("ar", COMM, (0, 1), duration_us=3.0, ranks=(0, 1))), world=2)
    >>> [(i.gpu, i.lane, i.start_us, i.end_us) for i in simulate(p) if i.name == "ar"]
    [(0, 'link', 7.0, 10.0), (1, 'link', 7.0, 10.0)]
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Sequence, Union

from tidal.ir.program import COMM, LOAD, OPTIMIZER, TRANSFER, Piece, Program

COMPUTE_LANE, LINK, H2D, PEER = "compute", "link", "h2d", "peer"
LINKS = (LINK, H2D, PEER)
"""The link lanes: the network link (collectives), the host-to-device link and the peer link (a
job's point-to-point sample transfers, on a stream and process group of their own, so they do
not queue behind its collectives)."""
_LINK_OF_STREAM = {COMM: LINK, LOAD: H2D, TRANSFER: PEER}

Jobs = Union[Program, Mapping[str, Program]]
"""What :func:`simulate` runs: a placed Program (the job ``"fg"``), or placed Programs by job."""


@dataclass(frozen=True)
class Interval:
    """When a piece occupied one GPU's lane (a compute lane, ``link``, ``h2d`` or ``peer``)."""

    gpu: int
    lane: str
    job: str
    name: str
    start_us: float
    end_us: float


def lane_of(piece: Piece) -> str:
    """The lane ``piece`` occupies on each of its GPUs (see the module docstring).

    Example:
        >>> lane_of(Piece("w", "load")), lane_of(Piece("f", "tick"))
        ('h2d', 'tick')
    """
    return _LINK_OF_STREAM.get(piece.stream, piece.stream)


def is_compute_lane(lane: str) -> bool:
    """Whether intervals on ``lane`` are computation (every lane but the links)."""
    return lane not in LINKS


class _Placed(NamedTuple):
    """A piece as the engine runs it: its job, lane and dependencies in the issue list."""

    job: str
    piece: Piece
    lane: str
    deps: tuple[int, ...]

    @property
    def gpus(self) -> tuple[int, ...]:
        return self.piece.ranks

    @property
    def name(self) -> str:
        return self.piece.name

    @property
    def duration_us(self) -> float:
        return self.piece.duration_us


def _placed(jobs: Jobs) -> list[_Placed]:
    """The pieces of every job in issue order, checked: placed on GPUs, one for a compute
    piece, a compute stream not named like a link."""
    by_job = {"fg": jobs} if isinstance(jobs, Program) else dict(jobs)
    out: list[_Placed] = []
    for job, program in by_job.items():
        offset = len(out)
        for p in program.pieces:
            lane = lane_of(p)
            if lane in LINKS and p.stream not in _LINK_OF_STREAM:
                raise ValueError(f"piece {p.name!r}: its compute stream cannot use lane "
                                 f"{lane!r} (the links are {LINKS})")
            if not p.ranks:
                raise ValueError(f"piece {p.name!r} of job {job!r} is placed on no GPU "
                                 f"(empty ranks)")
            if is_compute_lane(lane) and len(p.ranks) != 1:
                raise ValueError(f"compute piece {p.name!r} must run on exactly one GPU, "
                                 f"got ranks {p.ranks}")
            out.append(_Placed(job, p, lane, tuple(offset + d for d in p.deps)))
    return out


def simulate(jobs: Jobs, cores: float | None = None,
             link_load: Callable[[Piece], float] | None = None) -> list[Interval]:
    """Run ``jobs`` (a placed Program, or placed Programs by job name) and return one interval
    per piece and GPU it occupies, in issue order. ``cores``: processors shared by all compute
    lanes (None: every GPU computes at full speed). ``link_load``: a link piece's duration
    inside the step's computation (None: links ignore computation; see the module
    docstring). Raises ``ValueError`` for a piece placed on no GPU, a compute piece on several,
    a compute stream named like a link, ``cores`` <= 0 or a loaded duration shorter than the
    piece's own (a dependency on a later piece the Program itself refuses).

    Example (a 4 us collective that takes 12 us inside the step's computation, the first 3 us
    while a compute piece remains: a quarter of its work done there, the rest at full speed):
        >>> from tidal.ir.program import COMPUTE
        >>> p = Program((Piece("f", COMPUTE, duration_us=3.0, ranks=(0,)),
        ...              Piece("ar", COMM, duration_us=4.0, ranks=(0, 1))), world=2)
        >>> [i.end_us for i in simulate(p, link_load=lambda q: 3 * q.duration_us)
        ...  if i.name == "ar"]
        [6.0, 6.0]
    """
    placed = _placed(jobs)
    if cores is not None and not cores > 0:
        raise ValueError(f"simulate(cores={cores!r}): must be > 0")
    if cores is not None or link_load is not None:
        return _simulate_shared(placed, None if cores is None else float(cores),
                                _loaded_durations(placed, link_load))
    free: dict[tuple[int, str], float] = defaultdict(float)
    ends: list[float] = []
    out: list[Interval] = []
    for t in placed:
        lane = t.lane
        ready = max((ends[d] for d in t.deps), default=0.0)
        start = max([ready] + [free[(g, lane)] for g in t.gpus])
        end = start + t.duration_us
        for g in t.gpus:
            free[(g, lane)] = end
            out.append(Interval(g, lane, t.job, t.name, start, end))
        ends.append(end)
    return out


def _loaded_durations(placed: Sequence[_Placed], link_load: Callable[[Piece], float] | None
                      ) -> list[float]:
    """Per placed piece, its duration inside the step's computation: ``link_load``'s for a
    link piece (checked: not shorter than its own), its own for the rest."""
    out = []
    for t in placed:
        us = t.duration_us
        if link_load is not None and not is_compute_lane(t.lane):
            loaded = float(link_load(t.piece))
            if loaded < us * (1 - 1e-9):
                raise ValueError(f"link_load({t.name!r}) = {loaded} us is shorter than the "
                                 f"piece's own {us} us (computation beside a link only "
                                 "slows it)")
            us = loaded
        out.append(us)
    return out


def _simulate_shared(placed: Sequence[_Placed], cores: float | None,
                     loaded_us: Sequence[float]) -> list[Interval]:
    """Event-driven run with processor sharing of the compute lanes and links slowed while
    computation remains (see ``simulate``; ``loaded_us``: each piece's duration inside the
    step's computation, :func:`_loaded_durations`)."""
    queues: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, t in enumerate(placed):
        for g in t.gpus:
            queues[(g, t.lane)].append(i)
    head = {k: 0 for k in queues}
    start = [0.0] * len(placed)
    end: list[float | None] = [None] * len(placed)
    left = {}  # running compute piece -> remaining work (us at full speed)
    link_left = {}  # running link piece -> remaining fraction of its work
    now, done = 0.0, 0

    def at_head(i: int) -> bool:
        t = placed[i]
        return all(queues[(g, t.lane)][head[(g, t.lane)]] == i for g in t.gpus)

    # computation still running or to run (the optimizer step aside: it waits for the links)
    computing = sum(1 for t in placed if is_compute_lane(t.lane) and t.piece.kind != OPTIMIZER)

    def link_rate(i: int) -> float:
        """Fraction of link piece ``i`` done per us now."""
        us = loaded_us[i] if computing else placed[i].duration_us
        return 1.0 / us if us > 0 else float("inf")

    while done < len(placed):
        started = True
        while started:  # start every piece at the head of all its lanes whose deps ended
            started = False
            for k, q in queues.items():
                if head[k] >= len(q):
                    continue
                i = q[head[k]]
                if i in left or i in link_left or not at_head(i):
                    continue
                if any(end[d] is None for d in placed[i].deps):
                    continue
                start[i] = now
                if is_compute_lane(placed[i].lane):
                    left[i] = placed[i].duration_us
                else:
                    link_left[i] = 1.0
                started = True
        if not left and not link_left:
            raise AssertionError("simulate: no runnable piece (dependency cycle)")
        rate = min(1.0, cores / len(left)) if left and cores is not None else 1.0
        rates = {i: link_rate(i) for i in link_left}
        step = min([w / rate for w in left.values()]
                   + [f / rates[i] for i, f in link_left.items()])
        step = max(step, 0.0)
        now += step
        finished = []
        for i in list(link_left):
            link_left[i] -= step * rates[i] if step else 0.0
            if link_left[i] <= 1e-9 or rates[i] == float("inf"):
                finished.append(i)
        for i in list(left):
            left[i] -= step * rate
            if left[i] <= 1e-9 * max(1.0, placed[i].duration_us):
                finished.append(i)
        for i in sorted(finished):
            left.pop(i, None)
            link_left.pop(i, None)
            end[i] = now
            done += 1
            t = placed[i]
            if is_compute_lane(t.lane) and t.piece.kind != OPTIMIZER:
                computing -= 1
            for g in t.gpus:
                head[(g, t.lane)] += 1
    out = []
    for i, t in enumerate(placed):
        for g in t.gpus:
            out.append(Interval(g, t.lane, t.job, t.name, start[i], end[i]))
    return out


def chrome_trace(intervals: Sequence[Interval], label: str = "") -> dict:
    """Chrome trace-event JSON for simulated intervals: one process per GPU, one row per lane
    (compute, link, h2d, then other compute lanes in the order they first appear); loads in
    chrome://tracing and Perfetto."""
    events: list[dict] = []
    seen: set[tuple[int, str]] = set()
    rows = {COMPUTE_LANE: 0, LINK: 1, H2D: 2, PEER: 3}
    for iv in intervals:
        tid = rows.setdefault(iv.lane, len(rows))
        if (iv.gpu, iv.lane) not in seen:
            seen.add((iv.gpu, iv.lane))
            events.append({"ph": "M", "name": "process_name", "pid": iv.gpu, "tid": tid,
                           "args": {"name": f"{label} GPU {iv.gpu}".strip()}})
            events.append({"ph": "M", "name": "thread_name", "pid": iv.gpu, "tid": tid,
                           "args": {"name": iv.lane}})
        events.append({"ph": "X", "name": iv.name, "cat": iv.job, "pid": iv.gpu, "tid": tid,
                       "ts": iv.start_us, "dur": iv.end_us - iv.start_us})
    return {"traceEvents": events, "displayTimeUnit": "ms"}

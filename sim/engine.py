"""Discrete-event execution of a task list on N GPUs, each with compute lanes and two links.

Tasks are issued in list order (each lane is a FIFO, like a CUDA stream). A compute task runs
on one GPU's compute lane; a communication task occupies a link lane of all its GPUs at once
(a collective starts when every participant's link is free). A task starts when its lanes are
free and all its dependencies have ended.

Lanes: a compute task names its lane (``"compute"`` by default; a GPU may have several, e.g.
the ``"tick"`` and ``"tock"`` streams of two waves, which then run *at the same time* on that
GPU, as separate compute resources: the engine does not slow down concurrent compute lanes of
one GPU, except through ``cores`` below). A communication task uses the GPU's network link
(``"link"``, the default), its host-to-device link (``"h2d"``, weight loads) or its peer link
(``"peer"``, burst parallelism's sample transfers); the links are separate resources, each a
FIFO.

With ``cores`` set, the compute lanes of all GPUs share that many processors: while ``n``
compute tasks run, each progresses at ``min(1, cores / n)`` of its full speed (processor
sharing), the model of ranks oversubscribing a CPU's cores. Communication keeps its duration.

Example:
    >>> from tidal.sim.engine import Task, simulate
    >>> tasks = [Task("f0", "fg", "compute", (0,), 5.0),
    ...          Task("f1", "fg", "compute", (1,), 7.0),
    ...          Task("ar", "fg", "comm", (0, 1), 3.0, deps=(0, 1))]
    >>> [(i.gpu, i.lane, i.start_us, i.end_us) for i in simulate(tasks) if i.name == "ar"]
    [(0, 'link', 7.0, 10.0), (1, 'link', 7.0, 10.0)]
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

KINDS = ("compute", "comm")
COMPUTE_LANE, LINK, H2D, PEER = "compute", "link", "h2d", "peer"
LINKS = (LINK, H2D, PEER)
"""The lanes a ``comm`` task may use: the network link (collectives), the host-to-device link
and the peer link (a job's point-to-point sample transfers, on a stream and process group of
their own, so they do not queue behind its collectives)."""


@dataclass(frozen=True)
class Task:
    """One piece of work: ``kind`` is ``compute`` (one GPU) or ``comm`` (the links of all
    ``gpus``); ``deps`` are indices of earlier tasks in the list. ``lane``: which of the GPU's
    lanes it occupies; left empty it is ``"compute"`` for a compute task and ``"link"`` for a
    comm task. A compute task may name any other lane (another compute stream of the GPU) but
    not a link; a comm task uses one of :data:`LINKS`."""

    name: str
    job: str
    kind: str
    gpus: tuple[int, ...]
    duration_us: float
    deps: tuple[int, ...] = ()
    lane: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"task {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if not self.lane:
            object.__setattr__(self, "lane", COMPUTE_LANE if self.kind == "compute" else LINK)
        if (self.kind == "comm") != (self.lane in LINKS):
            raise ValueError(f"task {self.name!r}: a {self.kind} task cannot use lane "
                             f"{self.lane!r} (comm tasks use one of {LINKS}, compute tasks "
                             f"any other)")
        if not self.gpus:
            raise ValueError(f"task {self.name!r}: runs on no GPU")
        if self.kind == "compute" and len(self.gpus) != 1:
            raise ValueError(f"compute task {self.name!r} must run on exactly one GPU")
        if self.duration_us < 0:
            raise ValueError(f"task {self.name!r}: negative duration {self.duration_us}")


@dataclass(frozen=True)
class Interval:
    """When a task occupied one GPU's lane (a compute lane, ``link`` or ``h2d``)."""

    gpu: int
    lane: str
    job: str
    name: str
    start_us: float
    end_us: float


def _check_deps(tasks: Sequence[Task]) -> None:
    for i, t in enumerate(tasks):
        bad = [d for d in t.deps if not 0 <= d < i]
        if bad:
            raise ValueError(f"task {i} {t.name!r} depends on task {bad[0]}, which is not earlier")


def is_compute_lane(lane: str) -> bool:
    """Whether intervals on ``lane`` are computation (every lane but the links)."""
    return lane not in LINKS


def simulate(tasks: Sequence[Task], cores: float | None = None) -> list[Interval]:
    """Run ``tasks`` and return one interval per task and GPU it occupies, in issue order.
    ``cores``: processors shared by all compute lanes (None: every GPU computes at full speed).
    Raises ``ValueError`` for a dependency on a later (or the same) task or ``cores`` <= 0."""
    _check_deps(tasks)
    if cores is not None:
        if not cores > 0:
            raise ValueError(f"simulate(cores={cores!r}): must be > 0")
        return _simulate_shared(tasks, float(cores))
    free: dict[tuple[int, str], float] = defaultdict(float)
    ends: list[float] = []
    out: list[Interval] = []
    for t in tasks:
        lane = t.lane
        ready = max((ends[d] for d in t.deps), default=0.0)
        start = max([ready] + [free[(g, lane)] for g in t.gpus])
        end = start + t.duration_us
        for g in t.gpus:
            free[(g, lane)] = end
            out.append(Interval(g, lane, t.job, t.name, start, end))
        ends.append(end)
    return out


def _simulate_shared(tasks: Sequence[Task], cores: float) -> list[Interval]:
    """Event-driven run with processor sharing of the compute lanes (see ``simulate``)."""
    queues: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, t in enumerate(tasks):
        for g in t.gpus:
            queues[(g, t.lane)].append(i)
    head = {k: 0 for k in queues}
    start = [0.0] * len(tasks)
    end: list[float | None] = [None] * len(tasks)
    left = {}  # running task -> remaining work (us at full speed); comm: fixed end below
    comm_end = {}
    now, done = 0.0, 0

    def at_head(i: int) -> bool:
        t = tasks[i]
        return all(queues[(g, t.lane)][head[(g, t.lane)]] == i for g in t.gpus)

    while done < len(tasks):
        started = True
        while started:  # start every task at the head of all its lanes whose deps ended
            started = False
            for k, q in queues.items():
                if head[k] >= len(q):
                    continue
                i = q[head[k]]
                if i in left or i in comm_end or not at_head(i):
                    continue
                if any(end[d] is None for d in tasks[i].deps):
                    continue
                start[i] = now
                if tasks[i].kind == "compute":
                    left[i] = tasks[i].duration_us
                else:
                    comm_end[i] = now + tasks[i].duration_us
                started = True
        if not left and not comm_end:
            raise AssertionError("simulate: no runnable task (dependency cycle)")
        rate = min(1.0, cores / len(left)) if left else 1.0
        step = min([w / rate for w in left.values()] + [e - now for e in comm_end.values()])
        step = max(step, 0.0)
        now += step
        finished = [i for i, e in comm_end.items() if e <= now + 1e-9]
        for i in list(left):
            left[i] -= step * rate
            if left[i] <= 1e-9 * max(1.0, tasks[i].duration_us):
                finished.append(i)
        for i in sorted(finished):
            left.pop(i, None)
            comm_end.pop(i, None)
            end[i] = now
            done += 1
            t = tasks[i]
            for g in t.gpus:
                head[(g, t.lane)] += 1
    out = []
    for i, t in enumerate(tasks):
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

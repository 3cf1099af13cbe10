"""Multi-job runtime: one foreground job and background jobs sharing a device (DeepPool §5).

Each job is a virtual queue of *pieces* (a lowered forward's steps, a training step, a
collective...). ``Runtime.run`` dispatches them onto one stream per job:

- **priorities**: the foreground stream is high priority, background streams low;
- **launch pacing**: at most ``fg_depth`` (2) foreground and ``be_depth`` (1) background pieces
  outstanding per job and stream, so little low-priority work queues ahead of foreground work;
- **slowdown feedback**: every foreground piece's time is recorded in isolation (the first
  ``calibrate`` foreground iterations run alone). A foreground piece that later runs
  ``target_slowdown`` (1.1x) slower than that while background work was on the device is marked
  sensitive (all-reduce is the known case); background pieces are then dispatched only if they
  are predicted to finish before the next sensitive piece starts;
- **AntMan limits** of a background job (``handle.limits``): a memory cap checked against the
  job's ``memory_bytes`` at each iteration boundary (above it the job is held until the cap is
  raised), and a compute share (fraction of device time). Both can change between iterations
  (``on_iteration`` callback or from another thread);
- a piece that raises stops its job (reported in its stats) while the others keep running.

Per-job statistics (throughput, iteration times, foreground slowdowns) and a trace of every
piece (``tidal.runtime.trace_export``) come back from ``run``.

Example:
    >>> from tidal.runtime.scheduler import Runtime, step_job
    >>> from tidal.runtime.backend import LogicalBackend
    >>> rt = Runtime(backend=LogicalBackend(lambda name, collocated: 100.0))
    >>> fg = rt.submit(step_job("train", lambda: None, iterations=3), priority="high")
    >>> bg = rt.submit(step_job("extra", lambda: None), priority="low")
    >>> stats = rt.run()
    >>> stats["train"].iterations, stats["extra"].iterations > 0
    (3, True)
"""
from __future__ import annotations

import collections
import itertools
import math
import statistics
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, Union

from tidal.ir.table import format_table
from tidal.runtime.backend import HIGH, LOW, Backend, CudaBackend, Launch, backend_for


@dataclass(frozen=True)
class Piece:
    """A unit of dispatch: ``fn()`` runs on the job's stream. ``kind`` names the operator class
    (``"compute"``, ``"all_reduce"``...); ``uses_device=False`` marks host-side waiting (for
    peers, for data) or communication that leaves the device free; ``predicted_us`` is the
    cost model's guess. A job with several streams (a training program: compute, comm, load)
    names the piece's ``stream`` (``""``: the job's own) and the pieces of the same iteration
    it waits for (``after``, their indices in the iteration's list): a dependency on another
    stream is an event, so the piece is enqueued at once and starts when the other ends."""

    name: str
    fn: Callable[[], Any]
    kind: str = "compute"
    uses_device: bool = True
    predicted_us: float = 0.0
    stream: str = ""
    after: tuple[int, ...] = ()


class Job(Protocol):
    """What ``Runtime.submit`` takes: a ``name``, ``memory_bytes`` it needs per iteration, and
    ``iteration(i)`` returning the pieces of iteration ``i`` (None when the job is done). A job
    may also have ``ready(i)``: iteration ``i`` is asked for only once it returns True (a
    training step built from the state the previous step left)."""

    name: str
    memory_bytes: int

    def iteration(self, index: int) -> Optional[Sequence[Piece]]: ...


@dataclass
class FunctionJob:
    """A job whose iteration ``i`` is ``make_pieces(i)``, for ``iterations`` iterations (None:
    until the runtime stops)."""

    name: str
    make_pieces: Callable[[int], Sequence[Piece]]
    iterations: Optional[int] = None
    memory_bytes: int = 0

    def iteration(self, index: int) -> Optional[Sequence[Piece]]:
        """The pieces of iteration ``index``, or None past the last iteration."""
        if self.iterations is not None and index >= self.iterations:
            return None
        return self.make_pieces(index)


def step_job(name: str, fn: Callable[[], Any], iterations: Optional[int] = None,
             memory_bytes: int = 0, kind: str = "compute") -> FunctionJob:
    """A job of one piece per iteration running ``fn()`` (e.g. ``lambda: compiled.step(x, y)``)."""
    return FunctionJob(name, lambda i: [Piece(name, fn, kind=kind)], iterations, memory_bytes)


def lowered_job(name: str, lowered: Any, inputs: Sequence[Any],
                iterations: Optional[int] = None, memory_bytes: int = 0,
                extra: Callable[[int], Sequence[Piece]] = lambda i: ()) -> FunctionJob:
    """A job running the pieces of ``lowered`` (a ``LoweredModule``) on ``inputs`` each
    iteration, followed by ``extra(i)`` pieces (e.g. a host-side wait for peers)."""
    return FunctionJob(name, lambda i: list(lowered.pieces(*inputs).pieces) + list(extra(i)),
                       iterations, memory_bytes)


@dataclass
class Limits:
    """AntMan-style limits of a background job, read at each iteration boundary:
    ``memory_bytes`` (None: no cap) and ``compute_share`` (fraction of device time, 1.0: any)."""

    memory_bytes: Optional[int] = None
    compute_share: float = 1.0


@dataclass
class JobStats:
    """What a job did: iterations and pieces completed, device-busy µs, iteration times,
    foreground slowdowns per piece (against isolated times), the error that stopped it, and
    when (backend µs) a background job was upgraded to the foreground (``upgraded_us``)."""

    name: str
    priority: str
    iterations: int = 0
    pieces: int = 0
    busy_us: float = 0.0
    first_us: Optional[float] = None
    last_us: Optional[float] = None
    iteration_us: list[float] = field(default_factory=list)
    slowdowns: list[float] = field(default_factory=list)
    max_outstanding: int = 0
    held: int = 0
    feedback_pauses: int = 0
    error: Optional[str] = None
    upgraded_us: Optional[float] = None

    @property
    def throughput(self) -> float:
        """Iterations per second over the job's active span (0 if none)."""
        if not self.iterations or self.first_us is None or self.last_us <= self.first_us:
            return 0.0
        return self.iterations / ((self.last_us - self.first_us) * 1e-6)

    @property
    def mean_slowdown(self) -> float:
        """Mean of the recorded per-piece slowdowns (1.0 if none)."""
        return sum(self.slowdowns) / len(self.slowdowns) if self.slowdowns else 1.0


@dataclass(frozen=True)
class TraceRecord:
    """One dispatched piece: when it was dispatched, became ready, started and ended (µs on
    the backend clock), whether background work was on the device meanwhile (foreground
    pieces), its slowdown against the isolated time, and its error."""

    job: str
    priority: str
    piece: str
    kind: str
    iteration: int
    dispatch_us: float
    ready_us: float
    start_us: float
    end_us: float
    collocated: bool = False
    slowdown: Optional[float] = None
    error: Optional[str] = None
    stream: str = ""
    index: int = -1


@dataclass
class _Queued:
    piece: Piece
    iteration: int
    last: bool
    index: int = 0
    dispatch_us: float = 0.0
    launch: Optional[Launch] = None
    seq: int = 0


class JobHandle:
    """A submitted job: its ``limits`` (adjustable), ``stats`` and ``finished`` state."""

    def __init__(self, job: Job, foreground: bool, limits: Limits,
                 on_iteration: Optional[Callable[["JobHandle", int], None]]):
        self.job = job
        self.name = job.name
        self.foreground = foreground
        self.limits = limits
        self.on_iteration = on_iteration
        self.stats = JobStats(job.name, "high" if foreground else "low")
        self.queue: collections.deque[_Queued] = collections.deque()
        self.outstanding: collections.deque[_Queued] = collections.deque()
        self.next_index = 0
        self.exhausted = False
        self.held = False
        self.last_end_us = 0.0
        self.iteration_start: Optional[float] = None
        self.stream: Any = None
        self.upgradable = False
        self.failure: Optional[BaseException] = None
        # dispatched pieces by (iteration, index), of the iterations still queued or running
        self.dispatched: dict[tuple[int, int], _Queued] = {}
        self.events: dict[tuple[int, int], Any] = {}  # ... and the event each one records
        # by iteration: the event recorded on the stream current when its pieces were made
        # (what produced its inputs), and the streams that already wait for it
        self.origins: dict[int, tuple[Any, set[int]]] = {}

    def device_outstanding(self, stream: Optional[str] = None) -> int:
        """Outstanding pieces that occupy the device (what launch pacing counts): all of
        them, or those on the job's ``stream`` (a piece's ``stream`` name)."""
        return sum(1 for q in self.outstanding if q.piece.uses_device and
                   (stream is None or q.piece.stream == stream))

    @property
    def finished(self) -> bool:
        """Done (no more iterations) or failed, with nothing queued or outstanding."""
        return (self.exhausted or self.stats.error is not None) and not self.outstanding \
            and not (self.queue and self.stats.error is None)

    def mean_piece_us(self) -> float:
        """Mean device time of this job's pieces so far (0 before the first)."""
        return self.stats.busy_us / self.stats.pieces if self.stats.pieces else 0.0

    def __repr__(self) -> str:
        return f"JobHandle({self.name!r}, {'high' if self.foreground else 'low'})"


_PRIORITIES = {"high": True, "foreground": True, "low": False, "background": False}


class Runtime:
    """Runs one foreground and several background jobs on ``device`` (see module docstring).

    ``backend`` overrides the device's backend (e.g. ``LogicalBackend`` for scripted tests).
    ``fg_depth``/``be_depth``: outstanding pieces per job (None: unbounded). ``priorities``:
    use high/low stream priorities (False: all equal). ``feedback``: the slowdown feedback loop;
    ``sensitive_kinds``: piece kinds treated as sensitive from the start. ``poll_us``: how
    long the dispatcher sleeps when it waits for time to pass (compute shares).
    ``stream_pool``: a dict that keeps the streams this runtime makes (by job role and stream
    name) for the next ``Runtime`` on the same backend (a program runner's per-step runtimes).
    Launch pacing counts the pieces that occupy the device (communication overlaps freely), per
    stream of the job (a job with two compute streams, tick-tock's waves, keeps both fed).
    ``idle_only``: background pieces go only into the foreground's idle spans — while no
    foreground piece occupies the device, and only a piece predicted to end before the
    foreground's next device piece can start, which is when the pieces it waits for (a
    transfer, a collective) are predicted to end (DeepPool's BP+Col: the ranks outside a
    layer's GPU set lend their idle time). Both predictions are conservative: the background
    piece's longest recent isolated duration against the foreground pieces' shortest, so a
    background piece rarely holds the device when the foreground needs it.
    ``inline_host``: the backend runs a piece's host side inside ``launch``, on the dispatcher's
    thread, and only its device work in stream order (None: a ``CudaBackend``). A host piece
    (``uses_device=False``) on a job's own stream, such as a foreground's wait for peers, then
    blocks the dispatcher while it runs: it is held until the pieces before it on its stream
    have ended (as a stream worker would run it: the device is idle meanwhile) and dispatched
    after the other jobs had their turn, so background pieces that fit go into that idle span.
    Pacing, feedback, compute shares and ``idle_only`` hold back background *device* pieces
    only; its host pieces (a step's loss, a collective) do not occupy the device.
    """

    def __init__(self, device: Any = "cpu", *, backend: Optional[Backend] = None,
                 fg_depth: Optional[int] = 2, be_depth: Optional[int] = 1,
                 target_slowdown: float = 1.1, feedback: bool = True, priorities: bool = True,
                 calibrate: int = 1, sensitive_kinds: Sequence[str] = (),
                 poll_us: float = 1000.0, stream_pool: Optional[dict] = None,
                 idle_only: bool = False, inline_host: Optional[bool] = None):
        for name, depth in (("fg_depth", fg_depth), ("be_depth", be_depth)):
            if depth is not None and (not isinstance(depth, int) or depth < 1):
                raise ValueError(f"Runtime({name}={depth!r}): must be a positive int or None")
        if not target_slowdown >= 1.0:
            raise ValueError(f"Runtime(target_slowdown={target_slowdown!r}): must be >= 1")
        self.backend = backend if backend is not None else backend_for(device)
        self.fg_depth, self.be_depth = fg_depth, be_depth
        self.target_slowdown = target_slowdown
        self.feedback, self.priorities = feedback, priorities
        self.calibrate = calibrate
        self.sensitive_kinds = frozenset(sensitive_kinds)
        self.poll_us = poll_us
        self.handles: list[JobHandle] = []
        self.isolated_us: dict[tuple[str, str], float] = {}
        self._samples: dict[tuple[str, str], collections.deque] = {}
        self.sensitive: set[tuple[str, str]] = set()
        self.trace: list[TraceRecord] = []
        self._bg_recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        self._seq = itertools.count()
        self._paused = False
        self._streams: dict = stream_pool if stream_pool is not None else {}
        self.idle_only = idle_only
        self._events = callable(getattr(self.backend, "event", None))
        self.inline_host = isinstance(self.backend, CudaBackend) if inline_host is None \
            else inline_host

    # -- submission -------------------------------------------------------------------------
    def submit(self, job: Job, priority: Union[str, int] = "low", *,
               memory_cap: Optional[int] = None, compute_share: float = 1.0,
               on_iteration: Optional[Callable[[JobHandle, int], None]] = None,
               upgrade: bool = False) -> JobHandle:
        """Add ``job`` as the foreground (``priority="high"``, or a negative int) or a
        background job (``"low"``); background jobs may get a ``memory_cap`` (bytes) and a
        ``compute_share``. ``on_iteration(handle, i)`` runs after each completed iteration.
        ``upgrade`` (background jobs): AntMan's job upgrade, the job becomes the foreground,
        without limits, when the foreground job finishes (the first such job in submission
        order), and ``run(until="foreground")`` goes on until it finishes too."""
        if isinstance(priority, str):
            if priority not in _PRIORITIES:
                raise ValueError(f"submit({job.name!r}): priority must be 'high' or 'low', "
                                 f"got {priority!r}")
            fg = _PRIORITIES[priority]
        else:
            fg = int(priority) < 0
        if fg and self._foreground() is not None:
            raise ValueError(f"submit({job.name!r}): there is already a foreground job "
                             f"({self._foreground().name!r}); submit others with priority='low'")
        if any(h.name == job.name for h in self.handles):
            raise ValueError(f"submit: a job named {job.name!r} was already submitted")
        if not 0 < compute_share <= 1:
            raise ValueError(f"submit({job.name!r}): compute_share must be in (0, 1]")
        h = JobHandle(job, fg, Limits(memory_cap, compute_share), on_iteration)
        h.upgradable = upgrade and not fg
        h.stream = self._stream(fg, "", True)
        self.handles.append(h)
        self.handles.sort(key=lambda x: not x.foreground)
        return h

    def _stream(self, foreground: bool, name: str, uses_device: bool) -> Any:
        """The stream of a job role (``foreground``) and stream name: compute streams take
        the job's priority, communication streams (``uses_device=False``) the low one."""
        key = (foreground, name, uses_device)
        if key not in self._streams:
            urgent = foreground and self.priorities and uses_device
            self._streams[key] = self.backend.stream(HIGH if urgent else LOW)
        return self._streams[key]

    def _stream_of(self, h: JobHandle, p: Piece) -> Any:
        return h.stream if not p.stream else self._stream(h.foreground, p.stream,
                                                          p.uses_device)

    def _deps_ready(self, h: JobHandle, q: "_Queued") -> bool:
        """Whether ``q`` may be dispatched as far as the pieces it waits for go: once they
        are dispatched with events (its stream waits for them), else once they ended."""
        deps = [h.dispatched.get((q.iteration, d)) for d in q.piece.after]
        if any(d is None for d in deps):
            return False
        return self._events or all(d.launch.done() for d in deps)

    def _pick(self, h: JobHandle, depth: Optional[int]) -> Optional["_Queued"]:
        """The queued piece of ``h`` to dispatch next: the first, in queue order, that is the
        earliest queued piece of its stream (a stream runs its pieces in order), whose stream
        has fewer than ``depth`` device pieces outstanding (device pieces only) and whose
        dependencies allow it (:meth:`_deps_ready`). Pieces of other streams, and of the next
        iteration, may so go before a piece that waits."""
        seen: set[str] = set()
        for q in h.queue:
            stream = q.piece.stream
            if stream in seen:
                continue
            seen.add(stream)
            if depth is not None and q.piece.uses_device and \
                    h.device_outstanding(stream) >= depth:
                continue
            if self._blocks_dispatcher(q.piece) and any(
                    not o.launch.done() for o in h.outstanding if o.piece.stream == stream):
                continue  # runs in stream order: once the pieces before it have ended
            if self._deps_ready(h, q):
                return q
        return None

    def _blocks_dispatcher(self, p: Piece) -> bool:
        """Whether dispatching ``p`` blocks the dispatcher until ``p`` ends: a host piece on
        its job's own stream (shared with its device pieces) on an ``inline_host`` backend."""
        return self.inline_host and not p.uses_device and not p.stream

    def _foreground(self) -> Optional[JobHandle]:
        return next((h for h in self.handles if h.foreground), None)

    # -- the dispatch loop ------------------------------------------------------------------
    def run(self, until: str = "foreground", timeout_s: Optional[float] = None
            ) -> dict[str, JobStats]:
        """Dispatch until the foreground job finishes (``until="foreground"``; with no
        foreground job: until every job finishes, as ``until="all"``) or ``timeout_s`` of
        backend time pass; then wait for outstanding pieces and return the stats by job."""
        if until not in ("foreground", "all"):
            raise ValueError(f"run(until={until!r}): use 'foreground' or 'all'")
        be = self.backend
        t_end = None if timeout_s is None else be.now_us() + timeout_s * 1e6
        stopping = False
        while True:
            now = be.now_us()
            self._collect()
            self._upgrade(now)
            stopping = stopping or self._should_stop(until) or (t_end is not None
                                                                and now >= t_end)
            dispatched: set[str] = set()
            if not stopping:
                while (chosen := self._choose(now, dispatched)) is not None:
                    self._dispatch(*chosen, now)
                    dispatched.add(chosen[0].name)
            launches = [q.launch for h in self.handles for q in h.outstanding]
            if not launches:
                if stopping or self._stuck():
                    break
                if dispatched:
                    continue
            # only background work waits for time to pass (compute shares, feedback): a lone
            # job wakes when a piece ends, not every poll (the wake-ups take the GIL from
            # the stream workers that run the pieces)
            alone = all(h.foreground or h.finished for h in self.handles)
            be.wait_any(launches, timeout_us=None if alone else self.poll_us)
        return {h.name: h.stats for h in self.handles}

    def _upgrade(self, now: float) -> None:
        """AntMan's job upgrade: once the foreground job has finished, the first upgradable
        background job still running becomes the foreground (high priority, no limits)."""
        fg = self._foreground()
        if fg is None or not fg.finished:
            return
        nxt = next((h for h in self.handles if h.upgradable and not h.finished), None)
        if nxt is None:
            return
        fg.foreground = False
        nxt.foreground, nxt.upgradable = True, False
        nxt.limits = Limits()
        nxt.stream = self._stream(True, "", True)
        nxt.stats.priority = "high"
        nxt.stats.upgraded_us = now
        self.handles.sort(key=lambda x: not x.foreground)

    def busy_fraction(self) -> dict[str, float]:
        """The GpuOpManager's profile: each job's device-busy time (its pieces' measured
        durations) as a share of the run's span (first start to last end in ``trace``), and
        ``"idle"``: the share no job's piece covered (intervals merged)."""
        if not self.trace:
            return {"idle": 1.0}
        start = min(r.start_us for r in self.trace)
        span = max(r.end_us for r in self.trace) - start
        if span <= 0:
            return {"idle": 1.0}
        shares = {h.name: h.stats.busy_us / span for h in self.handles}
        covered, reach = 0.0, start
        for r in sorted(self.trace, key=lambda r: r.start_us):
            lo = max(r.start_us, reach)
            if r.end_us > lo:
                covered += r.end_us - lo
                reach = r.end_us
        shares["idle"] = max(0.0, 1.0 - covered / span)
        return shares

    def _should_stop(self, until: str) -> bool:
        fg = self._foreground()
        if until == "foreground" and fg is not None:
            return fg.finished
        return all(h.finished for h in self.handles)

    def _stuck(self) -> bool:
        """Nothing outstanding and no job can move without an outside change (all held)."""
        live = [h for h in self.handles if not h.finished]
        return all(h.held for h in live)

    def _refill(self, h: JobHandle) -> bool:
        """Queue ``h``'s next iteration when its queue is empty; whether it has pieces."""
        return bool(h.queue) or self._append_iteration(h)

    def _look_ahead(self, h: JobHandle) -> bool:
        """Queue ``h``'s next iteration behind the one queued (at most two), when the job
        lets it be built now (its ``ready``); whether it did."""
        return bool(h.queue) and h.queue[-1].iteration == h.queue[0].iteration and \
            self._append_iteration(h)

    def _append_iteration(self, h: JobHandle) -> bool:
        if h.exhausted or h.stats.error is not None:
            return False
        cap = h.limits.memory_bytes
        need = getattr(h.job, "memory_bytes", 0) or 0
        if cap is not None and need > cap:
            if not h.held:
                h.stats.held += 1
            h.held = True
            return False
        h.held = False
        ready = getattr(h.job, "ready", None)
        if ready is not None and not ready(h.next_index):
            return False  # the job builds this iteration once the previous one has ended
        try:
            pieces = h.job.iteration(h.next_index)
            if pieces is not None and not pieces:
                raise ValueError(f"iteration {h.next_index} has no pieces")
        except Exception as e:  # a job that cannot even produce its pieces fails alone
            self._fail(h, e)
            return False
        if pieces is None:
            h.exhausted = True
            return False
        pieces = list(pieces)
        if self._events:  # its inputs were made on the caller's stream: its streams wait
            origin = self.backend.event()
            self.backend.record(self.backend.current_stream(), origin)
            h.origins[h.next_index] = (origin, set())
        for i, p in enumerate(pieces):
            if any(not 0 <= d < i for d in p.after):
                self._fail(h, ValueError(f"iteration {h.next_index}: piece {p.name!r} waits "
                                         f"for {p.after}, not all earlier pieces"))
                return False
            h.queue.append(_Queued(p, h.next_index, i == len(pieces) - 1, index=i))
        h.next_index += 1
        return True

    def _choose(self, now: float, dispatched: set[str]
                ) -> Optional[tuple[JobHandle, "_Queued"]]:
        """The next (job, piece) to dispatch: the foreground's first, then the background
        jobs' in submission order; a piece that blocks the dispatcher goes last."""
        blocking = None
        for h in self.handles:
            depth = self.fg_depth if h.foreground else self.be_depth
            if depth is None and h.name in dispatched:
                continue  # unpaced: one launch per dispatcher round (the host's launch rate)
            if not h.foreground and depth is not None and h.device_outstanding() >= depth:
                continue  # background iterations (and their memory check) start when dispatched
            if not self._refill(h):
                continue  # the foreground queue is refilled early: feedback looks ahead
            q = self._pick(h, depth)
            if q is None and self._look_ahead(h):
                q = self._pick(h, depth)
            if q is None:
                continue
            if self._blocks_dispatcher(q.piece):
                blocking = blocking or (h, q)  # the other jobs dispatch first
            elif h.foreground or not q.piece.uses_device or self._bg_allowed(h, now, q):
                return h, q
        return blocking

    def _bg_allowed(self, h: JobHandle, now: float, q: "_Queued") -> bool:
        if h.limits.compute_share < 1.0 and h.stats.first_us is not None:
            if h.stats.busy_us > h.limits.compute_share * (now - h.stats.first_us):
                return False
        fg = self._foreground()
        if fg is None or fg.finished or not (self.feedback or self.idle_only):
            return True
        if fg.stats.iterations < self.calibrate and fg.stats.error is None:
            return False  # the foreground's isolated times are being recorded
        if self.idle_only:
            return self._fits_idle_span(fg, h, now, q)
        est = self.isolated_us.get((h.name, q.piece.name), h.mean_piece_us()) \
            or q.piece.predicted_us
        allowed = now + est <= self._next_sensitive_start(fg, now)
        if not allowed and not self._paused:
            h.stats.feedback_pauses += 1
        self._paused = not allowed
        return allowed

    def _fits_idle_span(self, fg: JobHandle, h: JobHandle, now: float, nxt: "_Queued") -> bool:
        """Whether ``h``'s next piece ``nxt``, after the device pieces it already has outstanding
        (queued behind one another on its stream: ``be_depth`` > 1 saves a dispatch between
        them), is predicted to end before the foreground needs the device."""
        start = now
        for q in h.outstanding:
            if q.piece.uses_device and not q.launch.done():
                took = self._estimate(h, q.piece)
                start = max(start, q.launch.start_us + took) if q.launch.started else \
                    start + took
        allowed = start + self._estimate(h, nxt.piece) <= self.idle_until(fg, now)
        if not allowed:
            h.stats.feedback_pauses += 1
        return allowed

    def idle_until(self, fg: JobHandle, now: float) -> float:
        """When the foreground next needs the device: ``now`` while one of its device pieces
        runs or can start; else the predicted end of the pieces its next device piece waits
        for (inf when it has no device piece left)."""
        if any(q.piece.uses_device and q.launch.started and not q.launch.done()
               for q in fg.outstanding):
            return now
        pending = [q for q in fg.outstanding if q.piece.uses_device and not q.launch.done()]
        pending += [q for q in fg.queue if q.piece.uses_device]
        if not pending:
            running = [self._predicted_end(fg, q, now) for q in fg.outstanding
                       if not q.launch.done()]
            return max(running) if running else (math.inf if fg.exhausted else now)
        nxt = pending[0]
        deps = [fg.dispatched.get((nxt.iteration, d)) for d in nxt.piece.after]
        waits = [q for q in deps if q is not None and not q.piece.uses_device]
        return max([now] + [self._predicted_end(fg, q, now) for q in waits
                            if not q.launch.done()])

    def _predicted_end(self, h: JobHandle, q: _Queued, now: float) -> float:
        """The earliest end of ``q`` its recent durations support (the shortest of them: a
        background piece that fits before it rarely delays the foreground)."""
        took = self._bound(h, q.piece, min) or self._iso(h, q.piece)
        if q.launch is None or not q.launch.started:
            return now + took
        return max(now, q.launch.start_us + took)

    def _estimate(self, h: JobHandle, p: Piece) -> float:
        """A background piece's duration for the idle-span test: its longest recent one."""
        return self._bound(h, p, max) or h.mean_piece_us() or p.predicted_us

    def _bound(self, h: JobHandle, p: Piece, pick: Callable) -> float:
        """``pick`` (min or max) of the piece's recent isolated durations (0 if none)."""
        samples = self._samples.get((h.name, p.name))
        return pick(samples) if samples else 0.0

    def _iso(self, h: JobHandle, p: Piece) -> float:
        return self.isolated_us.get((h.name, p.name), p.predicted_us)

    def is_sensitive(self, h: JobHandle, p: Piece) -> bool:
        """Whether foreground piece ``p`` of job ``h`` pauses background dispatch."""
        return p.kind in self.sensitive_kinds or (h.name, p.name) in self.sensitive

    def _next_sensitive_start(self, fg: JobHandle, now: float) -> float:
        """Predicted start of the foreground's next sensitive piece (inf if none is queued)."""
        running = [q for q in fg.outstanding if not q.launch.done()]
        if running:
            t = max(fg.last_end_us, running[0].dispatch_us)
            for q in running:
                if self.is_sensitive(fg, q.piece):
                    return t
                t += self._iso(fg, q.piece)
            t = max(t, now)
        else:
            t = now
        for q in fg.queue:
            if self.is_sensitive(fg, q.piece):
                return t
            t += self._iso(fg, q.piece)
        return math.inf

    def _dispatch(self, h: JobHandle, q: "_Queued", now: float) -> None:
        h.queue.remove(q)
        q.dispatch_us, q.seq = now, next(self._seq)
        if h.stats.first_us is None:
            h.stats.first_us = now
        if h.iteration_start is None:
            h.iteration_start = now
        stream = self._stream_of(h, q.piece)
        origin = h.origins.get(q.iteration)
        if origin is not None and id(stream) not in origin[1]:
            origin[1].add(id(stream))
            if not origin[0].query():  # what the caller enqueued has not run yet
                self.backend.wait(stream, origin[0])
        for d in q.piece.after:
            key = (q.iteration, d)
            if self._events and self._stream_of(h, h.dispatched[key].piece) is not stream:
                self.backend.wait(stream, h.events[key])
        q.launch = self.backend.launch(stream, q.piece.fn, uses_device=q.piece.uses_device,
                                       label=f"{h.name}/{q.piece.name}")
        h.dispatched[(q.iteration, q.index)] = q
        if self._events:
            h.events[(q.iteration, q.index)] = self.backend.event()
            self.backend.record(stream, h.events[(q.iteration, q.index)])
        h.outstanding.append(q)
        h.stats.max_outstanding = max(h.stats.max_outstanding, len(h.outstanding))

    def _collect(self) -> None:
        done = [(q.launch.end_us, q.seq, h, q) for h in self.handles for q in h.outstanding
                if q.launch.done()]
        for _, _, h, q in sorted(done, key=lambda d: d[:2]):
            h.outstanding.remove(q)
            self._finish(h, q)
        for h in {id(h): h for _, _, h, _ in done}.values():  # forget finished iterations
            oldest = min([q.iteration for q in h.queue] + [q.iteration for q in h.outstanding],
                         default=h.next_index)
            for key in [k for k in h.dispatched if k[0] < oldest]:
                del h.dispatched[key]
                h.events.pop(key, None)
            for it in [i for i in h.origins if i < oldest]:
                del h.origins[it]

    def _collocated(self, ready: float, end: float) -> bool:
        for h in self.handles:
            if not h.foreground and any(q.dispatch_us < end and q.piece.uses_device
                                        for q in h.outstanding):
                return True
        return any(s < end and e > ready for s, e in self._bg_recent)

    def _finish(self, h: JobHandle, q: _Queued) -> None:
        lh, p = q.launch, q.piece
        err = None if lh.error is None else f"{type(lh.error).__name__}: {lh.error}"
        collocated, slowdown = False, None
        key = (h.name, p.name)
        if h.foreground and err is None:
            took = lh.end_us - lh.ready_us
            collocated = p.uses_device and self._collocated(lh.ready_us, lh.end_us)
            if not collocated:
                self._observe(key, took)
            if p.uses_device and self.isolated_us.get(key, 0) > 0:
                slowdown = took / self.isolated_us[key]
                h.stats.slowdowns.append(slowdown)
                if collocated and self.feedback and slowdown > self.target_slowdown:
                    self.sensitive.add(key)
        elif not h.foreground and p.uses_device:
            self._bg_recent.append((lh.start_us, lh.end_us))
            if err is None:
                self._observe(key, lh.end_us - lh.start_us)
        h.last_end_us = max(h.last_end_us, lh.end_us)
        self.trace.append(TraceRecord(h.name, h.stats.priority, p.name, p.kind, q.iteration,
                                      q.dispatch_us, lh.ready_us, lh.start_us, lh.end_us,
                                      collocated, slowdown, err, p.stream, q.index))
        if err is not None:
            if h.stats.error is None:
                self._fail(h, lh.error)
            return
        if h.stats.error is not None:
            return
        st = h.stats
        st.pieces += 1
        if p.uses_device:
            st.busy_us += lh.end_us - lh.start_us
        st.last_us = max(st.last_us or 0.0, lh.end_us)
        if q.last:
            st.iterations += 1
            st.iteration_us.append(lh.end_us - (h.iteration_start or lh.start_us))
            h.iteration_start = lh.end_us if (h.queue or h.outstanding) else None
            if h.on_iteration is not None:
                h.on_iteration(h, q.iteration)

    def _observe(self, key: tuple[str, str], took: float) -> None:
        """Record an isolated duration; the estimate is the median of the last few (robust
        to a noisy host)."""
        samples = self._samples.setdefault(key, collections.deque(maxlen=5))
        samples.append(took)
        self.isolated_us[key] = statistics.median(samples)

    def _fail(self, h: JobHandle, error: BaseException) -> None:
        h.failure = error
        h.stats.error = "".join(traceback.format_exception_only(type(error), error)).strip()
        h.queue.clear()
        h.exhausted = True

    # -- reporting --------------------------------------------------------------------------
    def summary(self) -> str:
        """Per-job table: iterations, throughput, mean iteration ms, device-busy share,
        foreground slowdown, feedback pauses, errors."""
        rows = []
        for h in self.handles:
            s = h.stats
            span = (s.last_us - s.first_us) if s.first_us is not None and s.last_us else 0.0
            mean_it = sum(s.iteration_us) / len(s.iteration_us) / 1e3 if s.iteration_us else 0
            rows.append([s.name, s.priority, s.iterations, s.pieces, round(s.throughput, 2),
                         round(mean_it, 3), round(100 * s.busy_us / span, 1) if span else 0.0,
                         round(s.mean_slowdown, 3) if h.foreground else "-",
                         s.max_outstanding, s.feedback_pauses, s.held, s.error or "-"])
        table = format_table(["job", "prio", "iters", "pieces", "iters/s", "iter ms",
                              "busy %", "fg slowdown", "max out", "pauses", "held", "error"],
                             rows)
        if self.sensitive:
            table += "\nsensitive pieces: " + ", ".join(f"{j}/{p}" for j, p in
                                                        sorted(self.sensitive))
        return table

    def close(self) -> None:
        """Release the backend's workers."""
        self.backend.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""The dispatch loop of the multi-job runtime (``tidal.runtime.scheduler`` documents what it
does): :class:`Runtime` takes jobs (``submit``), dispatches their pieces onto streams
(``run``) and records what ran; the rules it applies are its parts' (``tidal.runtime.scheduling``).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Sequence, Union

from tidal.runtime.backend import Backend, CudaBackend, backend_for
from tidal.runtime.scheduling.gate import BackgroundGate
from tidal.runtime.scheduling.handle import JobHandle, Queued
from tidal.runtime.scheduling.idle import idle_until
from tidal.runtime.scheduling.jobs import Job
from tidal.runtime.scheduling.limits import Limits
from tidal.runtime.scheduling.queues import Queues
from tidal.runtime.scheduling.records import (JobStats, TraceRecord, busy_fraction,
                                              count_piece, summary)
from tidal.runtime.scheduling.streams import StreamPool
from tidal.runtime.scheduling.timing import Timings

PRIORITIES = {"high": True, "foreground": True, "low": False, "background": False}
"""``Runtime.submit``'s priority names: whether each is the foreground."""


class Runtime:
    """Runs one foreground and several background jobs on ``device`` (see
    ``tidal.runtime.scheduler``).

    ``backend`` overrides the device's backend (e.g. ``LogicalBackend`` for scripted tests).
    ``fg_depth``/``be_depth``: outstanding pieces per job (None: unbounded). ``priorities``:
    use high/low stream priorities (False: all equal). ``feedback``: the slowdown feedback loop;
    ``sensitive_kinds``: operator classes (``tidal.runtime.scheduling.pieces.operator_class``)
    treated as sensitive from the start. ``poll_us``: how long the dispatcher sleeps when it
    waits for time to pass (compute shares). ``stream_pool``: a dict that keeps the streams this
    runtime makes (by job role and stream name) for the next ``Runtime`` on the same backend (a
    program runner's per-step runtimes). Launch pacing counts the pieces that occupy the device
    (communication overlaps freely), per stream of the job (a job with two compute streams,
    tick-tock's waves, keeps both fed). ``idle_only``: background pieces go only into the
    foreground's idle spans (``tidal.runtime.scheduling.idle``).
    ``inline_host``: the backend runs a piece's host side inside ``launch``, on the dispatcher's
    thread, and only its device work in stream order (None: a ``CudaBackend``). A host piece on
    a compute stream, such as a foreground's wait for peers, then blocks the dispatcher while it
    runs: it is held until the pieces before it on its stream have ended (as a stream worker
    would run it: the device is idle meanwhile) and dispatched after the other jobs had their
    turn, so background pieces that fit go into that idle span. Pacing, feedback, compute
    shares and ``idle_only`` hold back background *device* pieces only; its host pieces (a
    step's loss, a collective) do not occupy the device.
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
        self.poll_us = poll_us
        self.handles: list[JobHandle] = []
        self.trace: list[TraceRecord] = []
        self.timings = Timings(sensitive_kinds, target_slowdown, feedback)
        self.gate = BackgroundGate(self.timings, feedback, idle_only, calibrate)
        self.streams = StreamPool(self.backend, priorities, stream_pool)
        self._events = callable(getattr(self.backend, "event", None))
        inline = isinstance(self.backend, CudaBackend) if inline_host is None else inline_host
        self.queues = Queues(self.backend, self._events, inline)
        self._seq = itertools.count()

    @property
    def sensitive(self) -> set[tuple[str, str]]:
        """The (job, piece) pairs the feedback loop found sensitive."""
        return self.timings.sensitive

    @property
    def isolated_us(self) -> dict[tuple[str, str], float]:
        """Isolated duration by (job, piece name)."""
        return self.timings.isolated_us

    @property
    def inline_host(self) -> bool:
        """Whether the backend runs a piece's host side inside ``launch``."""
        return self.queues.inline_host

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
            if priority not in PRIORITIES:
                raise ValueError(f"submit({job.name!r}): priority must be 'high' or 'low', "
                                 f"got {priority!r}")
            fg = PRIORITIES[priority]
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
        self.handles.append(h)
        self.handles.sort(key=lambda x: not x.foreground)
        return h

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

    def _choose(self, now: float, dispatched: set[str]) -> Optional[tuple[JobHandle, Queued]]:
        """The next (job, piece) to dispatch: the foreground's first, then the background
        jobs' in submission order; a piece that blocks the dispatcher goes last."""
        blocking = None
        for h in self.handles:
            depth = self.fg_depth if h.foreground else self.be_depth
            if depth is None and h.name in dispatched:
                continue  # unpaced: one launch per dispatcher round (the host's launch rate)
            if not h.foreground and depth is not None and h.device_outstanding() >= depth:
                continue  # background iterations (and their memory check) start when dispatched
            if not self.queues.refill(h):
                continue  # the foreground queue is refilled early: feedback looks ahead
            q = self.queues.pick(h, depth)
            if q is None and self.queues.look_ahead(h):
                q = self.queues.pick(h, depth)
            if q is None:
                continue
            if self.queues.blocks_dispatcher(q):
                blocking = blocking or (h, q)  # the other jobs dispatch first
            elif h.foreground or not q.uses_device or \
                    self.gate.allows(self._foreground(), h, now, q):
                return h, q
        return blocking

    def _dispatch(self, h: JobHandle, q: Queued, now: float) -> None:
        h.queue.remove(q)
        q.dispatch_us, q.seq = now, next(self._seq)
        if h.stats.first_us is None:
            h.stats.first_us = now
        if h.iteration_start is None:
            h.iteration_start = now
        stream = self.streams.of(h, q)
        origin = h.origins.get(q.iteration)
        if origin is not None and id(stream) not in origin[1]:
            origin[1].add(id(stream))
            if not origin[0].query():  # what the caller enqueued has not run yet
                self.backend.wait(stream, origin[0])
        for d in q.piece.deps:
            key = (q.iteration, d)
            if self._events and self.streams.of(h, h.dispatched[key]) is not stream:
                self.backend.wait(stream, h.events[key])
        q.launch = self.backend.launch(stream, q.fn, uses_device=q.uses_device,
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
        ended = {}  # the jobs an iteration of which ended
        for _, _, h, q in sorted(done, key=lambda d: d[:2]):
            h.outstanding.remove(q)
            self._finish(h, q)
            if q.last:
                ended[id(h)] = h
        for h in ended.values():
            h.forget_finished()

    def _finish(self, h: JobHandle, q: Queued) -> None:
        lh = q.launch
        err = None if lh.error is None else f"{type(lh.error).__name__}: {lh.error}"
        collocated, slowdown = self.timings.record(self.handles, h, q)
        h.last_end_us = max(h.last_end_us, lh.end_us)
        self.trace.append(TraceRecord(h.name, h.stats.priority, q.piece.name, q.kind,
                                      q.iteration, q.dispatch_us, lh.ready_us, lh.start_us,
                                      lh.end_us, collocated, slowdown, err, q.piece.stream,
                                      q.index))
        if err is not None:
            if h.stats.error is None:
                h.fail(lh.error)
            return
        if h.stats.error is not None:
            return
        count_piece(h.stats, q.uses_device, lh.start_us, lh.end_us)
        if q.last:
            st = h.stats
            st.iterations += 1
            st.iteration_us.append(lh.end_us - (h.iteration_start or lh.start_us))
            h.iteration_start = lh.end_us if (h.queue or h.outstanding) else None
            if h.on_iteration is not None:
                h.on_iteration(h, q.iteration)

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
        nxt.stats.priority = "high"
        nxt.stats.upgraded_us = now
        self.handles.sort(key=lambda x: not x.foreground)

    def _should_stop(self, until: str) -> bool:
        fg = self._foreground()
        if until == "foreground" and fg is not None:
            return fg.finished
        return all(h.finished for h in self.handles)

    def _stuck(self) -> bool:
        """Nothing outstanding and no job can move without an outside change (all held)."""
        return all(h.held for h in self.handles if not h.finished)

    # -- reporting --------------------------------------------------------------------------
    def idle_until(self, fg: JobHandle, now: float) -> float:
        """When the foreground ``fg`` next needs the device
        (``tidal.runtime.scheduling.idle.idle_until``)."""
        return idle_until(self.timings, fg, now)

    def is_sensitive(self, h: JobHandle, q: Queued) -> bool:
        """Whether foreground piece ``q`` of job ``h`` pauses background dispatch."""
        return self.timings.is_sensitive(h, q)

    def busy_fraction(self) -> dict[str, float]:
        """Each job's device-busy share of the run's span and the idle share
        (``tidal.runtime.scheduling.records.busy_fraction``)."""
        return busy_fraction(self.trace, [h.stats for h in self.handles])

    def summary(self) -> str:
        """Per-job table: iterations, throughput, mean iteration ms, device-busy share,
        foreground slowdown, feedback pauses, errors."""
        return summary(self.handles, self.sensitive)

    def close(self) -> None:
        """Release the backend's workers."""
        self.backend.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

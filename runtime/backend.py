"""Runtime backends: priority streams, events, synchronize, capture/replay of a static segment.

One interface, three implementations selected by :func:`backend_for`:

- ``CudaBackend`` (a CUDA device): ``torch.cuda.Stream(priority=...)``, ``torch.cuda.Event``,
  ``torch.cuda.CUDAGraph`` capture after a warm-up on a side stream. Inputs named ``in_place``
  (parameters, buffers: tensors that keep their storage from step to step) are captured against
  their own storage and read in place; the others are copied into static buffers before a replay
  (only when they are not already those buffers). Each owner of captures (a lowered module, a
  program) asks for its own memory pool (:meth:`Backend.memory_pool`). Times come from CUDA
  events against one reference event, and ``now_us`` counts from that same event: one clock.
- ``CpuBackend`` (the CPU): the same semantics emulated. A stream is a FIFO worker thread; work
  that occupies the device passes a gate with ``slots`` places (default 1: one device) that is
  granted to the most urgent ready stream first and is never preempted (as a GPU's block
  scheduler); ``slots=None`` lets streams run freely (naive co-running). A foreground piece on
  the device whose stream has run everything enqueued on it, with a free place on the device
  that no other stream waits for, runs at once on the launching thread (as CUDA runs a piece's
  host side inside ``launch``): the same order, events and times, without the two thread
  hand-offs (``inline=False``: always the worker). A captured segment is a straight-line
  program (``tidal.runtime.lower`` compiles one per segment) bound to static input slots; it
  replays with no re-tracing, its globals bound at capture and each operator called through
  its C++ entry point (:func:`direct_calls`: the fastest equivalent route on the CPU).
- ``LogicalBackend``: streams on a logical clock with scripted durations, so scheduling policies
  are tested deterministically (no wall-clock timing in tests).

Priorities follow CUDA: a lower number is more urgent (``HIGH = -1``, ``LOW = 0``). Launches
run the host side of a piece at once (CUDA: enqueue; CPU: hand to the stream worker) and return
a :class:`Launch` whose ``ready_us``/``start_us``/``end_us`` are device-side times.

Work that reads what another stream produced waits for it: :meth:`Backend.current_stream` is
the stream the caller's work goes to (CUDA: ``torch.cuda.current_stream``; CPU: the host, where
work is done when it returns, or a stream made current with :meth:`Backend.use`), and
``record``/``wait`` put an event between two streams. A piece that reads a tensor another
stream made calls :func:`used_here` (CUDA's ``Tensor.record_stream`` on its own stream; nothing
to do on the CPU, where memory is freed by reference).

Example:
    >>> import torch
    >>> from tidal.runtime.backend import backend_for, HIGH
    >>> be = backend_for("cpu")
    >>> s = be.stream(priority=HIGH)
    >>> seg = be.capture(lambda x: (x * 2 + 1,), (torch.ones(3),))
    >>> be.launch(s, seg.replay, torch.arange(3.0)).wait()[0].tolist()
    [1.0, 3.0, 5.0]
    >>> be.close()
"""
from __future__ import annotations

import builtins
import collections
import contextlib
import heapq
import itertools
import threading
import time
import types
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

HIGH = -1
"""Stream priority of foreground work (CUDA convention: lower is more urgent)."""
LOW = 0
"""Stream priority of background work."""


def _tensor_sig(values: Sequence[Any]) -> tuple:
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
                 for v in values)


class Flag:
    """A one-shot ``threading.Event`` (``set``, ``is_set``, ``wait``) that is cheap to make
    (one lock, held from birth until the flag is set; ``threading.Event`` builds a Condition):
    every launch and event of a step makes one.

    Example:
        >>> f = Flag()
        >>> f.is_set(), f.wait(timeout=0)
        (False, False)
        >>> f.set(); f.set()
        >>> f.is_set(), f.wait()
        (True, True)
    """

    __slots__ = ("_lock", "_unset", "_is_set")

    def __init__(self) -> None:
        self._is_set = False
        self._unset = [True]  # popped by the one call of set() that releases the lock
        self._lock = threading.Lock()
        self._lock.acquire()

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._is_set

    def set(self) -> None:
        """Set the flag and wake every waiter (later calls do nothing)."""
        try:
            self._unset.pop()  # atomic: one caller gets here
        except IndexError:
            return
        self._is_set = True
        self._lock.release()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until set, or ``timeout`` seconds; whether it is set."""
        if not self._is_set and self._lock.acquire(timeout=-1 if timeout is None
                                                   else max(timeout, 0.0)):
            self._lock.release()
        return self._is_set


class OnCaller:
    """A piece's work that may run on the dispatching thread when its stream is idle
    (launched with ``on_caller=True``, :meth:`Backend.launch`): it only enqueues asynchronous
    work that a later piece waits for (a gloo collective issued with ``async_op=True``, its
    ``Work`` waited by the optimizer piece: CUDA too runs a NCCL call's host side inside
    ``launch``), or the pieces after it wait for it anyway (a broadcast before the forward),
    so a hand-off to the stream's worker thread would only cost time.

    >>> OnCaller(lambda: 3)()
    3
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn

    def __call__(self) -> Any:
        return self.fn()


class Launch:
    """A unit of work enqueued on a stream. ``done()`` polls; ``wait()`` blocks and returns the
    result or re-raises the error. Device times (µs on the backend clock) once done:
    ``ready_us`` (it could start: the stream reached it), ``start_us``, ``end_us``."""

    __slots__ = ("label", "result", "error", "ready_us", "start_us", "end_us", "started",
                 "_done")

    def __init__(self, label: str = ""):
        self.label = label
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.ready_us = self.start_us = self.end_us = 0.0
        self.started = False  # it has begun on the device (start_us is set)
        self._done = Flag()

    def done(self) -> bool:
        """Whether the work has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self) -> Any:
        """Block until done; return the result or raise the work's exception."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class Captured:
    """A captured static segment: ``replay(*inputs)`` runs it on inputs of the captured
    shapes/dtypes and returns its outputs (on CUDA, static buffers overwritten by the next
    replay). ``signature`` is the (shape, dtype) of each input."""

    def __init__(self, program: Callable, static_inputs: Sequence[Any]):
        self.program = program
        self.signature = _tensor_sig(static_inputs)

    def replay(self, *inputs: Any) -> Any:
        """Run the segment on ``inputs`` (bound to the static input slots by reference: the
        stream reads them when it runs, as a CUDA copy-in enqueued on the same stream would)."""
        return self.program(*inputs)


class CaptureError(RuntimeError):
    """A program could not be captured (a host sync or a CPU-device copy inside it, say); the
    device is left as it was before the capture, so the caller can run the program as it is
    (``LoweredModule`` does, and names the step and the error in its report)."""


class Backend:
    """Interface of a runtime backend (see the module docstring)."""

    device: torch.device

    def stream(self, priority: int = LOW) -> Any:
        """A new stream; work on it runs in FIFO order; ``priority`` lower = more urgent."""
        raise NotImplementedError

    def launch(self, stream: Any, fn: Callable, *args: Any, uses_device: bool = True,
               label: str = "", on_caller: bool = False) -> Launch:
        """Enqueue ``fn(*args)`` on ``stream``. ``uses_device=False``: host-side waiting (e.g.
        for peers) that does not occupy the device. ``on_caller``: ``fn`` may run on the
        caller's thread (see :class:`OnCaller`)."""
        raise NotImplementedError

    def wait_any(self, launches: Sequence[Launch], timeout_us: Optional[float] = None) -> None:
        """Block until one of ``launches`` is done or ``timeout_us`` passes."""
        raise NotImplementedError

    def now_us(self) -> float:
        """The backend clock in microseconds."""
        raise NotImplementedError

    def capture(self, program: Callable, static_inputs: Sequence[Any], *,
                pool: Any = None, in_place: Sequence[int] = ()) -> Captured:
        """Capture ``program`` (a straight-line segment) for replay on inputs shaped like
        ``static_inputs``. ``pool``: the memory pool of the captures' owner
        (:meth:`memory_pool`). ``in_place``: positions of inputs read from their own storage
        at every replay (parameters and buffers), never copied."""
        return Captured(program, static_inputs)

    def memory_pool(self) -> Any:
        """A memory pool for one owner's captures (CUDA: a graph pool handle; None here)."""
        return None

    def current_stream(self) -> Any:
        """The stream the caller's work goes to (see the module docstring)."""
        return None

    def record(self, stream: Any, event: Any) -> None:
        """Complete ``event`` when ``stream`` reaches this point."""
        raise NotImplementedError

    def wait(self, stream: Any, event: Any) -> None:
        """Later work on ``stream`` waits for ``event``."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until every stream is drained."""

    def close(self) -> None:
        """Release worker threads (a closed backend takes no more work)."""

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Gate:
    """The device: ``slots`` places granted to the waiting stream with the lowest
    (priority, arrival); non-preemptive. ``slots=None``: no gate."""

    def __init__(self, slots: Optional[int]):
        self.slots = slots
        self._cond = threading.Condition()
        self._waiting: list[tuple[int, int]] = []
        self._seq = itertools.count()

    def reserve(self, priority: int) -> Optional[tuple[int, int]]:
        """Queue for a place now (the ticket to pass to :meth:`acquire` later): a stream whose
        next piece became runnable takes its turn before lower-priority work that asks after."""
        if self.slots is None:
            return None
        with self._cond:
            ticket = (priority, next(self._seq))
            heapq.heappush(self._waiting, ticket)
            return ticket

    def try_acquire(self) -> bool:
        """Take a place now if one is free and no stream waits for one (nothing more urgent
        is passed over); whether it did. Never blocks."""
        if self.slots is None:
            return True
        with self._cond:
            if self.slots <= 0 or self._waiting:
                return False
            self.slots -= 1
            return True

    def acquire(self, priority: int, ticket: Optional[tuple[int, int]] = None) -> None:
        if self.slots is None:
            return
        if ticket is None:
            ticket = self.reserve(priority)
        with self._cond:
            while not (self.slots > 0 and self._waiting[0] == ticket):
                self._cond.wait()
            heapq.heappop(self._waiting)
            self.slots -= 1
            self._cond.notify_all()

    def release(self) -> None:
        if self.slots is None:
            return
        with self._cond:
            self.slots += 1
            self._cond.notify_all()


class Event:
    """A marker recorded on a stream; done when the stream reaches it. ``time_us`` is then the
    backend time it completed."""

    def __init__(self) -> None:
        self._done = Flag()
        self.time_us = 0.0
        self._waiters: list["CpuStream"] = []
        self._lock = threading.Lock()

    def _set(self, time_us: float) -> None:
        """Complete the event; each stream blocked on it queues at once for the device (if
        its next piece uses it), before its worker thread has even woken."""
        with self._lock:
            self.time_us = time_us
            self._done.set()
            waiters, self._waiters = self._waiters, []
        for stream in waiters:
            stream._claim()

    def _wait_from(self, stream: "CpuStream") -> None:
        """Block ``stream``'s worker until the event completes."""
        with self._lock:
            if not self._done.is_set():
                self._waiters.append(stream)
        self._done.wait()

    def query(self) -> bool:
        """Whether the stream has reached the event."""
        return self._done.is_set()

    def synchronize(self) -> None:
        """Block until the stream reaches the event."""
        self._done.wait()


class CpuStream:
    """A FIFO worker thread (see ``CpuBackend``). ``busy``: an item is running, on the worker
    or inline on a caller's thread (:meth:`CpuBackend.launch`)."""

    def __init__(self, backend: "CpuBackend", priority: int):
        self.backend, self.priority = backend, priority
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self.busy = False
        self._ticket: Optional[tuple[int, int]] = None
        self._thread = threading.Thread(target=self._work, name=f"tidal-stream{priority}",
                                        daemon=True)
        self._thread.start()

    def _claim(self) -> None:
        """The event this stream waits for completed: if its next item is a piece on the
        device, queue for the device now (:meth:`_Gate.reserve`)."""
        with self._cond:
            if self._ticket is None and self._items and self._items[0][0] == "work" and \
                    self._items[0][3]:
                self._ticket = self.backend.gate.reserve(self.priority)

    def _put(self, item: tuple) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("stream is closed (backend.close() was called)")
            self._items.append(item)
            self._cond.notify()

    def _reached(self) -> bool:
        """Whether the stream has run everything enqueued on it (call with ``_cond`` held)."""
        return not self._items and not self.busy and not self._closed

    def record(self, event: Event) -> None:
        """Complete ``event`` when the stream reaches this point: at once when it already has
        (nothing queued or running)."""
        with self._cond:
            if not self._reached():
                self._put(("record", event))
                return
        event._set(self.backend.now_us())

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits for ``event`` (nothing to wait for once it is
        complete)."""
        if not (event.query() and not self._closed):
            self._put(("wait", event))

    def take_inline(self, device: bool = True) -> bool:
        """Take the stream for a piece run on the caller's thread, if it has reached its end
        and (``device``) the device has a place that no stream waits for (the piece then holds
        it); whether it did. :meth:`end_inline` gives the stream back."""
        with self._cond:
            if not self._reached() or (device and not self.backend.gate.try_acquire()):
                return False
            self.busy = True
            return True

    def end_inline(self) -> None:
        """The inline piece ended: what was enqueued meanwhile runs on the worker (woken only
        then: a wake-up per inline piece would cost the idle worker a context switch)."""
        with self._cond:
            self.busy = False
            if self._items or self._closed:
                self._cond.notify()

    def synchronize(self) -> None:
        """Block until everything enqueued so far has run."""
        ev = Event()
        self.record(ev)
        ev.synchronize()

    def _next(self) -> Optional[tuple]:
        """The next item, once nothing runs inline (None: closed and drained)."""
        with self._cond:
            while self.busy or (not self._items and not self._closed):
                self._cond.wait()
            if not self._items:
                return None
            self.busy = True
            return self._items.popleft()

    def _work(self) -> None:
        be = self.backend
        while (item := self._next()) is not None:
            kind, *rest = item
            if kind == "record":
                rest[0]._set(be.now_us())
            elif kind == "wait":
                rest[0]._wait_from(self)
            else:
                fn, args, uses_device, launch = rest
                launch.ready_us = be.now_us()
                if uses_device:
                    with self._cond:
                        ticket, self._ticket = self._ticket, None
                    be.gate.acquire(self.priority, ticket)
                be._execute(launch, fn, args)
                if uses_device:
                    be.gate.release()
            with self._cond:
                self.busy = False
            if kind == "work":
                be._finish(launch)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()


class HostStream:
    """The CPU backend's stream of the calling thread when no stream is current: the host
    itself, where work is done when the call returns (an event recorded on it is complete at
    once)."""

    priority = LOW


class CpuBackend(Backend):
    """The CPU emulation of the GPU runtime (see the module docstring). ``slots``: how many
    pieces occupy the device at once (None: unlimited, no priority dispatch). ``inline``:
    a foreground device piece whose stream is idle runs on the launching thread
    (:meth:`launch`); False: every piece goes through its stream's worker."""

    def __init__(self, slots: Optional[int] = 1, inline: bool = True):
        self.device = torch.device("cpu")
        self.gate = _Gate(slots)
        self.inline = inline
        self._t0 = time.perf_counter()
        self._streams: list[CpuStream] = []
        self._done = threading.Condition()
        self._waiting_any = 0  # threads in wait_any (a launch that ends wakes them)
        self._host = HostStream()
        self._current = threading.local()

    def current_stream(self) -> Any:
        """The stream made current in this thread by :meth:`use`, else the host."""
        return getattr(self._current, "stream", None) or self._host

    @contextlib.contextmanager
    def use(self, stream: CpuStream) -> Iterator[CpuStream]:
        """Make ``stream`` the current stream of this thread (as ``torch.cuda.stream``): work
        the runtime runs meanwhile waits for what was enqueued on it."""
        before = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield stream
        finally:
            self._current.stream = before

    def now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    @property
    def clock_origin_us(self) -> float:
        """The zero of :meth:`now_us` on ``time.perf_counter``'s clock, in µs (the system's
        monotonic clock: the same for every process of the machine, so the traces of ranks
        on one machine can be put on one clock)."""
        return self._t0 * 1e6

    def stream(self, priority: int = LOW) -> CpuStream:
        s = CpuStream(self, int(priority))
        self._streams.append(s)
        return s

    def event(self) -> Event:
        """A new event (record it with ``stream.record(event)``)."""
        return Event()

    def launch(self, stream: CpuStream, fn: Callable, *args: Any, uses_device: bool = True,
               label: str = "", on_caller: bool = False) -> Launch:
        """Enqueue ``fn(*args)`` on ``stream`` (see :class:`Backend`). With ``inline``, a
        piece on the device on a foreground stream (priority ``HIGH`` or more urgent) runs at
        once on the caller's thread when the stream has run everything enqueued on it and the
        device has a place no other stream waits for: the same order, events and times as on
        the worker, without two thread hand-offs. Host work (``uses_device=False``: waiting
        for peers or data) goes to the worker, so the caller can go on meanwhile, unless it
        is ``on_caller`` (:class:`OnCaller`): then, on a stream that has run everything
        enqueued on it, it runs at once on the caller's thread, holding no device place."""
        launch = Launch(label)
        device = uses_device and not on_caller
        if self.inline and (on_caller or (uses_device and stream.priority <= HIGH)) and \
                stream.take_inline(device):
            launch.ready_us = self.now_us()
            try:
                self._execute(launch, fn, args)
            finally:
                if device:
                    self.gate.release()
                stream.end_inline()
            self._finish(launch)
        else:
            stream._put(("work", fn, args, uses_device, launch))
        return launch

    def _execute(self, launch: Launch, fn: Callable, args: tuple) -> None:
        """Run ``fn(*args)`` for ``launch``: its start and end times, result or error (the
        stream goes on after an error: it is reported through the launch)."""
        launch.start_us = self.now_us()
        launch.started = True
        try:
            launch.result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported through the Launch
            launch.error = e
        launch.end_us = self.now_us()

    def _finish(self, launch: Launch) -> None:
        """``launch`` is done: wake whoever waits for it."""
        launch._done.set()
        self._notify()

    def _notify(self) -> None:
        """A launch is done (set before this is called): wake the threads in ``wait_any``;
        none is there (the counter is raised, under the lock, before a waiter checks its
        launches), nothing to do."""
        if self._waiting_any:
            with self._done:
                self._done.notify_all()

    def wait_any(self, launches: Sequence[Launch], timeout_us: Optional[float] = None) -> None:
        deadline = None if timeout_us is None else time.perf_counter() + timeout_us * 1e-6
        with self._done:
            self._waiting_any += 1
            try:
                while not any(l.done() for l in launches):
                    left = None if deadline is None else deadline - time.perf_counter()
                    if left is not None and left <= 0:
                        return
                    self._done.wait(left)
            finally:
                self._waiting_any -= 1

    def record(self, stream: Any, event: Event) -> None:
        """Complete ``event`` when ``stream`` reaches this point (at once on the host)."""
        if isinstance(stream, HostStream):
            event._set(self.now_us())
        else:
            stream.record(event)

    def wait(self, stream: Any, event: Event) -> None:
        """Later work on ``stream`` waits for ``event`` (the host waits now)."""
        if isinstance(stream, HostStream):
            event.synchronize()
        else:
            stream.wait_event(event)

    def capture(self, program: Callable, static_inputs: Sequence[Any], *, pool: Any = None,
                in_place: Sequence[int] = ()) -> Captured:
        """Bind the program as it is now (:func:`direct_calls`: the fastest equivalent route,
        each operator called without its Python wrapper), warm it up once on
        ``static_inputs`` (it must run) and return it for replay."""
        program = direct_calls(program)
        with torch.no_grad():
            program(*static_inputs)
        return Captured(program, static_inputs)

    def synchronize(self) -> None:
        for s in self._streams:
            s.synchronize()

    def close(self) -> None:
        for s in self._streams:
            s.close()
        self._streams.clear()


class _LogicalStream:
    def __init__(self, priority: int):
        self.priority = priority
        self.pending: collections.deque = collections.deque()
        self.running: Optional[tuple[Launch, bool]] = None


class LogicalBackend(Backend):
    """Streams on a logical clock, for deterministic scheduler tests and what-if runs.

    The host side of a launch runs at once (errors and results are real); its device duration
    is ``duration_us(label, collocated)``, where ``collocated`` tells whether another stream
    had a piece on the device when it started (a scripted slowdown). ``slots=1`` serializes the
    device with priority dispatch; ``slots=None`` runs streams concurrently.
    """

    def __init__(self, duration_us: Callable[[str, bool], float], slots: Optional[int] = None):
        self.device = torch.device("cpu")
        self.duration_us = duration_us
        self.slots = slots
        self._now = 0.0
        self._streams: list[_LogicalStream] = []
        self._arrivals = itertools.count()
        self._ends: list[tuple[float, int, _LogicalStream]] = []

    def now_us(self) -> float:
        return self._now

    def stream(self, priority: int = LOW) -> _LogicalStream:
        s = _LogicalStream(int(priority))
        self._streams.append(s)
        return s

    def launch(self, stream: _LogicalStream, fn: Callable, *args: Any, uses_device: bool = True,
               label: str = "", on_caller: bool = False) -> Launch:
        launch = Launch(label)
        try:
            launch.result = fn(*args)
        except BaseException as e:
            launch.error = e
        if stream.running is None and not stream.pending:
            launch.ready_us = self._now
        stream.pending.append((launch, uses_device, next(self._arrivals)))
        self._start_ready()
        return launch

    def _busy(self) -> int:
        return sum(1 for s in self._streams if s.running is not None and s.running[1])

    def _start_ready(self) -> None:
        while True:
            heads = [s for s in self._streams if s.running is None and s.pending]
            if self.slots is not None:
                free = self.slots - self._busy()
                heads = [s for s in heads if not s.pending[0][1] or free > 0]
            if not heads:
                return
            s = min(heads, key=lambda st: (st.priority, st.pending[0][2]))
            launch, uses_device, _ = s.pending.popleft()
            collocated = uses_device and self._busy() > 0
            launch.start_us = self._now
            launch.started = True
            launch.end_us = self._now + float(self.duration_us(launch.label, collocated))
            s.running = (launch, uses_device)
            heapq.heappush(self._ends, (launch.end_us, next(self._arrivals), s))

    def wait_any(self, launches: Sequence[Launch], timeout_us: Optional[float] = None) -> None:
        limit = None if timeout_us is None else self._now + timeout_us
        while not any(l.done() for l in launches) and self._ends:
            t, _, s = self._ends[0]
            if limit is not None and t > limit:
                self._now = limit
                return
            heapq.heappop(self._ends)
            self._now = max(self._now, t)
            s.running[0]._done.set()
            s.running = None
            if s.pending:  # the stream's next piece became ready now
                s.pending[0][0].ready_us = self._now
            self._start_ready()
        if limit is not None and not any(l.done() for l in launches):
            self._now = max(self._now, limit)

    def synchronize(self) -> None:
        while self._ends:
            self.wait_any([self._ends[0][2].running[0]])


class CudaBackend(Backend):  # pragma: no cover - needs a GPU
    """CUDA streams with priorities, CUDA events, CUDA-graph capture into the pool of the
    captures' owner (see the module docstring). Every time is on one clock: microseconds since
    the reference event recorded (and waited for) when the backend was made."""

    def __init__(self, device: torch.device, warmup: int = 3):
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.warmup = warmup
        with torch.cuda.device(device):
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()
            self._ref.synchronize()  # the host clock starts when the device passed the event
        self._t0 = time.perf_counter()

    def now_us(self) -> float:
        """Microseconds since the reference event (the clock of every launch's times)."""
        return (time.perf_counter() - self._t0) * 1e6

    def stream(self, priority: int = LOW) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device, priority=int(priority))

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def event(self) -> torch.cuda.Event:
        """A timing CUDA event."""
        return torch.cuda.Event(enable_timing=True)

    def memory_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def launch(self, stream, fn, *args, uses_device=True, label="", on_caller=False):
        launch = _CudaLaunch(label, self._ref)
        launch.started = True  # enqueued: the device runs it in stream order
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            launch.start_ev.record(stream)
            try:
                launch.result = fn(*args)
            except BaseException as e:
                launch.error = e
            launch.end_ev.record(stream)
        return launch

    def record(self, stream, event):
        event.record(stream)

    def wait(self, stream, event):
        stream.wait_event(event)

    def wait_any(self, launches, timeout_us=None):
        deadline = None if timeout_us is None else time.perf_counter() + timeout_us * 1e-6
        while not any(l.done() for l in launches):
            if deadline is not None and time.perf_counter() >= deadline:
                return
            time.sleep(20e-6)

    def capture(self, program, static_inputs, *, pool=None, in_place=()):
        keep = frozenset(in_place)
        static = [v if i in keep or not isinstance(v, torch.Tensor) else v.clone()
                  for i, v in enumerate(static_inputs)]
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(self.warmup):
                program(*static)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.no_grad(), torch.cuda.graph(graph, pool=pool if pool is not None
                                                   else self.memory_pool()):
                outputs = program(*static)
        except Exception as e:  # noqa: BLE001 - the caller runs the program uncaptured
            self._end_failed_capture(current)
            raise CaptureError(f"{type(e).__name__}: {_first_line(e)}") from e
        return _CudaCaptured(program, static, graph, outputs)

    def _end_failed_capture(self, stream: "torch.cuda.Stream") -> None:
        """Undo what a capture that raised leaves behind: ``torch.cuda.graph`` keeps its
        capture stream current and the CUDA generators in capture mode (every later random
        op then fails: 'Offset increment outside graph capture'). ``stream`` becomes current
        again and one empty capture ends the generators' capture mode."""
        torch.cuda.set_stream(stream)
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                torch.empty(1, device=self.device).zero_()
            del graph

    def synchronize(self):
        torch.cuda.synchronize(self.device)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


class _CudaLaunch(Launch):  # pragma: no cover - needs a GPU
    __slots__ = ("start_ev", "end_ev", "ref")

    def __init__(self, label, ref):
        super().__init__(label)
        self.ref = ref
        self.start_ev = torch.cuda.Event(enable_timing=True)
        self.end_ev = torch.cuda.Event(enable_timing=True)

    def done(self):
        if not self._done.is_set() and self.end_ev.query():
            self.ready_us = self.start_us = self.ref.elapsed_time(self.start_ev) * 1e3
            self.end_us = self.ref.elapsed_time(self.end_ev) * 1e3
            self._done.set()
        return self._done.is_set()

    def wait(self):
        self.end_ev.synchronize()
        self.done()
        return super().wait()


def direct_calls(program: Callable) -> Callable:
    """``program`` (a Python function) bound as a capture freezes it: the globals its code
    reads (nested code included) taken now, and each ``torch`` operator overload among them
    (``torch.ops.aten.mm.default``, what a lowered segment calls) replaced by the C++ entry
    point its ``__call__`` forwards to: the same kernels in the same order, one Python frame
    less per op. A function that calls no operator overload through a global, and anything
    but a plain function, is returned as it is.

    Example:
        >>> add = torch.ops.aten.add.Tensor
        >>> def double(x):
        ...     return add(x, x)
        >>> fast = direct_calls(double)
        >>> fast(torch.ones(2)).tolist(), fast is double, direct_calls(print) is print
        ([2.0, 2.0], False, True)
    """
    if not isinstance(program, types.FunctionType):
        return program
    env = program.__globals__
    names = [n for n in _global_names(program.__code__) if n in env]
    if not any(type(env[n]) is torch._ops.OpOverload for n in names):
        return program
    bound = {"__builtins__": env.get("__builtins__", builtins)}
    for n in names:
        value = env[n]
        bound[n] = value._op if type(value) is torch._ops.OpOverload else value
    fn = types.FunctionType(program.__code__, bound, program.__name__, program.__defaults__,
                            program.__closure__)
    fn.__kwdefaults__ = program.__kwdefaults__
    fn.__dict__.update(program.__dict__)
    return fn


def _global_names(code: types.CodeType) -> set[str]:
    """The names ``code`` and the code nested in it may read as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def used_here(*tensors: Any) -> None:
    """The CUDA tensors among ``tensors`` are used by the stream current in this thread (a
    piece reading what another stream made): ``Tensor.record_stream`` on it, so the caching
    allocator does not hand their memory to the stream that made them before this use has
    run. Nothing to do for CPU tensors (and other values).

    Example:
        >>> used_here(torch.ones(2), "not a tensor")
    """
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:  # pragma: no cover - needs a GPU
            t.record_stream(torch.cuda.current_stream(t.device))


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is ``b`` or views the same memory the same way (a replay reads it in
    place, no copy needed)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride() and a.dtype == b.dtype
                      and a.device == b.device)


class _CudaCaptured(Captured):  # pragma: no cover - needs a GPU
    def __init__(self, program, static, graph, outputs):
        super().__init__(program, static)
        self.static, self.graph, self.outputs = static, graph, outputs

    def replay(self, *inputs):
        for buf, x in zip(self.static, inputs):
            if isinstance(buf, torch.Tensor) and not same_storage(buf, x):
                buf.copy_(x)
        self.graph.replay()
        return self.outputs


def backend_for(device: Any = "cpu", **options: Any) -> Backend:
    """The backend for ``device``: ``CudaBackend`` for a CUDA device, else ``CpuBackend``
    (``options`` go to its constructor)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"backend_for({device!r}): CUDA is not available on this machine")
        return CudaBackend(dev, **options)
    if dev.type != "cpu":
        raise ValueError(f"backend_for({device!r}): no runtime backend for device type "
                         f"{dev.type!r} (cpu and cuda are supported)")
    return CpuBackend(**options)

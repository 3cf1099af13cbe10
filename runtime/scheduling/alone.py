"""Dispatch of one program that runs alone on its backend: every piece in program order, on
its stream, straight onto the backend (``launch``, ``wait`` on the events of the pieces it
needs from other streams, ``record`` where another stream needs it), with none of the
scheduler's queues, pacing or feedback: with no other job there is nothing to pace it against.
``Runtime`` stays the way to run programs beside other jobs.

What it keeps from ``Runtime``: the streams of a foreground job (:class:`StreamPool`: compute
streams high priority, communication and loads low), the wait for what the caller enqueued on
its current stream before the first piece of each stream, the hold of a host piece on a device
stream until that stream's pieces ran (``inline_host``: a backend that runs a piece's host side
inside ``launch``), and stopping after a failing piece: pieces not yet begun are skipped (so no
dependent of it runs) and nothing more is launched. A :class:`Route` is what a program's
pieces fix about dispatch (streams, cross-stream waits, events); a caller keeps it per program.

Example:
    >>> from tidal.ir.program import COMM, COMPUTE, Piece
    >>> from tidal.runtime.backend import CpuBackend
    >>> pieces = (Piece("f", COMPUTE), Piece("ar", COMM, (0,)), Piece("opt", COMPUTE, (1,)))
    >>> r = route(pieces)
    >>> r.waits, r.marks
    (((), (0,), (1,)), (True, True, False))
    >>> with CpuBackend(slots=None) as be:
    ...     launches = dispatch_alone(be, StreamPool(be, True), pieces,
    ...                               [lambda: 1, lambda: 2, lambda: 3], r)
    >>> [l.result for l in launches]
    [1, 2, 3]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from tidal.ir.program import Piece
from tidal.runtime.backend import Backend, Launch, OnCaller
from tidal.runtime.scheduling.pieces import stream_kind, uses_device
from tidal.runtime.scheduling.streams import StreamPool


@dataclass(frozen=True)
class Route:
    """What a program's pieces fix about their dispatch, per piece: its stream (``keys``:
    stream name and whether it occupies the device, as :class:`StreamPool` tells streams
    apart), the pieces on other streams it waits for (``waits``), whether a piece on another
    stream waits for it (``marks``: an event is recorded after it), whether it is host work
    on a device stream (``host_on_device``: held back on an ``inline_host`` backend) and its
    launch ``labels``."""

    keys: tuple[tuple[str, bool], ...]
    waits: tuple[tuple[int, ...], ...]
    marks: tuple[bool, ...]
    host_on_device: tuple[bool, ...]
    labels: tuple[str, ...]


def route(pieces: Sequence[Piece], job: str = "program") -> Route:
    """The :class:`Route` of ``pieces`` (a program's, in order) for the job named ``job``.

    Example:
        >>> from tidal.ir.program import COMPUTE, HOST, Piece
        >>> r = route((Piece("f", COMPUTE), Piece("wait", COMPUTE, (0,), kind=HOST)))
        >>> r.keys, r.waits, r.host_on_device
        ((('compute', True), ('compute', False)), ((), (0,)), (False, True))
    """
    keys = tuple((p.stream, uses_device(p)) for p in pieces)
    waits = tuple(tuple(d for d in p.deps if keys[d] != keys[i]) for i, p in enumerate(pieces))
    waited = {d for w in waits for d in w}
    return Route(keys, waits, tuple(i in waited for i in range(len(pieces))),
                 tuple(not device and stream_kind(name)[1] for name, device in keys),
                 tuple(f"{job}/{p.name}" for p in pieces))


def _guarded(fn: Callable[[], Any], failed: list) -> Callable[[], Any]:
    """``fn`` skipped once a piece has failed (``failed`` not empty); a failure of its own is
    added to ``failed``."""
    def run() -> Any:
        if failed:
            return None
        try:
            return fn()
        except BaseException:
            failed.append(True)
            raise
    return run


def _wait_done(backend: Backend, launch: Launch) -> None:
    while not launch.done():
        backend.wait_any([launch])


def dispatch_alone(backend: Backend, streams: StreamPool, pieces: Sequence[Piece],
                   fns: Sequence[Callable[[], Any]], plan: Route,
                   inline_host: bool = False) -> list[Launch]:
    """Launch ``fns[i]`` (what piece ``i`` of ``pieces`` runs) in program order as the
    foreground job's pieces on ``streams`` (see the module docstring; ``plan`` is
    ``route(pieces)``); return the launches, in order, once all have ended (fewer than the
    pieces when one failed: dispatch stops there). A backend without events runs each piece
    once the pieces it waits for ended. A piece whose entry of ``fns`` is an
    :class:`~tidal.runtime.backend.OnCaller` is launched with ``on_caller=True``."""
    events = callable(getattr(backend, "event", None))
    origin = _origin(backend) if events else None
    failed: list = []
    launches: list[Launch] = []
    marks: dict[int, Any] = {}
    used: dict[tuple[str, bool], Any] = {}
    for i, fn in enumerate(fns):
        if failed:
            break
        stream = used.get(plan.keys[i])
        if stream is None:
            stream = used[plan.keys[i]] = streams.stream(True, *plan.keys[i])
            if origin is not None:
                backend.wait(stream, origin)
        for d in plan.waits[i]:
            if not events:
                _wait_done(backend, launches[d])
            elif marks[d] is not None:
                backend.wait(stream, marks[d])
        if inline_host and plan.host_on_device[i]:
            _hold(backend, plan, launches, i)
        extra = {"on_caller": True} if isinstance(fn, OnCaller) else {}
        launch = backend.launch(stream, _guarded(fn, failed), uses_device=plan.keys[i][1],
                                label=plan.labels[i], **extra)
        launches.append(launch)
        if events and plan.marks[i]:
            # a launch done already (run inline) left its stream at its end: nothing to wait
            marks[i] = None if launch.done() else backend.event()
            if marks[i] is not None:
                backend.record(stream, marks[i])
    for launch in _last_per_stream(plan, launches):
        _wait_done(backend, launch)
    for launch in launches:
        launch.done()  # a CUDA launch reads its times here
    return launches


def _origin(backend: Backend) -> Optional[Any]:
    """The event of what the caller enqueued on its current stream (the program's inputs),
    None when the stream has already reached it."""
    origin = backend.event()
    backend.record(backend.current_stream(), origin)
    return None if origin.query() else origin


def _hold(backend: Backend, plan: Route, launches: Sequence[Launch], index: int) -> None:
    """Wait until the pieces before ``index`` on its stream name have ended (a host piece on a
    device stream runs, as a stream would run it, after them)."""
    name = plan.keys[index][0]
    for k, launch in enumerate(launches):
        if plan.keys[k][0] == name:
            _wait_done(backend, launch)


def _last_per_stream(plan: Route, launches: Sequence[Launch]) -> list[Launch]:
    """The last launch on each stream (a stream runs its launches in order)."""
    last: dict[tuple[str, bool], Launch] = {}
    for key, launch in zip(plan.keys, launches):
        last[key] = launch
    return list(last.values())

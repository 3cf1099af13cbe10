"""The runtime on a backend with CUDA's semantics: ``launch`` runs a piece's host side at once on
the dispatcher's thread and its device work completes later, in stream order (CUDA's
asynchronous streams; the CPU backend runs both on a stream worker instead). A foreground that
waits on the host after its compute (a server waiting for requests) must leave that idle span
to the background, and a background iteration's host piece (its loss) must not be held by the
slowdown feedback meant for device pieces."""
import time

import pytest

from tidal.runtime.backend import LOW, Backend, CudaBackend, Launch, LogicalBackend
from tidal.ir.program import COMPUTE, HOST, Piece
from tidal.runtime.program import COMM, ProgramJob
from tidal.runtime.scheduler import BoundPiece, FunctionJob, Runtime


def _bound(name, fn=lambda: None, **kind):
    """A piece of ``name`` on the compute stream running ``fn``."""
    return BoundPiece(Piece(name, COMPUTE, **kind), fn)


class _Event:
    def __init__(self, backend):
        self.backend, self.time_us = backend, None

    def query(self):
        return self.time_us is not None and self.backend.now_us() >= self.time_us


class _Stream:
    def __init__(self, priority):
        self.priority, self.tail_us = priority, 0.0


class _AsyncLaunch(Launch):
    """Done once the wall clock passes its device end (as a CUDA event's ``query``)."""

    __slots__ = ("backend",)

    def done(self):
        if not self._done.is_set() and self.backend.now_us() >= self.end_us:
            self._done.set()
        return self._done.is_set()


class AsyncBackend(Backend):
    """CUDA's semantics on the wall clock: the host side runs inside ``launch``; device work of
    ``device_us[label]`` runs on one device in launch order, each stream in FIFO order."""

    def __init__(self, device_us):
        self.device_us = device_us
        self._t0 = time.perf_counter()
        self._device_free_us = 0.0
        self._default = _Stream(LOW)

    def now_us(self):
        return (time.perf_counter() - self._t0) * 1e6

    def stream(self, priority=LOW):
        return _Stream(priority)

    def current_stream(self):
        return self._default

    def event(self):
        return _Event(self)

    def record(self, stream, event):
        event.time_us = max(stream.tail_us, self.now_us())

    def wait(self, stream, event):
        stream.tail_us = max(stream.tail_us, event.time_us or 0.0)

    def launch(self, stream, fn, *args, uses_device=True, label=""):
        launch = _AsyncLaunch(label)
        launch.backend, launch.started = self, True
        launch.ready_us = launch.start_us = max(stream.tail_us, self.now_us())
        try:
            launch.result = fn(*args)
        except BaseException as e:
            launch.error = e
        if uses_device:  # enqueued: runs once the stream and the device are free
            start = max(launch.start_us, self._device_free_us)
            launch.end_us = self._device_free_us = start + self.device_us[label]
        else:  # host work: it ended when fn returned
            launch.end_us = max(launch.start_us, self.now_us())
        stream.tail_us = launch.end_us
        return launch

    def wait_any(self, launches, timeout_us=None):
        deadline = None if timeout_us is None else self.now_us() + timeout_us
        while not any(l.done() for l in launches):
            if deadline is not None and self.now_us() >= deadline:
                return
            time.sleep(20e-6)


_DEVICE_US = {"fg/compute": 300.0, "bg/forward": 150.0, "bg/backward": 250.0}
_WAIT_S = 1.5e-3


def _foreground(iterations):
    """Compute, then a host-side wait as long as a few background pieces (the idle span)."""
    return FunctionJob("fg", lambda i: [
        _bound("compute"), _bound("wait", lambda: time.sleep(_WAIT_S), kind=HOST)], iterations)


def _training():
    """A background training job as ``Compiled.job`` makes one: forward and backward on the
    job's stream, the loss as a host piece on the comm stream after both."""
    return ProgramJob("bg", lambda i: ([_bound("forward"), _bound("backward")], lambda: 0.0),
                      gated=False)


@pytest.mark.parametrize("priorities", [True, False])
def test_background_trains_in_the_idle_spans_of_a_foreground_that_waits_on_the_host(priorities):
    rt = Runtime(backend=AsyncBackend(_DEVICE_US), priorities=priorities, inline_host=True)
    rt.submit(_foreground(40), priority="high")
    rt.submit(_training(), priority="low")
    stats = rt.run()
    assert stats["fg"].iterations == 40 and stats["fg"].error is None
    assert stats["bg"].error is None and stats["bg"].iterations >= 10, rt.summary()
    # the host wait ran in stream order: after its iteration's compute had ended
    ends = {(r.iteration, r.piece): r for r in rt.trace if r.job == "fg"}
    assert all(ends[i, "wait"].start_us >= ends[i, "compute"].end_us for i in range(40))


def test_a_cuda_backend_runs_host_pieces_inline():
    assert Runtime(backend=CudaBackend.__new__(CudaBackend)).inline_host
    assert not Runtime(backend=LogicalBackend(lambda label, collocated: 1.0)).inline_host


def test_feedback_holds_background_device_pieces_but_not_its_host_pieces():
    """The foreground's compute is sensitive from the start and never leaves a span the
    background's device pieces fit in: only the first (no estimate yet) runs, and the
    iteration still ends (its loss is a host piece)."""
    be = LogicalBackend(lambda label, collocated: {"fg/c": 100.0}.get(label, 40.0))
    rt = Runtime(backend=be, sensitive_kinds=("compute",))
    rt.submit(FunctionJob("fg", lambda i: [_bound("c")], 20), priority="high")
    bg = rt.submit(ProgramJob("bg", lambda i: ([_bound("step")], lambda: 0.0), gated=False),
                   priority="low")
    stats = rt.run()
    assert stats["bg"].iterations == 1 and len(bg.job.losses) == 1, rt.summary()
    assert [r.piece for r in rt.trace if r.job == "bg"] == ["step", "loss"]
    assert all(r.stream == COMM for r in rt.trace if r.piece == "loss")

"""Task switching fails cleanly, never by hanging (the ``task_switch`` GPU check once timed out
having printed nothing): a worker stage that raises ends the controller's wait at once, naming
the worker, the job and the stage; a message whose memory cannot be moved into shared memory
fails in its sender (it was lost in the queue's feeder thread); a stop-and-start whose new
process dies fails at once, naming it; on a GPU a group's copy runs on its load piece's own
stream (CUDA stand-ins here), so the load piece's device times are the copy's."""
from __future__ import annotations

import contextlib
import dataclasses
import queue
import time
from dataclasses import dataclass

import pytest
import torch
import torch.multiprocessing as tmp

from benchmarks.switching import stop_and_start
from test_switching import _infer_job, _shipped
from tidal.runtime.switching import HostModel, SwitchingError, Switcher
from tidal.runtime.switching.messages import send
from tidal.runtime.switching.task import Transmission

PROMPT_S = 30.0
"""Well under the switcher's 60 s timeout: the error came from the worker, not the timeout."""


@dataclass(frozen=True)
class _BrokenFrom:
    """``batches`` that give ``batch`` before iteration ``first`` and raise from it on (it
    pickles by reference: spawned workers import this module)."""

    batch: torch.Tensor
    first: int

    def __call__(self, i: int) -> torch.Tensor:
        if i >= self.first:
            raise RuntimeError(f"batch {i} is broken")
        return self.batch


def _broken_job(name: str, first: int):
    job, _, x = _infer_job()
    return dataclasses.replace(job, name=name, batches=_BrokenFrom(x, first))


def test_a_worker_that_raises_in_an_iteration_fails_the_wait_at_once_by_job_and_stage():
    """Iteration 1 of job 'boom' raises in its worker: ``wait`` raises at once naming the job
    and the iteration, the job's arena lease is back, and the switcher runs on."""
    with Switcher([_broken_job("boom", 1), _infer_job()[0]], standby=1, threads=1,
                  timeout_s=60) as sw:
        first = sw.switch("boom", iterations=3)
        assert first.first.result.iteration == 0
        t0 = time.perf_counter()
        with pytest.raises(SwitchingError, match=r"(?s)job 'boom'.* failed in iteration 1:.*"
                                                 r"RuntimeError: batch 1 is broken"):
            sw.wait()
        assert time.perf_counter() - t0 < PROMPT_S
        assert sw.active is None and sw.arena.holder("boom") is None
        assert sw.switch("infer", iterations=1).first.result.iteration == 0


def test_a_worker_that_raises_at_start_up_fails_the_start_at_once_by_job_and_stage():
    """Warming up job 'boom' (its first batch) raises: ``start`` raises at once naming the
    stage, not after ``start_timeout_s``, and stops every worker it started (``with`` does not
    close a switcher whose start raised)."""
    sw = Switcher([_broken_job("boom", 0)], standby=1, threads=1, start_timeout_s=120)
    started = sw.workers  # the list start() fills (close() puts an empty one in its place)
    t0 = time.perf_counter()
    with pytest.raises(SwitchingError, match=r"(?s)failed in warm-up of job 'boom':.*"
                                             r"RuntimeError: batch 0 is broken"):
        sw.start()
    assert time.perf_counter() - t0 < PROMPT_S
    assert len(started) == 2 and not any(w.proc.is_alive() for w in started)
    assert sw.workers == []


@pytest.fixture
def shm_full(monkeypatch):
    """Moving host memory into shared memory fails (a full ``/dev/shm``)."""
    def refuse(self, *args):
        raise OSError(28, "No space left on device")
    for method in ("_share_fd_cpu_", "_share_filename_cpu_"):
        monkeypatch.setattr(torch.UntypedStorage, method, refuse)


def _lost_or_raised(msg: tuple) -> str:
    """Send ``msg`` on a process queue: the error ``send`` raised, else what arrived."""
    q = tmp.get_context("spawn").Queue()
    try:
        send(q, msg, "worker 2 (job 'b')")
    except SwitchingError as e:
        return str(e)
    try:
        return f"arrived: {q.get(timeout=5)[0]}"
    except queue.Empty:
        return "lost in the queue's feeder thread"


def test_a_message_whose_memory_cannot_be_shared_fails_in_its_sender(shm_full):
    """The queue's feeder thread would fail to share the output's memory and drop the message
    (the controller then waits for its timeout); ``send`` fails instead, naming it."""
    why = _lost_or_raised(("output", 2, "b", torch.ones(256)))
    assert why.startswith("worker 2 (job 'b'): message 'output' cannot cross processes: its "
                          "memory (1024 bytes) cannot be moved into shared memory: OSError")


def test_a_message_with_a_tensor_that_needs_its_graph_fails_in_its_sender():
    """torch refuses to send a non-leaf tensor that requires grad, in the feeder thread."""
    out = torch.ones(3, requires_grad=True) * 2
    assert _lost_or_raised(("output", 2, "b", out)).startswith(
        "worker 2 (job 'b'): message 'output' cannot cross processes: it holds a tensor of "
        "shape (3,) that requires grad and is not a leaf")


def test_a_message_that_crosses_arrives_with_its_memory_shared():
    out = torch.ones(3)
    assert _lost_or_raised(("output", 2, "b", out)) == "arrived: output"
    assert out.is_shared()


def test_a_stop_and_start_whose_new_process_dies_fails_at_once_naming_it():
    """The new process of a stop-and-start dies (here: a device it cannot parse): the wait for
    its output ends at once, naming it and its exit code (it waited 300 s)."""
    job, _, _ = _infer_job()
    t0 = time.perf_counter()
    with pytest.raises(SwitchingError, match=r"job 'infer''s new process to give its output: "
                                             r"process \d+ ended \(exit code 1\) first"):
        stop_and_start(tmp.get_context("spawn"), job, HostModel.of(job.graph), "no-such-device",
                       timeout_s=120)
    assert time.perf_counter() - t0 < 60


class _Stream:
    def __init__(self, name: str):
        self.name, self.waits = name, []

    def wait_event(self, event) -> None:
        self.waits.append(event)

    def wait_stream(self, other) -> None:
        pass


class _Event:
    def __init__(self):
        self.stream = None

    def record(self, stream) -> None:
        self.stream = stream


class _Cuda:
    """CUDA stand-ins: the current stream (the load piece's, then the compute piece's), a
    ``torch.cuda.stream`` context that makes another current, what each copy and
    ``record_stream`` ran on."""

    def __init__(self, monkeypatch):
        self.current = _Stream("load")
        self.copies, self.recorded = [], []
        cuda = self

        @contextlib.contextmanager
        def stream(s):
            before, cuda.current = cuda.current, s
            try:
                yield s
            finally:
                cuda.current = before

        transmit = HostModel.transmit

        def spy(host, k, gm, dst, non_blocking=False):
            cuda.copies.append((k, cuda.current.name, non_blocking))
            transmit(host, k, gm, dst)

        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cuda.current)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0:
                            _Stream("side"))
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "Event", _Event)
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, s: cuda.recorded.append(s.name))
        monkeypatch.setattr(HostModel, "transmit", spy)


def test_on_a_gpu_a_groups_copy_runs_on_its_load_pieces_stream(monkeypatch):
    """The copy of group k is queued, asynchronously, on the stream its ``load group k`` piece
    runs on, and its event is recorded there: the piece's device times (the switch's
    ``transfer`` figures) cover the copy. On a side stream they measured nothing."""
    cuda = _Cuda(monkeypatch)
    job, _, _ = _infer_job()
    host, gm = HostModel.of(job.graph), _shipped(job).graph
    loads = Transmission(host, gm, [torch.empty(host.group_nbytes(k), dtype=torch.uint8)
                                    for k in range(host.num_groups)], "cuda")
    for k in range(host.num_groups):
        loads.load(k)
    assert cuda.copies == [(k, "load", True) for k in range(host.num_groups)]
    assert all(e.stream.name == "load" for e in loads.events)
    assert cuda.recorded == ["load"] * host.num_groups
    cuda.current = _Stream("compute")
    loads.ready(0)
    assert cuda.current.waits == [loads.events[0]] and cuda.recorded[-1] == "compute"


"""Runtime backends: stream FIFO order, priority dispatch on the device gate, events, errors,
capture/replay; the CPU backend's inline launches and direct operator calls; the logical-clock
backend; CUDA (skipped without a GPU)."""
import threading

import pytest
import torch

from tidal.runtime.backend import (HIGH, LOW, CpuBackend, Flag, LogicalBackend, backend_for,
                                   direct_calls)


def _wait_until(pred):
    ev = threading.Event()
    while not pred():
        ev.wait(0.001)


def test_cpu_stream_is_fifo_and_returns_results():
    with CpuBackend() as be:
        s, seen = be.stream(), []
        launches = [be.launch(s, lambda i=i: seen.append(i) or i * i) for i in range(20)]
        assert [l.wait() for l in launches] == [i * i for i in range(20)]
        assert seen == list(range(20))
        assert all(l.ready_us <= l.start_us <= l.end_us for l in launches)


def test_gate_dispatches_the_high_priority_stream_first():
    with CpuBackend(slots=1) as be:
        hold, started, order = threading.Event(), threading.Event(), []
        blocker = be.launch(be.stream(LOW), lambda: started.set() or hold.wait())
        started.wait()  # the blocker holds the device
        low = be.launch(be.stream(LOW), lambda: order.append("low"))
        high = be.launch(be.stream(HIGH), lambda: order.append("high"))
        _wait_until(lambda: len(be.gate._waiting) == 2)  # both wait behind the blocker
        hold.set()
        low.wait(), high.wait(), blocker.wait()
        assert order == ["high", "low"]
        assert high.start_us > high.ready_us  # it was blocked (non-preemptive device)


def test_ungated_streams_run_concurrently():
    with CpuBackend(slots=None) as be:
        ev = threading.Event()
        a = be.launch(be.stream(), lambda: ev.wait(30))  # finishes only if b runs meanwhile
        be.launch(be.stream(), ev.set).wait()
        assert a.wait() is True


def test_events_order_work_across_streams_and_errors_do_not_stop_a_stream():
    with CpuBackend(slots=None) as be:
        s1, s2, seen = be.stream(), be.stream(), []
        hold = threading.Event()
        be.launch(s1, hold.wait)
        be.launch(s1, lambda: seen.append("s1"))
        ev = be.event()
        s1.record(ev)
        s2.wait_event(ev)
        after = be.launch(s2, lambda: seen.append("s2"))
        assert not ev.query()
        hold.set()
        after.wait()
        assert seen == ["s1", "s2"] and ev.query()
        bad = be.launch(s1, lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            bad.wait()
        assert be.launch(s1, lambda: 7).wait() == 7
        be.synchronize()


def test_cpu_capture_replays_the_program_on_static_shapes():
    with CpuBackend() as be:
        calls = []

        def program(x, y):
            calls.append(1)
            return (x @ y + 1,)
        x, y = torch.randn(3, 4), torch.randn(4, 2)
        seg = be.capture(program, (x, y))
        assert seg.signature == (((3, 4), torch.float32), ((4, 2), torch.float32))
        assert len(calls) == 1  # the warm-up run
        x2 = torch.randn(3, 4)
        torch.testing.assert_close(seg.replay(x2, y)[0], x2 @ y + 1, rtol=0, atol=0)


def test_logical_backend_priorities_and_scripted_collocation():
    durations = {"a": 10.0, "b": 5.0, "c": 7.0}
    be = LogicalBackend(lambda name, coll: durations[name] * (3 if coll else 1), slots=1)
    lo, hi = be.stream(LOW), be.stream(HIGH)
    a = be.launch(lo, lambda: "A", label="a")
    b = be.launch(lo, lambda: "B", label="b")
    c = be.launch(hi, lambda: "C", label="c")
    be.synchronize()
    assert (a.start_us, a.end_us) == (0, 10)
    assert (c.ready_us, c.start_us, c.end_us) == (0, 10, 17)  # priority beats b at t=10
    assert (b.start_us, b.end_us) == (17, 22) and b.wait() == "B"
    shared = LogicalBackend(lambda name, coll: durations[name] * (3 if coll else 1))
    x = shared.launch(shared.stream(), lambda: None, label="a")
    y = shared.launch(shared.stream(), lambda: None, label="b")
    shared.synchronize()
    assert (x.end_us, y.end_us) == (10, 15)  # y started while x ran: 3x slower


def test_backend_for_selects_by_device():
    assert isinstance(backend_for("cpu"), CpuBackend)
    with pytest.raises(ValueError, match="meta"):
        backend_for("meta")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            backend_for("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_backend_capture_replay_and_priority_streams():  # pragma: no cover
    be = backend_for("cuda")
    x = torch.randn(8, 8, device="cuda")
    seg = be.capture(lambda t: (torch.relu(t @ t) + 1,), (x,))
    y = torch.randn(8, 8, device="cuda")
    out = be.launch(be.stream(HIGH), seg.replay, y).wait()
    be.synchronize()
    torch.testing.assert_close(out[0], torch.relu(y @ y) + 1)


def test_a_stream_queues_for_the_device_the_moment_its_event_completes():
    # the event a high-priority piece waits for completes while the device is busy: the
    # stream takes its turn at the gate right then (in the thread that completed the event),
    # so low-priority work that asks for the device afterwards, however soon, comes second
    import time

    be = CpuBackend(slots=1)
    try:
        be.gate.acquire(LOW)                     # the device is busy
        hi = be.stream(HIGH)
        ev = be.event()
        be.wait(hi, ev)
        ran = []
        launch = be.launch(hi, lambda: ran.append("high"))
        deadline = time.perf_counter() + 5
        while not ev._waiters and time.perf_counter() < deadline:
            time.sleep(0.001)                    # the worker blocks on the event
        assert ev._waiters, "the stream's worker never waited for the event"
        ev._set(be.now_us())
        assert be.gate._waiting and be.gate._waiting[0][0] == HIGH
        be.gate.release()
        be.gate.acquire(LOW)                     # served after the high-priority piece
        assert ran == ["high"]
        be.gate.release()
        be.wait_any([launch])
        assert launch.done() and launch.error is None
    finally:
        be.close()


def test_a_foreground_device_piece_on_an_idle_stream_runs_inline_in_stream_order():
    with CpuBackend(slots=None) as be:
        hi, caller = be.stream(HIGH), threading.get_ident()
        first = be.launch(hi, threading.get_ident)
        assert first.done() and first.wait() == caller  # ran inside launch, on this thread
        assert first.ready_us <= first.start_us <= first.end_us
        seen = []

        def enqueue_behind():  # runs inline; what it enqueues on its own stream waits for it
            be.launch(hi, lambda: seen.append("second"))
            seen.append("first")
        be.launch(hi, enqueue_behind).wait()
        be.synchronize()
        assert seen == ["first", "second"]
    with CpuBackend(slots=None) as be:
        hi, hold = be.stream(HIGH), threading.Event()
        blocker = be.launch(hi, lambda: hold.wait(30), uses_device=False)  # host work: worker
        assert not blocker.done()
        queued = be.launch(hi, threading.get_ident)  # the stream is busy: queued behind it
        assert not queued.done()
        hold.set()
        assert queued.wait() != threading.get_ident() and blocker.wait() is True


def test_inline_runs_only_where_nothing_is_passed_over():
    with CpuBackend(slots=1) as be:
        hi, lo = be.stream(HIGH), be.stream(LOW)
        assert be.launch(lo, threading.get_ident).wait() != threading.get_ident()  # LOW: worker
        be.gate.acquire(LOW)                          # another stream holds the device
        waiting = be.launch(hi, threading.get_ident)  # not inline: it queues for the gate
        assert not waiting.done()
        be.gate.release()
        assert waiting.wait() != threading.get_ident()
    with CpuBackend(slots=None, inline=False) as be:
        assert be.launch(be.stream(HIGH), threading.get_ident).wait() != threading.get_ident()


def test_on_caller_host_work_runs_on_the_caller_thread_once_its_stream_is_idle():
    """A comm piece that only issues an async collective (``OnCaller``) was handed to the comm
    stream's worker: a thread hand-off per bucket, and the compute stream then queued behind
    the event, so every later piece of the step ran on workers too."""
    from tidal.ir.program import COMM, COMPUTE, Piece
    from tidal.runtime.backend import OnCaller
    from tidal.runtime.scheduling.alone import dispatch_alone, route
    from tidal.runtime.scheduling.streams import StreamPool

    caller = threading.get_ident()
    with CpuBackend(slots=1) as be:
        lo = be.stream(LOW)
        ran = be.launch(lo, threading.get_ident, uses_device=False, on_caller=True)
        assert ran.done() and ran.wait() == caller and be.gate.slots == 1  # no device place
        hold = threading.Event()
        be.launch(lo, lambda: hold.wait(30), uses_device=False)   # the stream is busy now
        queued = be.launch(lo, threading.get_ident, uses_device=False, on_caller=True)
        assert not queued.done()          # behind what the stream holds: stream order kept
        hold.set()
        assert queued.wait() != caller
        pieces = (Piece("broadcast", COMM), Piece("segment", COMPUTE, (0,)),
                  Piece("sync", COMM, (1,)), Piece("optimizer", COMPUTE, (2,)))
        fns = [OnCaller(threading.get_ident), threading.get_ident,
               OnCaller(threading.get_ident), threading.get_ident]
        launches = dispatch_alone(be, StreamPool(be, True), pieces, fns, route(pieces))
        assert [l.result for l in launches] == [caller] * 4
        plain = dispatch_alone(be, StreamPool(be, True), pieces,
                               [threading.get_ident] * 4, route(pieces))
        assert plain[0].result != caller   # without OnCaller: the comm stream's worker


def test_an_inline_piece_does_not_wake_its_idle_stream_worker():
    """Each inline piece used to notify its stream's worker when it ended: an idle worker woke
    for nothing (a context switch per piece, two ranks' worth on two cores)."""
    with CpuBackend(slots=None) as be:
        hi = be.stream(HIGH)
        notified = []
        notify = hi._cond.notify
        hi._cond.notify = lambda n=1: (notified.append(n), notify(n))
        for _ in range(5):
            assert be.launch(hi, threading.get_ident).wait() == threading.get_ident()
        assert notified == []
        hold = threading.Event()
        be.launch(hi, lambda: hold.wait(30), uses_device=False)   # queued work: woken
        hold.set()
        be.synchronize()
        assert notified


def test_an_inline_error_is_reported_through_its_launch():
    with CpuBackend(slots=1) as be:
        s = be.stream(HIGH)
        bad = be.launch(s, lambda: 1 / 0)
        assert bad.done() and isinstance(bad.error, ZeroDivisionError)
        with pytest.raises(ZeroDivisionError):
            bad.wait()
        assert be.gate.slots == 1 and be.launch(s, lambda: 7).wait() == 7  # device released


def test_events_on_idle_streams_complete_at_once_and_done_events_cost_no_wait():
    with CpuBackend(slots=None) as be:
        s, ev = be.stream(HIGH), be.event()
        be.record(s, ev)
        assert ev.query()                        # the stream had already reached it
        be.wait(s, ev)
        assert not s._items                      # nothing to wait for
        hold, later = threading.Event(), be.event()
        be.launch(s, hold.wait, uses_device=False)
        be.record(s, later)
        assert not later.query()                 # recorded behind running work
        hold.set()
        later.synchronize()
        assert later.time_us >= ev.time_us


def test_flag_is_a_cheap_one_shot_event():
    flag = Flag()
    assert not flag.is_set() and flag.wait(timeout=0.001) is False
    threading.Timer(0.01, flag.set).start()
    assert flag.wait(timeout=30) is True and flag.is_set()
    flag.set()                                   # a second set does nothing
    assert flag.wait() is True


def test_cpu_capture_replays_operators_through_their_direct_entry_points():
    mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor
    scope = {"mm": mm, "add": add}
    exec("def seg(x, w):\n    y = mm(x, w)\n    return (add(y, y), [add(v, v) for v in (y,)][0])\n",
         scope)
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    fast = direct_calls(scope["seg"])
    assert fast is not scope["seg"] and fast.__globals__["mm"] is mm._op
    assert fast.__globals__["add"] is add._op    # read inside a comprehension too
    for a, b in zip(fast(x, w), scope["seg"](x, w)):
        assert torch.equal(a, b)
    plain = lambda t: (t * 2,)  # noqa: E731 - calls no operator overload: left as it is
    assert direct_calls(plain) is plain and direct_calls(print) is print
    with CpuBackend() as be:
        seg = be.capture(scope["seg"], (x, w))
        assert seg.program.__globals__["mm"] is mm._op
        assert torch.equal(seg.replay(x, w)[0], 2 * (x @ w))

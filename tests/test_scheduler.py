"""Multi-job runtime: pacing bounds, the slowdown feedback loop under a scripted slowdown,
failure isolation, AntMan limits, lowered jobs, trace export. Durations are scripted on the
logical-clock backend (no wall-clock timing); the threaded CPU backend is used only for
properties that do not depend on timing."""
import json
import threading

import pytest
import torch

import tidal
from examples.models import ZOO
from tidal.runtime.backend import CpuBackend, LogicalBackend
from tidal.runtime.lower import lower
from tidal.ir.program import COLLECTIVE, COMM, COMPUTE, HOST, POINT_TO_POINT, Piece
from tidal.runtime.scheduler import BoundPiece, FunctionJob, Runtime, lowered_job, step_job
from tidal.runtime.trace_export import chrome_trace, summary_table, write_chrome_trace

_TIMES = {"fg/c0": 100.0, "fg/ar": 50.0, "fg/c1": 100.0, "bg/b": 37.0}


def _scripted(label, collocated):
    """All-reduce is 3x slower when background work shares the device (the injected slowdown)."""
    return _TIMES[label] * (3 if collocated and label == "fg/ar" else 1)


def _bound(name, stream=COMPUTE, deps=(), fn=lambda: None, **kind):
    """A piece of ``name`` on ``stream`` running ``fn``."""
    return BoundPiece(Piece(name, stream, deps, **kind), fn)


def _jobs(rt, iterations=8):
    # the all-reduce runs on the compute stream (as NCCL's on a GPU): it occupies the device
    rt.submit(FunctionJob("fg", lambda i: [_bound(n, kind=COLLECTIVE if n == "ar" else "segment")
                                           for n in ("c0", "ar", "c1")],
                          iterations), priority="high")
    rt.submit(FunctionJob("bg", lambda i: [_bound("b")]), priority="low")


def _max_outstanding(trace, job):
    events = sorted([(r.dispatch_us, 1) for r in trace if r.job == job]
                    + [(r.end_us, -1) for r in trace if r.job == job])
    level = peak = 0
    for _, d in events:  # ends sort before dispatches at the same instant
        level += d
        peak = max(peak, level)
    return peak


@pytest.mark.parametrize("fg_depth,be_depth", [(2, 1), (3, 2), (1, 1)])
def test_pacing_bounds_outstanding_pieces(fg_depth, be_depth):
    rt = Runtime(backend=LogicalBackend(_scripted), fg_depth=fg_depth, be_depth=be_depth,
                 feedback=False)
    _jobs(rt)
    stats = rt.run()
    assert stats["fg"].iterations == 8 and stats["bg"].iterations > 0
    assert _max_outstanding(rt.trace, "fg") == stats["fg"].max_outstanding == fg_depth
    assert _max_outstanding(rt.trace, "bg") == stats["bg"].max_outstanding == be_depth


def test_unbounded_depth_lets_background_queue_up():
    rt = Runtime(backend=LogicalBackend(_scripted), fg_depth=None, be_depth=None,
                 feedback=False, poll_us=10)
    _jobs(rt, iterations=3)
    rt.run()
    assert _max_outstanding(rt.trace, "bg") > 5


def test_feedback_pauses_background_around_a_slowed_operator():
    with_fb = Runtime(backend=LogicalBackend(_scripted))
    _jobs(with_fb)
    stats = with_fb.run()
    assert with_fb.sensitive == {("fg", "ar")}
    ar = [r for r in with_fb.trace if r.piece == "ar"]
    first = next(i for i, r in enumerate(ar) if r.collocated)
    assert ar[first].slowdown == pytest.approx(3.0)
    assert not any(r.collocated for r in ar[first + 1:])  # background paused around it
    assert all(r.end_us - r.ready_us == 50.0 for r in ar[first + 1:])
    assert stats["bg"].iterations > 10 and stats["bg"].feedback_pauses > 0
    # calibration: the first foreground iteration ran alone
    bg_first = min(r.start_us for r in with_fb.trace if r.job == "bg")
    assert bg_first >= max(r.end_us for r in with_fb.trace if r.job == "fg" and r.iteration == 0)

    without = Runtime(backend=LogicalBackend(_scripted), feedback=False)
    _jobs(without)
    without.run()
    slowed = [r for r in without.trace if r.piece == "ar" and r.end_us - r.ready_us == 150.0]
    assert len(slowed) >= 4 and not without.sensitive


def test_declared_sensitive_kinds_pause_from_the_start():
    rt = Runtime(backend=LogicalBackend(_scripted), sensitive_kinds=("collective",))
    _jobs(rt)
    rt.run()
    assert not any(r.collocated for r in rt.trace if r.piece == "ar")


def test_a_failing_background_job_does_not_stop_the_others():
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    x = torch.randn(4, 6)
    lowered = lower(tidal.trace(model, (x,)), (x,))
    results, counts = [], {"bad": 0}
    failed, after = threading.Event(), threading.Event()

    def bad():
        counts["bad"] += 1
        if counts["bad"] == 3:
            failed.set()
            raise RuntimeError("background exploded")

    def good():
        if failed.is_set():
            after.set()  # the other background job still runs after the failure

    def fg_pieces(i):
        run = lowered.pieces(x)
        pieces = list(run.pieces) + [_bound("collect", fn=lambda: results.append(run.result()))]
        if i == 5:  # host-side wait (leaves the device free) until both happened
            pieces.append(_bound("wait", fn=lambda: failed.wait(60) and after.wait(60),
                                 kind=HOST))
        return pieces

    with Runtime(backend=CpuBackend(slots=1)) as rt:
        rt.submit(FunctionJob("fg", fg_pieces, iterations=6), priority="high")
        rt.submit(step_job("bad", bad), priority="low")
        rt.submit(step_job("good", good), priority="low")
        stats = rt.run()
    assert stats["fg"].iterations == 6 and stats["fg"].error is None and after.is_set()
    assert len(results) == 6
    with torch.no_grad():
        for r in results:
            torch.testing.assert_close(r, model(x), rtol=0, atol=0)
    assert "RuntimeError: background exploded" in stats["bad"].error
    assert stats["bad"].iterations == 2 and counts["bad"] == 3
    assert "background exploded" in rt.summary()


def test_a_failing_foreground_job_is_reported():
    rt = Runtime(backend=LogicalBackend(lambda label, c: 10.0))
    rt.submit(step_job("fg", lambda: 1 / 0, iterations=3), priority="high")
    rt.submit(step_job("bg", lambda: None), priority="low")
    stats = rt.run()
    assert stats["fg"].error.startswith("ZeroDivisionError") and stats["fg"].iterations == 0


def test_memory_cap_holds_a_job_between_iterations_until_raised():
    def adjust(handle, i):
        if i == 1:
            handle.limits.memory_bytes = 100  # lowered between iterations: the job is held
    rt = Runtime(backend=LogicalBackend(lambda label, c: 10.0), feedback=False)
    fg = rt.submit(step_job("fg", lambda: None, iterations=20), priority="high")
    bg = rt.submit(step_job("bg", lambda: None, memory_bytes=1000), priority="low",
                   memory_cap=2000, on_iteration=adjust)
    rt.run()
    assert bg.stats.iterations == 2 and bg.stats.held == 1 and fg.stats.iterations == 20
    rt.run(until="all")  # returns at once: the only live job is held
    assert bg.stats.iterations == 2
    bg.limits.memory_bytes = None  # raised: the job resumes
    rt.run(until="all", timeout_s=100e-6)
    assert bg.stats.iterations > 2


def test_compute_share_limits_background_device_time():
    rt = Runtime(backend=LogicalBackend(lambda label, c: 20.0), feedback=False, poll_us=5)
    rt.submit(FunctionJob("fg", lambda i: [_bound("wait", kind=HOST)], 50), priority="high")
    bg = rt.submit(step_job("bg", lambda: None), priority="low", compute_share=0.25)
    rt.run()
    span = bg.stats.last_us - bg.stats.first_us
    assert 0.15 < bg.stats.busy_us / span <= 0.25 + 20.0 / span


def test_lowered_job_on_the_threaded_backend_equals_eager_and_exports_a_trace(tmp_path):
    torch.manual_seed(0)
    model = ZOO["resnet50_small"]().eval()
    x = model.example_inputs(2)
    gm = tidal.compile(model, x).graph_module
    lowered = lower(gm, x, time_us=lambda n: 1.0, piece_us=20)
    out = {}
    with Runtime(backend=CpuBackend(slots=1)) as rt:
        job = lowered_job("fg", lowered, x, iterations=2)
        rt.submit(job, priority="high")
        run = lowered.pieces(*x)
        rt.submit(FunctionJob("bg", lambda i: run.pieces if i == 0 else [
            _bound("keep", fn=lambda: out.setdefault("bg", run.result()))], 2), priority="low")
        rt.run(until="all")
    with torch.no_grad():
        torch.testing.assert_close(out["bg"], model(*x), rtol=0, atol=0)
    path = write_chrome_trace(rt.trace, tmp_path / "trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    rows = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert rows == {"fg (high)", "bg (low)"}
    assert sum(1 for e in events if e["ph"] == "X" and e.get("cat") != "wait") == len(rt.trace)
    assert "fg" in summary_table(rt) and chrome_trace([])["traceEvents"] == []


def test_submit_errors_are_clear():
    rt = Runtime(backend=LogicalBackend(lambda label, c: 1.0))
    rt.submit(step_job("a", lambda: None, iterations=1), priority="high")
    with pytest.raises(ValueError, match="already a foreground job"):
        rt.submit(step_job("b", lambda: None), priority="high")
    with pytest.raises(ValueError, match="priority must be"):
        rt.submit(step_job("c", lambda: None), priority="urgent")
    with pytest.raises(ValueError, match="already submitted"):
        rt.submit(step_job("a", lambda: None))
    with pytest.raises(ValueError, match="fg_depth"):
        Runtime(backend=LogicalBackend(lambda label, c: 1.0), fg_depth=0)


def _three_streams(log):
    return [_bound("a", fn=lambda: log.append("a")),
            _bound("sync", COMM, (0,), fn=lambda: log.append("sync")),
            _bound("b", deps=(0,), fn=lambda: log.append("b")),
            _bound("update", deps=(1, 2), fn=lambda: log.append("update"))]


def test_a_job_with_several_streams_overlaps_what_its_dependencies_allow():
    """A program's pieces on compute and comm streams: the sync starts when ``a`` ends, runs
    beside ``b``, and ``update`` waits for both (a logical clock: exact times)."""
    durations = {"a": 10.0, "sync": 30.0, "b": 10.0, "update": 5.0}
    rt = Runtime(backend=LogicalBackend(lambda label, _: durations[label.split("/")[1]]))
    log: list = []
    rt.submit(FunctionJob("train", lambda i: _three_streams(log), iterations=1), "high")
    rt.run()
    t = {r.piece: (r.start_us, r.end_us, r.stream) for r in rt.trace}
    assert t["sync"][:2] == (10.0, 40.0) and t["b"][:2] == (10.0, 20.0)
    assert t["update"][0] == 40.0 and t["sync"][2] == "comm"


def test_cross_stream_dependencies_are_events_on_the_cpu_backend():
    log: list = []
    with Runtime(backend=CpuBackend(slots=None)) as rt:
        h = rt.submit(FunctionJob("train", lambda i: _three_streams(log), iterations=2), "high")
        rt.run()
    assert h.stats.iterations == 2 and h.stats.error is None
    for it in range(2):
        order = log[4 * it:4 * it + 4]
        assert order[0] == "a" and order[-1] == "update" and set(order[1:3]) == {"sync", "b"}


def test_a_piece_that_waits_for_a_later_piece_fails_its_job_by_name():
    rt = Runtime(backend=LogicalBackend(lambda label, _: 1.0))
    h = rt.submit(FunctionJob("bad", lambda i: [_bound("x", deps=(1,)), _bound("y")],
                              iterations=1), "high")
    rt.run()
    assert "'x' waits for (1,)" in h.stats.error


def _compute_wait_compute(iterations: int):
    """A foreground job "fg": compute ``a``, a transfer ``wait`` that leaves the device idle,
    compute ``b`` after it."""
    return FunctionJob("fg", lambda i: [_bound("a"),
                                        _bound("wait", COMM, (0,), kind=POINT_TO_POINT),
                                        _bound("b", deps=(1,))],
                       iterations=iterations)


def test_idle_only_background_fills_the_foregrounds_waits_and_nothing_else():
    """BP+Col on a logical clock: the foreground computes, waits 300 µs on a transfer (its
    device is idle), computes again. Background pieces of 50 µs go only into the waits and end
    before the foreground needs the device: the foreground is never delayed, and the background
    turns every idle µs into work."""
    durations = {"a": 100.0, "wait": 300.0, "b": 100.0, "bg": 50.0}
    rt = Runtime(backend=LogicalBackend(lambda label, _: durations[label.split("/")[1]],
                                        slots=1), idle_only=True, fg_depth=None)
    rt.submit(_compute_wait_compute(4), "high")
    rt.submit(FunctionJob("bg", lambda i: [_bound("bg")]), "low")
    stats = rt.run()
    waits = [(r.start_us, r.end_us) for r in rt.trace if r.piece == "wait"]
    bg = [(r.start_us, r.end_us) for r in rt.trace if r.job == "bg"]
    assert stats["fg"].iterations == 4 and len(waits) == 4
    assert all(any(s >= ws and e <= we for ws, we in waits) for s, e in bg), (bg, waits)
    iso = [r.end_us - r.start_us for r in rt.trace if r.job == "fg" and r.piece in "ab"]
    assert iso == [100.0] * 8                       # never slowed
    calibrated = waits[1:]                          # the first iteration runs alone
    reclaimed = sum(e - s for s, e in bg) / sum(e - s for s, e in calibrated)
    assert reclaimed == 1.0, (bg, waits)


def test_idle_only_queued_background_pieces_still_end_before_the_foreground_needs_the_device():
    """Two background pieces may be outstanding (be_depth=2: the second queues behind the
    first, no dispatch between them); each is admitted only if it ends, after the pieces queued
    before it, before the foreground's transfer is predicted to end, and that prediction is the
    shortest recent duration (the waits alternate 300 and 200 µs). The foreground's compute
    never waits for the background."""
    import itertools

    waits = itertools.cycle([300.0, 200.0])
    fixed = {"a": 100.0, "b": 100.0, "bg": 70.0}

    def duration(label: str, _: bool) -> float:
        name = label.split("/")[1]
        return next(waits) if name == "wait" else fixed[name]

    rt = Runtime(backend=LogicalBackend(duration, slots=1), idle_only=True, fg_depth=None,
                 be_depth=2)
    rt.submit(_compute_wait_compute(8), "high")
    rt.submit(FunctionJob("bg", lambda i: [_bound("bg")]), "low")
    stats = rt.run()
    assert stats["fg"].iterations == 8
    spans = [(r.start_us, r.end_us) for r in rt.trace if r.piece == "wait"]
    starts = [r.start_us for r in rt.trace if r.piece == "b"]
    # once both wait lengths were seen (iteration 2 on), b starts the moment its transfer ends
    assert starts[2:] == [e for _, e in spans][2:], (starts, spans)
    bg = [(r.start_us, r.end_us) for r in rt.trace
          if r.job == "bg" and spans[2][0] <= r.start_us < starts[-1]]
    assert all(any(s >= ws and e <= we for ws, we in spans) for s, e in bg), (bg, spans)
    assert max(sum(1 for s, _ in bg if ws <= s < we) for ws, we in spans) >= 2  # queued pairs


def test_an_upgradable_background_job_becomes_the_foreground_when_it_finishes():
    rt = Runtime(backend=LogicalBackend(_scripted))
    rt.submit(FunctionJob("fg", lambda i: [_bound("c0")], 3), priority="high")
    rt.submit(FunctionJob("bg", lambda i: [_bound("b")], 40), priority="low",
              compute_share=0.2, upgrade=True)
    stats = rt.run()                      # until the foreground, which the upgrade hands on
    fg_end = max(r.end_us for r in rt.trace if r.job == "fg")
    assert stats["bg"].iterations == 40 and stats["bg"].priority == "high"
    assert stats["bg"].upgraded_us >= fg_end
    after = [r for r in rt.trace if r.job == "bg" and r.start_us >= stats["bg"].upgraded_us]
    assert after and all(r.priority == "high" for r in after)
    # no longer held to its 20 % share: back to back once upgraded
    gaps = [b.start_us - a.end_us for a, b in zip(after, after[1:])]
    assert max(gaps) < 1.0


def test_without_upgrade_the_run_stops_with_the_foreground():
    rt = Runtime(backend=LogicalBackend(_scripted))
    rt.submit(FunctionJob("fg", lambda i: [_bound("c0")], 3), priority="high")
    rt.submit(FunctionJob("bg", lambda i: [_bound("b")], 40), priority="low")
    stats = rt.run()
    assert stats["bg"].iterations < 40 and stats["bg"].upgraded_us is None


def test_busy_fraction_profiles_each_job_and_the_idle_share():
    rt = Runtime(backend=LogicalBackend(_scripted))
    rt.submit(FunctionJob("fg", lambda i: [_bound("c0")], 4), priority="high")
    rt.submit(FunctionJob("bg", lambda i: [_bound("b")]), priority="low",
              compute_share=0.25)
    rt.run()
    share = rt.busy_fraction()
    assert set(share) == {"fg", "bg", "idle"}
    assert 0 < share["bg"] < share["fg"] and 0 <= share["idle"] < 1
    alone = Runtime(backend=LogicalBackend(_scripted))
    alone.submit(FunctionJob("fg", lambda i: [_bound("c0")], 4), priority="high")
    alone.run()
    assert alone.busy_fraction()["idle"] == pytest.approx(0.0, abs=1e-9)

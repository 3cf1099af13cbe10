"""The simulator's composition against the executor's own runs, on every plan kind.

One spawned job of 2 gloo ranks runs a tiny model under each plan kind (data parallel,
compression, burst, tick_tock, round_robin, layer groups, and a data-parallel foreground with
a background job on each rank's scheduler; ``benchmarks/sim_runs.py``, which the benchmark
``benchmarks/sim_validation.py`` shares) and returns, per kind, each rank's Program (the
objects the executor ran) and its trace, on one clock. The simulator, given each piece's
own measured duration (``tidal.sim.composition``), must reproduce the trace's order (per rank
and stream) and its overlap (which pieces of different streams overlap in time and which are
apart), for every kind. No timing is asserted: the overlap is compared only where the trace is
clear by a margin (pairs within it are too close to call)."""
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from background_jobs import Job

from benchmarks.sim_runs import KINDS, collect, run_kinds, write_store

BATCH = 8


def _folder() -> Path:
    """Where the job's weight store is written: a folder of this process (the job is made
    at collection, before any tmp_path)."""
    return Path(tempfile.gettempdir()) / f"tidal-test-sim-composition-{os.getpid()}"


def _job() -> Job:
    """The module's one 2-rank job (``sim_runs.run_kinds`` on the tiny MLP), its layer
    groups' weight store written first (once per session)."""
    folder = _folder()
    store = folder / "groups_mlp.safetensors"
    if not store.exists():
        folder.mkdir(exist_ok=True)
        write_store("mlp", BATCH, folder)
    return Job(run_kinds, 2, ("mlp", BATCH, str(store), KINDS, 1), {"timeout_s": 600})


def background_job(items):
    """Run in the background while other modules run (``tests/conftest.py``) when a
    collected test reads it."""
    return _job() if any("runs" in getattr(i, "fixturenames", ()) for i in items) else None


@pytest.fixture(scope="module")
def runs(request, background_jobs):
    """{kind: ({rank: program}, {rank: trace on one clock}, {rank: extra}, the step's host
    time outside its pieces per rank)}: the last of the runs' steps
    (``benchmarks/sim_runs.py``: one spawned job of 2 ranks, the tiny MLP)."""
    try:
        ran = collect(background_jobs.result(request.module.__name__, _job()), KINDS, 1)
    finally:
        shutil.rmtree(_folder(), ignore_errors=True)
    return {kind: (r.programs, r.traces[-1], r.extra, r.outside_us)
            for kind, r in ran.items()}


def _order(spans):
    """{rank: {stream: names in start order}} (ties in the order listed)."""
    out = {}
    for r, ranked in spans.items():
        per = {}
        for name, stream, _, _ in sorted(ranked, key=lambda s: s[2]):
            per.setdefault(stream, []).append(name)
        out[r] = per
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_simulator_given_measured_durations_reproduces_order_and_overlap(runs, kind):
    from tidal.sim.composition import (compose, measured_pieces,
                                       measured_step_us, overlaps, simulated_spans,
                                       traced_spans)
    from tidal.sim.programs import simulated_order, trace_order

    programs, traces, extra, outside_us = runs[kind]
    if kind != KINDS[-1]:
        assert {cls for cls, _ in extra.values()} != {"GraphProgram"}, extra  # the plan's
        # Compiled.step's host time outside its pieces, one per rank and repeat (>= 0: the
        # pieces run inside the step's wall time)
        assert len(outside_us) == 2 and all(us >= 0 for us in outside_us), outside_us
    else:
        assert all(extra.values()), "the background job ran"
        assert outside_us == ()  # a scheduler job: no Compiled.step to time
    streams = {p.stream for program in programs.values() for p in program.pieces}
    assert streams & {"comm", "transfer", "load"}, streams  # every kind moves data
    assert simulated_order(programs, traces) == trace_order(traces)
    measured = measured_pieces(programs, traces)
    assert all(m.own_us >= 0 for m in measured)
    intervals = compose(programs, traces, release=True, gaps=True)
    simulated, real = simulated_spans(programs, intervals), traced_spans(traces)
    assert _order(simulated) == _order(real) == trace_order(traces)
    # overlap (compute vs communication pieces of a rank): what the trace shows clearly
    # overlapping overlaps in the simulation; what it shows clearly apart does not clearly
    # overlap there (both by a margin of a tenth of the step)
    margin = 0.1 * measured_step_us(traces)
    clear_on, clear_off = overlaps(real, margin)
    sim_on, _ = overlaps(simulated, 0.0)
    sim_clear_on, _ = overlaps(simulated, margin)
    assert clear_on <= sim_on, (kind, clear_on - sim_on)
    assert not clear_off & sim_clear_on, (kind, clear_off & sim_clear_on)


def test_the_overlap_comparisons_are_not_vacuous(runs):
    """Over the kinds, the trace shows pairs clearly overlapping or clearly apart (by the
    margin above), so the comparisons compare something. Per kind it depends on the run's
    timing (a starved rank can bring every pair within the margin): counted over all."""
    from tidal.sim.composition import measured_step_us, overlaps, traced_spans

    clear = [kind for kind, (_, traces, _, _) in runs.items()
             if any(overlaps(traced_spans(traces), 0.1 * measured_step_us(traces)))]
    assert len(clear) >= len(runs) // 2, clear

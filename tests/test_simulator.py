"""Cluster simulator: engine semantics, collective times, data-parallel programs."""
import random
import re
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import tidal
from tidal.ir.comm_cost import all_to_all_us, ring_allreduce_us, tree_broadcast_us
from tidal.ir.program import COMM, COMPUTE, Piece, Program
from tidal.sim.engine import lane_of, simulate
from tidal.sim.programs import LayerTimes, data_parallel, layer_times, summarize

A100 = Path(tidal.__file__).resolve().parent.parent / "shared" / "data" / "deeppool-a100-profiles"
needs_a100 = pytest.mark.skipif(not A100.is_dir(), reason=f"DeepPool A100 profiles not at {A100}")


def _random_layers(rng, n):
    return LayerTimes(tuple(f"l{i}" for i in range(n)),
                      tuple(rng.uniform(1, 100) for _ in range(n)),
                      tuple(rng.uniform(1, 200) for _ in range(n)),
                      tuple(rng.choice([0, 4096, 10 ** 6]) for _ in range(n)))


def test_single_gpu_iteration_is_sum_of_layer_times():
    rng = random.Random(0)
    for _ in range(5):
        lt = _random_layers(rng, rng.randint(1, 30))
        r = summarize(data_parallel(lambda b: lt, 1, 16), 1, 16)
        assert r.iteration_us == pytest.approx(sum(lt.fwd_us) + sum(lt.bwd_us))
        assert r.busy_fraction == pytest.approx(1.0)


def test_ring_allreduce_is_textbook_step_by_step():
    # reduce-scatter then all-gather: 2(p-1) steps, each sending b/p bytes after latency a
    for p, b, bw, a in [(2, 1e6, 1e4, 5.0), (8, 3.2e7, 2.66e5, 40.0), (64, 1e8, 1250.0, 10.0)]:
        steps = 2 * (p - 1)
        expected = sum(a + (b / p) / bw for _ in range(steps))
        assert ring_allreduce_us(b, p, bw, a) == pytest.approx(expected)
    assert ring_allreduce_us(1e6, 1, 1e4, 5.0) == 0.0
    assert all_to_all_us(0, 4, 1e4, 5.0) == 0.0
    with pytest.raises(ValueError, match="bandwidth"):
        ring_allreduce_us(1.0, 2, 0.0, 1.0)


def test_no_gpu_runs_two_pieces_of_one_job_at_once():
    rng = random.Random(1)
    lt = _random_layers(rng, 12)
    cluster = tidal.Cluster(gpus=4, bandwidth_gbps=10, latency_us=5)
    intervals = simulate(data_parallel(lambda b: lt, 4, 32, cluster))
    lanes = defaultdict(list)
    for i in intervals:
        lanes[(i.gpu, i.lane, i.job)].append((i.start_us, i.end_us))
    for spans in lanes.values():
        spans.sort()
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            assert s1 >= e0 - 1e-9


def test_allreduce_overlaps_backward_and_waits_for_all_gpus():
    lt = LayerTimes(("a", "b"), (10.0, 10.0), (10.0, 10.0), (10 ** 6, 10 ** 6))
    cluster = tidal.Cluster(gpus=2, bandwidth_gbps=8, latency_us=0)  # 1000 bytes/us
    tasks = data_parallel(lambda b: lt, 2, 4, cluster, bucket_bytes=1)  # one bucket per layer
    iv = {(i.name, i.gpu): i for i in simulate(tasks)}
    # layer b's gradients are ready after its backward (t=30) and all-reduced while a's
    # backward runs; a's all-reduce waits for the link
    assert iv[("AR:b..b", 0)].start_us == 30.0
    assert iv[("AR:a..a", 0)].start_us == iv[("AR:b..b", 0)].end_us
    assert iv[("AR:b..b", 0)].end_us - 30.0 == pytest.approx(ring_allreduce_us(1e6, 2, 1000.0, 0))
    # DDP's default 25 MiB bucket holds both layers: one all-reduce after the last backward
    (ar,) = [p for p in data_parallel(lambda b: lt, 2, 4, cluster).pieces
             if p.kind == "collective"]
    assert ar.name == "AR:b..a" and ar.duration_us == pytest.approx(
        ring_allreduce_us(2e6, 2, 1000.0, 0))


def test_engine_rejects_forward_dependencies_and_bad_tasks():
    with pytest.raises(ValueError, match="not an earlier"):
        simulate(Program((Piece("x", COMPUTE, (0,), duration_us=1.0, ranks=(0,)),)))
    with pytest.raises(ValueError, match="exactly one GPU"):
        simulate(Program((Piece("x", COMPUTE, duration_us=1.0, ranks=(0, 1)),), 2))
    with pytest.raises(ValueError, match="divisible"):
        data_parallel(lambda b: _random_layers(random.Random(0), 2), 3, 8)


def test_layer_times_from_a_traced_model_use_the_profile():
    from examples.models import ZOO
    from tidal.ir.capture import trace
    from tidal.ir import cost
    from tidal.ir.device_profile import LayerTime
    from tidal.ir.profiler import node_signature

    model = ZOO["vgg16_small"]()
    x = model.example_inputs(4)
    gm = trace(model, x)
    cost.annotate(gm, x)
    plain = layer_times(gm, tidal.Cluster(gpus=1), 4)
    first = next(n for n in gm.graph.nodes if n.op == "call_module")
    prof = tidal.DeviceProfile("toy", {node_signature(gm, first, 4): LayerTime(123.0, 456.0)})
    profiled = layer_times(gm, tidal.Cluster(gpus=1, profile=prof), 4)
    i = plain.names.index(first.name)
    assert (profiled.fwd_us[i], profiled.bwd_us[i]) == (123.0, 456.0)
    assert profiled.fwd_us[:i] + profiled.fwd_us[i + 1:] == plain.fwd_us[:i] + plain.fwd_us[i + 1:]
    assert sum(plain.param_bytes) == sum(p.numel() * 4 for p in model.parameters())


def test_simulate_cli_prints_simulated_summary_and_rejects_bad_batch(cli, tmp_path):
    run = lambda *a: cli("simulate", *a)  # tidal simulate, in this process (conftest.py)
    trace = tmp_path / "t.json"
    r = run("vgg16_small", "--gpus", "4", "--global-batch", "16", "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    assert "simulated (not measured)" in r.stdout and "4 GPUs" in r.stdout
    events = __import__("json").loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1, 2, 3}
    r = run("vgg16_small", "--gpus", "3", "--global-batch", "16")
    assert r.returncode == 2 and "not divisible" in r.stderr


def test_collocation_fills_idle_time_and_slows_foreground():
    from tidal.sim.collocation import BackgroundJob, collocate

    lt = LayerTimes(("a", "b"), (10.0, 30.0), (20.0, 60.0), (0, 0))
    tasks = data_parallel(lambda b: lt, 1, 4)
    alone = summarize(tasks, 1, 4)
    r = collocate(tasks, 1, 4, BackgroundJob(iteration_us=5.0, batch=2), interference=1.1)
    assert r.foreground.iteration_us == pytest.approx(1.1 * alone.iteration_us)
    assert r.bg_samples_per_iteration == 0.0  # one busy GPU leaves nothing to pack
    # two GPUs with uneven work: the idle one runs background iterations
    uneven = Program((Piece("x", COMPUTE, duration_us=100.0, ranks=(0,)),
                      Piece("y", COMPUTE, duration_us=40.0, ranks=(1,))), 2)
    r = collocate(uneven, 2, 8, BackgroundJob(iteration_us=20.0, batch=3))
    assert r.bg_samples_per_iteration == pytest.approx(60.0 / 20.0 * 3)
    assert r.cluster_throughput == pytest.approx(8 / 100e-6 + 9 / 100e-6)
    with pytest.raises(ValueError, match="interference"):
        collocate(uneven, 2, 8, BackgroundJob(20.0, 3), interference=0.5)


def test_sm_sharing_bound_uses_what_small_kernels_leave():
    from tidal.sim.collocation import (BackgroundJob, collocate, job_utilization,
                                       kernel_utilization)

    # layer a scales linearly (full use at any batch); b costs the same at batch 1 and 4
    def times(b):
        return LayerTimes(("a", "b"), (10.0 * b, 40.0), (20.0 * b, 80.0), (0, 0))

    u = kernel_utilization(times, 4, probes=(1, 2, 4, 8, 16))
    assert u["a"] == pytest.approx((1.0, 1.0))
    assert u["b"] == pytest.approx((4 * (40.0 / 16) / 40.0, 4 * (80.0 / 16) / 80.0))  # 0.25
    # job utilization is the time-weighted mean: (30*4*1 + 120*0.25) / (30*4 + 120)
    assert job_utilization(times, 4, probes=(1, 2, 4, 8, 16)) == pytest.approx(
        (120 * 1.0 + 120 * 0.25) / 240)
    tasks = data_parallel(times, 1, 4)
    util = {f"{k}:{n}": v for n, (f, b) in u.items() for k, v in (("F", f), ("B", b))}
    bg = BackgroundJob(iteration_us=50.0, batch=2, utilization=0.5)
    idle_only = collocate(tasks, 1, 4, bg)
    shared = collocate(tasks, 1, 4, bg, fg_utilization=util)
    assert idle_only.bg_samples_per_iteration == 0.0
    # only b's 120 us leave 0.75 of the GPU; the background uses 0.5 of it (its own need)
    assert shared.bg_samples_per_iteration == pytest.approx(120 * 0.5 / (50.0 * 0.5) * 2)
    assert shared.foreground.iteration_us == idle_only.foreground.iteration_us
    with pytest.raises(ValueError, match="utilization"):
        BackgroundJob(10.0, 2, utilization=0.0)


def test_burst_plan_simulation_matches_the_planner_on_a_chain():
    from examples.models import ZOO
    from tidal.ir import layer_graph
    from tidal.passes.burst_parallel import BurstParallel
    from tidal.sim.programs import burst_parallel

    model = ZOO["vgg16_small"]()
    x = model.example_inputs(8)
    cluster = tidal.Cluster(gpus=4, bandwidth_gbps=100, latency_us=5, peak_tflops=0.05)
    # the simulator's per-layer model, which this compares with, charges sync after backward
    compiled = tidal.compile(model, x, passes=[BurstParallel(amp_limit=4.0, sync="bucketed")],
                             cluster=cluster)
    plan = compiled.plan.get("burst_parallel")
    lg = layer_graph.build(compiled.graph_module)
    preds = {n: list(lg.predecessors(n)) for n in lg.nodes}
    r = summarize(burst_parallel(plan, preds), 4, 8)
    assert r.iteration_us == pytest.approx(plan.time_us, rel=1e-6)
    # GPUs outside a layer's set are idle during it: busy time is the plan's GPU time
    busy = sum(p.comp_us * p.gpus for p in plan.layers)
    assert sum(r.busy_us) == pytest.approx(busy)
    # overlapped all-reduces: same work, never longer, and some compute starts before the
    # all-reduce of an earlier layer on the same GPU has ended
    o = summarize(burst_parallel(plan, preds, overlap_sync=True), 4, 8)
    assert sum(o.busy_us) == pytest.approx(busy)
    assert o.iteration_us < r.iteration_us
    ar_end = {(i.gpu, i.name[3:]): i.end_us for i in o.intervals if i.name.startswith("AR:")}
    first_ar = min(ar_end.items(), key=lambda kv: kv[1])
    assert any(i.name.startswith("FB:") and i.gpu == first_ar[0][0] and
               i.start_us < first_ar[1] and i.name[3:] != first_ar[0][1] for i in o.intervals)


def test_wavelet_schedules_become_timelines():
    from tidal.ir.schedule import Action, Schedule
    from tidal.sim.programs import schedule_result

    acts = (Action("F", 0, wave="T", lane="T", start_us=0, dur_us=10),
            Action("F", 1, wave="K", lane="K", start_us=10, dur_us=10),
            Action("B", 0, wave="T", lane="T", start_us=10, dur_us=20),
            Action("A", 0, wave="T", lane="T", start_us=30, dur_us=5))
    r = schedule_result(Schedule("toy", ranks=(acts, acts), batches=2, data_parallel=True), 8)
    assert r.iteration_us == 35.0
    assert r.busy_us == (30.0, 30.0)  # overlapping waves count once
    assert {i.lane for i in r.intervals if i.name.endswith("A0")} == {"link"}


@pytest.mark.parametrize("plan", ["round_robin", "tick_tock"])
def test_simulate_cli_wavelet_plans(plan, cli):
    r = cli("simulate", "vgg16_small", "--gpus", "2", "--global-batch", "8", "--plan", plan)
    assert r.returncode == 0, r.stderr
    assert f"  {plan}" in r.stdout and "rank 1:" in r.stdout


def test_scaling_strategies_and_steps_table(tmp_path):
    from tidal.sim.scaling import StepsTable, scaling_speedups

    f = tmp_path / "steps.csv"
    f.write_text("global_batch,steps\n8,1000\n64,200\n512,100\n")
    table = StepsTable.load(f)
    assert table.steps(8) == 1000 and table.steps(4096) == 100
    assert table.steps(16) == pytest.approx(1000 * (200 / 1000) ** (1 / 3))  # log-log
    lt = _random_layers(random.Random(3), 10)
    cluster = tidal.Cluster(gpus=8, bandwidth_gbps=10, latency_us=20)

    def iteration(g, b):
        return summarize(data_parallel(lambda per_gpu: lt, g, b, cluster), g, b).iteration_us

    s = scaling_speedups(iteration, table, (1, 2, 4, 8), per_gpu_batch=8, global_batch=64)
    assert s["batch-optimal"][0] == pytest.approx(1.0)
    for k in range(4):
        assert s["batch-optimal"][k] >= max(s["weak"][k], s["strong"][k]) - 1e-9
    f.write_text("global_batch,steps\n8,1000\n64,oops\n")
    with pytest.raises(ValueError, match="steps.csv:3"):
        StepsTable.load(f)


def test_simulate_cli_scaling_chart(tmp_path, cli):
    (tmp_path / "steps.csv").write_text("8,1000\n64,200\n512,100\n")
    r = cli("simulate", "vgg16_small", "--gpus", "4", "--global-batch", "16", "--scaling",
            tmp_path / "steps.csv", "--scaling-svg", tmp_path / "s.svg")
    assert r.returncode == 0, r.stderr
    assert "batch-optimal" in r.stdout and "<polyline" in (tmp_path / "s.svg").read_text()


def test_processor_sharing_slows_compute_beyond_the_cores():
    # three GPUs computing on two cores run at 2/3 speed; alone, a GPU runs at full speed
    pieces = [Piece(f"c{g}", COMPUTE, duration_us=10.0, ranks=(g,)) for g in range(3)]
    pieces.append(Piece("solo", COMPUTE, (0, 1, 2), duration_us=10.0, ranks=(0,)))
    pieces.append(Piece("ar", COMM, (0, 1), duration_us=4.0, ranks=(0, 1)))
    iv = {(i.name, i.gpu): i for i in simulate(Program(tuple(pieces), 3), cores=2)}
    assert iv[("c0", 0)].end_us == pytest.approx(15.0)
    assert iv[("solo", 0)].end_us == pytest.approx(25.0)
    assert iv[("ar", 1)].end_us - iv[("ar", 1)].start_us == pytest.approx(4.0)  # links unshared
    # with cores to spare, the shared engine reproduces the list-order engine exactly
    lt = _random_layers(random.Random(5), 15)
    dp = data_parallel(lambda b: lt, 4, 32, tidal.Cluster(gpus=4, bandwidth_gbps=10,
                                                          latency_us=5), bucket_bytes=1e6)
    for a, b in zip(simulate(dp), simulate(dp, cores=4)):
        assert (a.name, a.gpu, a.lane) == (b.name, b.gpu, b.lane)
        assert a.start_us == pytest.approx(b.start_us) and a.end_us == pytest.approx(b.end_us)
    # 4 GPUs on 2 cores: every compute piece twice as long, no GPU runs two at once
    shared = simulate(dp, cores=2)
    per_gpu = defaultdict(list)
    for i in shared:
        if i.lane == "compute":
            per_gpu[i.gpu].append((i.start_us, i.end_us))
    for spans in per_gpu.values():
        spans.sort()
        assert all(s1 >= e0 - 1e-9 for (_, e0), (s1, _) in zip(spans, spans[1:]))
    assert sum(e - s for v in per_gpu.values() for s, e in v) == pytest.approx(
        2 * 4 * (sum(lt.fwd_us) + sum(lt.bwd_us)))
    with pytest.raises(ValueError, match="cores"):
        simulate(dp, cores=0)



def test_link_slows_only_while_computation_remains():
    from tidal.ir.program import OPTIMIZER
    from tidal.sim.programs import link_load, summarize

    # a 6 us all-reduce that takes 18 us inside the step's computation: 4 us of it while
    # rank 1 computes (4/18 of its work), the rest (14/18 of 6 us) after; the optimizer step
    # after it does not count as computation to come (it waits for the link)
    pieces = (Piece("c0", COMPUTE, duration_us=2.0, ranks=(0,)),
              Piece("c1", COMPUTE, duration_us=6.0, ranks=(1,)),
              Piece("ar", COMM, (0,), duration_us=6.0, ranks=(0, 1)),
              Piece("after", COMPUTE, (2,), kind=OPTIMIZER, duration_us=1.0, ranks=(0,)))
    idle = Program(pieces, 2)
    busy = Program(tuple(replace(p, duration_us=18.0) if p.name == "ar" else p
                         for p in pieces), 2)
    iv = {(i.name, i.gpu): i for i in simulate(idle, link_load=link_load(idle, busy))}
    assert iv[("ar", 0)].start_us == pytest.approx(2.0)
    assert iv[("ar", 0)].end_us == pytest.approx(6.0 + 6.0 * 14 / 18)
    assert iv[("after", 0)].start_us == pytest.approx(iv[("ar", 0)].end_us)
    # without link_load, or when loaded equals idle: the links keep their durations
    for kw in ({}, {"link_load": link_load(idle, idle)}):
        assert {(i.name, i.gpu): i.end_us for i in simulate(idle, **kw)}[("ar", 1)] == \
            pytest.approx(8.0)
    # the bounds: every link idle <= switching <= every link beside computation
    lt = _random_layers(random.Random(7), 12)
    fast, slow = (tidal.Cluster(gpus=4, bandwidth_gbps=bw, latency_us=lat)
                  for bw, lat in ((10, 5), (3, 20)))
    dp_idle, dp_busy = (data_parallel(lambda b: lt, 4, 32, c, bucket_bytes=5e4, update_us=9.0)
                        for c in (fast, slow))
    switching = summarize(dp_idle, 4, 32, link_load=link_load(dp_idle, dp_busy)).iteration_us
    assert summarize(dp_idle, 4, 32).iteration_us < switching \
        < summarize(dp_busy, 4, 32).iteration_us
    # a compute piece still to run after the link keeps it at the loaded speed throughout
    later = Program(pieces[:3] + (Piece("after", COMPUTE, (2,), duration_us=1.0, ranks=(0,)),),
                    2)
    busy_later = Program(busy.pieces[:3] + later.pieces[3:], 2)
    iv = {(i.name, i.gpu): i
          for i in simulate(later, link_load=link_load(later, busy_later))}
    assert iv[("ar", 0)].end_us == pytest.approx(2.0 + 18.0)
    with pytest.raises(ValueError, match="not the same pieces"):
        link_load(idle, Program(pieces[:3], 2))
    with pytest.raises(ValueError, match="shorter than"):
        simulate(idle, link_load=lambda p: 1.0)

def test_burst_execution_follows_the_executor():
    from tidal.passes.burst_planner import BurstProblem, plan_from_counts
    from tidal.sim.programs import burst_execution

    counts = (1, 2)
    comp = np.array([[40.0, 20.0], [30.0, 15.0], [20.0, 10.0]])
    sync = np.zeros((3, 2))
    problem = BurstProblem(("a", "b", "c"), ((), (0,), (1,)), comp, sync,
                           act_bytes=np.array([100.0, 100.0, 100.0]), counts=counts, batch=4,
                           bytes_per_us=1000.0, latency_us=1.0)
    plan = plan_from_counts(problem, [2, 1, 2])
    lt = {b: LayerTimes(("a", "b", "c"), (10.0 * b, 20.0 * b, 5.0 * b),
                        (20.0 * b, 40.0 * b, 10.0 * b), (8000, 4000, 0)) for b in (2, 4)}
    cluster = tidal.Cluster(gpus=2, bandwidth_gbps=8, latency_us=1)  # 1000 bytes/us
    preds = {"a": [], "b": ["a"], "c": ["b"]}
    tasks = burst_execution(plan, preds, lambda b: lt[b], cluster, update_us=7.0)
    r = summarize(tasks, 2, 4)
    iv = {(i.name, i.gpu): i for i in r.intervals}
    # b runs on rank 0 alone at the full batch; rank 1 holds no rows of it
    assert ("F:b", 1) not in iv and iv[("F:b", 0)].end_us - iv[("F:b", 0)].start_us == 80.0
    # backward starts after the last forward, in reverse layer order
    assert iv[("B:c", 0)].start_us >= iv[("F:c", 0)].end_us
    assert iv[("B:a", 0)].start_us >= iv[("B:b", 0)].end_us
    # gradients, after the whole backward: a's summed on both ranks; b's stay on rank 0, its
    # only holder (owner-only state: nothing is broadcast)
    ar = iv[("AR:a..a", 0)]
    assert ar.start_us >= max(iv[("B:a", g)].end_us for g in (0, 1))
    assert ar.start_us >= iv[("B:b", 0)].end_us
    assert ar.end_us - ar.start_us == pytest.approx(ring_allreduce_us(8000, 2, 1000.0, 1.0))
    assert not any(i.name.startswith(("BC", "AR:b")) for i in r.intervals)
    assert r.iteration_us == pytest.approx(max(iv[("update", g)].end_us for g in (0, 1)))
    assert iv[("update", 1)].start_us >= ar.end_us
    # layers a and c hold buffers on ranks 0,1 (b's, on rank 0 alone, stay there): as the
    # runtime's "buffers all_reduce 0,1", one all-reduce after the gradient sync on the link,
    # beside the update (which does not wait for it), and the step ends with it
    with_bn = summarize(burst_execution(plan, preds, lambda b: lt[b], cluster, update_us=7.0,
                                        buffer_bytes={"a": 3000.0, "b": 50.0, "c": 1000.0}),
                        2, 4)
    bv = {(i.name, i.gpu): i for i in with_bn.intervals}
    buf = bv[("AR:buffers 0,1", 0)]
    assert [n for n, g in bv if n.startswith("AR:buffers")] == ["AR:buffers 0,1"] * 2
    assert buf.start_us >= bv[("AR:a..a", 0)].end_us
    assert buf.end_us - buf.start_us == pytest.approx(ring_allreduce_us(4000, 2, 1000.0, 1.0))
    assert bv[("update", 1)].start_us == pytest.approx(iv[("update", 1)].start_us)
    assert with_bn.iteration_us == pytest.approx(max(buf.end_us, r.iteration_us))
    # host dispatch: each of the runtime's pieces (a stage, transfer, sync or the optimizer
    # step) starts later by it; a layer continuing its stage does not
    slow = {(i.name, i.gpu): i for i in summarize(burst_execution(
        plan, preds, lambda b: lt[b], cluster, update_us=7.0, dispatch_us=100.0), 2, 4).intervals}
    took = lambda v, k: v[k].end_us - v[k].start_us  # noqa: E731
    assert took(slow, ("F:a", 0)) == took(iv, ("F:a", 0)) + 100.0  # the step's first stage
    assert took(slow, ("X:b", 0)) == pytest.approx(took(iv, ("X:b", 0)) + 100.0)
    assert took(slow, ("F:b", 0)) == took(iv, ("F:b", 0)) + 100.0  # after a transfer
    assert took(slow, ("update", 1)) == took(iv, ("update", 1)) + 100.0


@needs_a100
def test_simulate_cli_a100_profile_shorthand(capsys, monkeypatch, tmp_path):
    from tidal.compiler.cli import main

    assert main(["simulate", "vgg16", "--gpus", "8", "--global-batch", "32",
                 "--profile", "a100"]) == 0
    out = capsys.readouterr().out
    assert "profile deeppool:a100: 36/36 layers at per-GPU batch 4, 36/36 at batch 32" in out
    # burst+bg: the background's range, idle time only to sharing the SMs VGG's batch-4
    # classifier leaves unused; the fallback plan runs as fast as data parallelism
    assert main(["simulate", "vgg16", "--gpus", "8", "--global-batch", "32",
                 "--profile", "a100", "--plan", "burst+bg"]) == 0
    out = capsys.readouterr().out
    dp = float(re.search(r"iteration [\d.]+ ms, ([\d.]+) samples/s, [\d.]+ GPU-s, busy \d+%  "
                         r"\(", out).group(1))
    bp = float(re.search(r"burst parallel   : ([\d.]+) samples/s", out).group(1))
    lo, hi = map(float, re.search(r"background ([\d.]+) \(idle time only\) to ([\d.]+) "
                                  r"\(sharing unused SMs\)", out).groups())
    assert bp == pytest.approx(dp, rel=1e-3) and 0 < lo < hi
    # a model DeepPool did not profile: a clear error, not a silent FLOP estimate
    assert main(["simulate", "bert_small", "--gpus", "2", "--global-batch", "4",
                 "--profile", "a100"]) == 2
    assert "no layer of bert_small" in capsys.readouterr().err
    monkeypatch.setenv("TIDAL_DEEPPOOL_PROFILES", str(tmp_path))
    assert main(["simulate", "vgg16", "--gpus", "8", "--global-batch", "32",
                 "--profile", "a100"]) == 2
    err = capsys.readouterr().err
    assert "--profile a100: DeepPool A100 profiles not found in" in err and str(tmp_path) in err


def test_dump_index_shows_the_scaling_chart(tmp_path):
    from tidal.sim.scaling import StepsTable

    shipped = Path(tidal.__file__).resolve().parent / "examples" / "data" / "scaling" / \
        "illustrative_steps.csv"
    assert "ILLUSTRATIVE" in shipped.read_text().splitlines()[0]
    table = StepsTable.load(shipped)
    steps = [s for _, s in table.rows]
    assert steps == sorted(steps, reverse=True) and table.rows[0][0] == 1
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    c = tidal.compile(model, (torch.randn(16, 64),),
                      cluster=tidal.Cluster(gpus=4, peak_tflops=0.001))
    index = c.dump(tmp_path / "d", scaling=shipped)
    html = index.read_text()
    assert "scaling (DeepPool Fig. 1)" in html and "weak scaling" in html
    assert "<polyline" in (tmp_path / "d" / "scaling.svg").read_text()
    rows = (tmp_path / "d" / "scaling.txt").read_text().splitlines()
    assert rows[0].split()[1:5] == ["1", "2", "4", "(GPUs)"]
    assert {r.split()[0] for r in rows[1:]} == {"weak", "strong", "batch-optimal"}
    assert "scaling" not in c.dump(tmp_path / "plain").read_text()  # only when asked


def test_wavelet_schedules_rerun_with_contention():
    from tidal.passes.round_robin import round_robin_schedule
    from tidal.passes.tick_tock import tick_tock_schedule
    from tidal.sim.programs import schedule_result

    # round_robin never overlaps two computations on a rank: the engine reproduces the builder
    rr = round_robin_schedule([10.0, 20.0, 5.0], [20.0, 40.0, 10.0], send_us=[1.0, 2.0],
                              switch_us=[3.0, 3.0, 3.0])
    assert schedule_result(rr, 6, contention=True).iteration_us == pytest.approx(
        schedule_result(rr, 6).iteration_us)
    # tick_tock's builder overlaps the waves at full speed; on one compute lane per GPU they
    # take turns: with no all-reduce, 4 iterations of forward + backward back to back
    tt = tick_tock_schedule(2, 10.0, 20.0, 0.0, steps=2)
    free, contended = schedule_result(tt, 8), schedule_result(tt, 8, contention=True)
    assert free.iteration_us == pytest.approx(70.0)
    assert contended.iteration_us == pytest.approx(4 * 30.0)
    # with an all-reduce, it overlaps the other wave's compute: below the gang-scheduled time
    tt = tick_tock_schedule(2, 10.0, 20.0, 5.0, steps=2)
    r = schedule_result(tt, 8, contention=True)
    assert 4 * 30.0 < r.iteration_us < 4 * 35.0
    lanes = defaultdict(list)
    for i in r.intervals:
        lanes[(i.gpu, i.lane)].append((i.start_us, i.end_us))
    for spans in lanes.values():
        spans.sort()
        assert all(s1 >= e0 - 1e-9 for (_, e0), (s1, _) in zip(spans, spans[1:]))


def test_tree_broadcast_takes_ceil_log2_rounds():
    # 5 GPUs: 3 rounds (1 -> 2 -> 4 -> 5 holders), each one hop of latency + bytes/bandwidth
    assert tree_broadcast_us(1000.0, 5, bytes_per_us=10.0, latency_us=2.0) == 3 * (2.0 + 100.0)
    assert tree_broadcast_us(1000.0, 4, bytes_per_us=10.0, latency_us=2.0) == 2 * 102.0
    assert tree_broadcast_us(1000.0, 1, bytes_per_us=10.0, latency_us=2.0) == 0.0
    with pytest.raises(ValueError, match="p=0"):
        tree_broadcast_us(1.0, 0, bytes_per_us=1.0, latency_us=0.0)


def test_burst_execution_with_overlapped_syncs():
    from tidal.passes.burst_planner import BurstProblem, plan_from_counts
    from tidal.sim.programs import burst_execution

    names = ("a", "b", "c", "d")
    comp = np.array([[40.0, 20.0, 10.0], [30.0, 15.0, 8.0], [20.0, 10.0, 5.0],
                     [10.0, 5.0, 3.0]])
    problem = BurstProblem(names, ((), (0,), (1,), (2,)), comp, np.zeros((4, 3)),
                           act_bytes=np.full(4, 100.0), counts=(1, 2, 4), batch=8,
                           bytes_per_us=1000.0, latency_us=1.0)
    lt = {b: LayerTimes(names, (10.0 * b, 20.0 * b, 5.0 * b, 2.0 * b),
                        (20.0 * b, 40.0 * b, 10.0 * b, 4.0 * b), (8000, 4000, 0, 30000))
          for b in (2, 4, 8)}
    cluster = tidal.Cluster(gpus=4, bandwidth_gbps=8, latency_us=1)
    preds = {"a": [], "b": ["a"], "c": ["b"], "d": ["c"]}
    times = lambda b: lt[b]  # noqa: E731
    # a data-parallel plan runs exactly as data_parallel, buckets and all
    dp_plan = plan_from_counts(problem, [4, 4, 4, 4])
    for cap in (10000.0, 1e9):
        ours = summarize(burst_execution(dp_plan, preds, times, cluster, update_us=3.0,
                                         sync="overlap", bucket_bytes=cap), 4, 8)
        ref = summarize(data_parallel(times, 4, 8, cluster, bucket_bytes=cap, update_us=3.0),
                        4, 8)
        assert ours.iteration_us == pytest.approx(ref.iteration_us)
        assert sorted(i.name for i in ours.intervals if i.name.startswith("AR")) == \
            sorted(i.name for i in ref.intervals if i.name.startswith("AR"))
    # a burst plan: d's all-reduce (4 ranks) overlaps the backward of c, b and a; b on rank 0
    # alone needs none; a's runs on ranks 0-1 after B:a there; nothing is broadcast
    plan = plan_from_counts(problem, [2, 1, 4, 4])
    r = summarize(burst_execution(plan, preds, times, cluster, sync="overlap"), 4, 8)
    iv = {(i.name, i.gpu): i for i in r.intervals}
    ar_d, ar_a = iv[("AR:d..d", 0)], iv[("AR:a..a", 0)]
    assert ar_d.start_us >= max(iv[("B:d", g)].end_us for g in range(4))
    assert ar_d.start_us < iv[("B:b", 0)].end_us  # overlaps later backward
    assert ar_d.end_us - ar_d.start_us == pytest.approx(ring_allreduce_us(30000, 4, 1000.0, 1.0))
    assert ("AR:a..a", 2) not in iv and ar_a.start_us >= iv[("B:a", 1)].end_us
    assert not any(i.name.startswith(("BC", "AR:b")) for i in r.intervals)
    end = summarize(burst_execution(plan, preds, times, cluster), 4, 8)
    assert r.iteration_us < end.iteration_us
    # the runtime cuts a run of buckets where the GPU set changes: c and a (ranks 0-1 around
    # b on rank 0) are two buckets, never one
    split = plan_from_counts(problem, [2, 1, 2, 4])
    assert split.layers[0].ranks == split.layers[2].ranks == (0, 1)
    with_c = {b: LayerTimes(names, t.fwd_us, t.bwd_us, (8000, 4000, 2000, 30000))
              for b, t in lt.items()}
    got = {i.name for i in summarize(burst_execution(split, preds, with_c.__getitem__, cluster,
                                                     sync="overlap"), 4, 8).intervals}
    assert {"AR:a..a", "AR:c..c"} <= got and not any(n.startswith("AR:c..a") for n in got)
    with pytest.raises(ValueError, match="sync='later'"):
        burst_execution(plan, preds, times, cluster, sync="later")


def test_job_utilization_never_rounds_above_one():
    from tidal.sim.collocation import BackgroundJob, job_utilization

    # every layer runs at its best throughput (share 1); summed per layer, forward + backward
    # gives 7.9 + 1e-15 against 7.9 summed per pass: the mean must still be at most 1
    lt = LayerTimes(("a", "b", "c"), (2.5, 2.3, 1.3), (0.9, 1.6, 1.3), (0, 0, 0))
    u = job_utilization(lambda b: lt, 1, probes=(1,))
    assert u == 1.0
    assert BackgroundJob(10.0, 1, u).utilization == 1.0


def _simulate_cli(cli, *args):
    """``tidal simulate vgg16_small ARGS`` from the repository root, in this process
    (conftest.py's ``cli``): its exit status and output."""
    r = cli("simulate", "vgg16_small", *args)
    assert r.returncode == 0, r.stderr
    return r


def test_simulate_cli_burst_with_background_on_a_small_model(cli):
    r = _simulate_cli(cli, "--plan", "burst+bg", "--gpus", "4", "--global-batch", "16")
    assert "burst + background" in r.stdout


def test_wavelet_results_count_steps_of_the_global_batch():
    from tidal.passes.tick_tock import tick_tock_schedule
    from tidal.sim.programs import schedule_result, schedule_steps

    tt = tick_tock_schedule(2, 10.0, 20.0, 0.0, steps=2)  # 4 waves of half the global batch
    assert schedule_steps(tt) == 2
    for contention in (False, True):
        r = schedule_result(tt, 16, contention=contention)
        assert (r.global_batch, r.steps, r.samples) == (16, 2, 32)
        assert r.throughput == pytest.approx(32 / r.iteration_us * 1e6)
        assert "global batch 16: 2 steps in" in r.summary()
    one = summarize(data_parallel(lambda b: LayerTimes(("a",), (1.0,), (2.0,), (0,)), 1, 8),
                    1, 8)
    assert one.steps == 1 and "global batch 8: iteration" in one.summary()


def test_simulate_cli_tick_tock_prints_the_global_batch_it_was_given(cli):
    r = _simulate_cli(cli, "--plan", "tick_tock", "--gpus", "2", "--global-batch", "16")
    lines = [line for line in r.stdout.splitlines() if line.startswith("  tick_tock")]
    assert len(lines) == 2 and all("global batch 16: 2 steps in" in line for line in lines)
    assert "global batch 32" not in r.stdout


def _rank_programs():
    """Two ranks' own programs: rank 0 computes, sends ``x`` to rank 1 and loads weights; its
    tick and tock waves compute on their own streams; ``solo`` is a comm piece of rank 0 only."""
    from tidal.runtime.program import Piece, Program

    p0 = Program((Piece("f", "compute"), Piece("x", "comm", (0,)), Piece("w", "load"),
                  Piece("tick", "tick", (2,)), Piece("tock", "tock", (2,)),
                  Piece("solo", "comm", (3,)), Piece("opt", "compute", (1, 3, 4, 5))), world=2)
    p1 = Program((Piece("x", "comm"), Piece("g", "compute", (0,))), world=2)
    return {0: p0, 1: p1}


def test_join_ranks_of_per_rank_programs():
    from tidal.sim.programs import join_ranks

    us = {"f": 5.0, "x": 2.0, "w": 3.0, "tick": 4.0, "tock": 4.0, "solo": 1.0, "opt": 1.0,
          "g": 6.0}
    placed = join_ranks(_rank_programs(), lambda rank, name: us[name])
    by = {(p.name, p.ranks): p for p in placed.pieces}
    assert lane_of(by[("x", (0, 1))]) == "link" and lane_of(by[("solo", (0,))]) == "link"
    assert lane_of(by[("w", (0,))]) == "h2d" and lane_of(by[("tick", (0,))]) == "tick"
    r = summarize(placed, 2, 2)
    iv = {(i.name, i.gpu): i for i in r.intervals}
    assert iv[("x", 1)].start_us == iv[("x", 0)].start_us == 5.0  # one transfer on both links
    assert iv[("g", 1)].start_us == 7.0
    assert iv[("w", 0)].start_us == 0.0  # the weight load overlaps compute and the network
    # the waves' streams are separate compute lanes of rank 0: they overlap each other and f;
    # busy is the union of rank 0's compute (f 0-5, the waves 3-7, opt 8-9)
    assert iv[("tick", 0)].start_us == iv[("tock", 0)].start_us == 3.0
    assert iv[("opt", 0)].start_us == 8.0 and r.busy_us[0] == pytest.approx(7 + 1)
    # one Program for every rank: each comm piece is one collective of all ranks, timed by the
    # rank that waited least
    p = Program((Piece("b", "compute"), Piece("ar", "comm", (0,)),
                 Piece("opt", "compute", (0, 1))), world=3)
    placed = join_ranks(p, lambda rank, name: {"b": 1 + rank, "ar": 9 - rank, "opt": 1}[name])
    assert [(q.name, q.ranks, q.duration_us) for q in placed.pieces
            if q.kind == "collective"] == [("ar", (0, 1, 2), 7.0)]
    assert max(i.end_us for i in simulate(placed)) == 3.0 + 7.0 + 1.0
    # collectives the ranks order differently would hang: named, never simulated
    swapped = {0: Program((Piece("a", "comm"), Piece("b", "comm")), 2),
               1: Program((Piece("b", "comm"), Piece("a", "comm")), 2)}
    with pytest.raises(ValueError, match="rank 0 waits at piece 0 'a'.*rank 1 .* 0 'b'"):
        join_ranks(swapped, lambda rank, name: 1.0)
    with pytest.raises(ValueError, match="cannot use lane 'link'"):
        simulate(Program((Piece("x", "link", duration_us=1.0, ranks=(0,)),)))


def test_simulated_order_of_per_rank_programs_matches_the_runtime_trace():
    from tidal.runtime.program import ProgramRunner
    from tidal.sim.programs import simulated_order, trace_order

    programs = _rank_programs()
    traces = {}
    for rank, program in programs.items():  # one rank at a time: its comm pieces do nothing
        with ProgramRunner() as run:
            traces[rank] = run.launch(program, lambda i, piece: lambda: None)
    order = simulated_order(programs, traces)
    assert order == trace_order(traces)
    assert order[0] == {"comm": ["x", "solo"], "compute": ["f", "opt"], "load": ["w"],
                        "tick": ["tick"], "tock": ["tock"]}
    with pytest.raises(ValueError, match=r"no trace for rank\(s\) \[1\]"):
        simulated_order(programs, {0: traces[0]})


@pytest.mark.parametrize("n,m", [(2, 2), (4, 4), (3, 6)])
def test_pipeline_schedules_simulate_to_the_textbook_makespan(n, m):
    # the engine runs GPipe's and 1F1B's own schedule objects (SEND/RECV pairs as one transfer
    # on both ranks' links, zero-length here): (M + N - 1) x (F + B) either way
    from tidal.ir.pipeline_schedules import gpipe, one_f_one_b
    from tidal.ir.schedule import schedule_program
    from tidal.sim.programs import schedule_result

    for build in (gpipe, one_f_one_b):
        schedule = build(n, m, fwd_us=10.0, bwd_us=20.0)
        program = schedule_program(schedule)
        sends = sum(a.kind == "SEND" for acts in schedule.ranks for a in acts)
        assert sum(p.name.startswith("SEND") or p.name.startswith("RECV")
                   for p in program.pieces) == sends  # each pair is one piece
        r = schedule_result(schedule, m, contention=True)
        assert r.iteration_us == pytest.approx((m + n - 1) * 30.0), build.__name__


def test_data_parallel_buckets_are_the_one_bucket_rule():
    # the simulator's data-parallel all-reduces are the buckets of
    # tidal.ir.comm_cost.gradient_buckets over the layers' gradients in backward order (layers
    # without parameters sync nothing), each after its last layer's backward on every GPU
    from tidal.ir.comm_cost import gradient_buckets

    lt = _random_layers(random.Random(7), 20)
    cap = 1.5e6
    program = data_parallel(lambda b: lt, 4, 16, tidal.Cluster(gpus=4), bucket_bytes=cap)
    want = gradient_buckets([("all", n, b) for n, b in zip(reversed(lt.names),
                                                           reversed(lt.param_bytes))], cap)
    syncs = [p for p in program.pieces if p.kind == "collective"]
    assert [p.name for p in syncs] == [f"AR:{names[0]}..{names[-1]}" for _, names in want]
    for p, (_, names) in zip(syncs, want):
        assert p.ranks == (0, 1, 2, 3)
        assert sorted(program.pieces[d].ranks[0] for d in p.deps) == [0, 1, 2, 3]
        assert {program.pieces[d].name for d in p.deps} == {f"B:{names[-1]}"}

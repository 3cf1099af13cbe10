"""Cluster simulator: engine semantics, collective times, data-parallel programs."""
import random
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import tidal
from tidal.ir.comm_cost import all_to_all_us, ring_allreduce_us
from tidal.runtime.sim.engine import Task, simulate
from tidal.runtime.sim.programs import LayerTimes, data_parallel, layer_times, summarize


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
    (ar,) = [t for t in data_parallel(lambda b: lt, 2, 4, cluster) if t.kind == "comm"]
    assert ar.name == "AR:b..a" and ar.duration_us == pytest.approx(
        ring_allreduce_us(2e6, 2, 1000.0, 0))


def test_engine_rejects_forward_dependencies_and_bad_tasks():
    with pytest.raises(ValueError, match="not earlier"):
        simulate([Task("x", "j", "compute", (0,), 1.0, deps=(0,))])
    with pytest.raises(ValueError, match="exactly one GPU"):
        Task("x", "j", "compute", (0, 1), 1.0)
    with pytest.raises(ValueError, match="divisible"):
        data_parallel(lambda b: _random_layers(random.Random(0), 2), 3, 8)


def test_layer_times_from_a_traced_model_use_the_profile():
    from examples.models import ZOO
    from tidal.compiler.capture import trace
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


def test_simulate_cli_prints_simulated_summary_and_rejects_bad_batch():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    run = lambda *a: subprocess.run([sys.executable, "-m", "tidal", "simulate", *a], cwd=root,
                                    capture_output=True, text=True, timeout=300)
    trace = Path(__import__("tempfile").mkdtemp()) / "t.json"
    r = run("vgg16_small", "--gpus", "4", "--global-batch", "16", "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    assert "simulated (not measured)" in r.stdout and "4 GPUs" in r.stdout
    events = __import__("json").loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1, 2, 3}
    r = run("vgg16_small", "--gpus", "3", "--global-batch", "16")
    assert r.returncode == 2 and "not divisible" in r.stderr


def test_collocation_fills_idle_time_and_slows_foreground():
    from tidal.runtime.sim.collocation import BackgroundJob, collocate

    lt = LayerTimes(("a", "b"), (10.0, 30.0), (20.0, 60.0), (0, 0))
    tasks = data_parallel(lambda b: lt, 1, 4)
    alone = summarize(tasks, 1, 4)
    r = collocate(tasks, 1, 4, BackgroundJob(iteration_us=5.0, batch=2), interference=1.1)
    assert r.foreground.iteration_us == pytest.approx(1.1 * alone.iteration_us)
    assert r.bg_samples_per_iteration == 0.0  # one busy GPU leaves nothing to pack
    # two GPUs with uneven work: the idle one runs background iterations
    uneven = [Task("x", "fg", "compute", (0,), 100.0), Task("y", "fg", "compute", (1,), 40.0)]
    r = collocate(uneven, 2, 8, BackgroundJob(iteration_us=20.0, batch=3))
    assert r.bg_samples_per_iteration == pytest.approx(60.0 / 20.0 * 3)
    assert r.cluster_throughput == pytest.approx(8 / 100e-6 + 9 / 100e-6)
    with pytest.raises(ValueError, match="interference"):
        collocate(uneven, 2, 8, BackgroundJob(20.0, 3), interference=0.5)


def test_burst_plan_simulation_matches_the_planner_on_a_chain():
    from examples.models import ZOO
    from tidal.ir import layer_graph
    from tidal.runtime.sim.programs import burst_parallel

    model = ZOO["vgg16_small"]()
    x = model.example_inputs(8)
    cluster = tidal.Cluster(gpus=4, bandwidth_gbps=100, latency_us=5, peak_tflops=0.05)
    compiled = tidal.compile(model, x, passes=["burst_parallel"], cluster=cluster,
                             amp_limit=4.0)
    plan = compiled.plan.get("burst_parallel")
    lg = layer_graph.build(compiled.graph_module)
    preds = {n: list(lg.predecessors(n)) for n in lg.nodes}
    r = summarize(burst_parallel(plan, preds), 4, 8)
    assert r.iteration_us == pytest.approx(plan.time_us, rel=1e-6)
    # GPUs outside a layer's set are idle during it: busy time is the plan's GPU time
    busy = sum(p.comp_us * p.gpus for p in plan.layers)
    assert sum(r.busy_us) == pytest.approx(busy)


def test_wavelet_schedules_become_timelines():
    from tidal.ir.schedule import Action, Schedule
    from tidal.runtime.sim.programs import schedule_result

    acts = (Action("F", 0, wave="T", lane="T", start_us=0, dur_us=10),
            Action("F", 1, wave="K", lane="K", start_us=10, dur_us=10),
            Action("B", 0, wave="T", lane="T", start_us=10, dur_us=20),
            Action("A", 0, wave="T", lane="T", start_us=30, dur_us=5))
    r = schedule_result(Schedule("toy", ranks=(acts, acts), batches=2, data_parallel=True), 8)
    assert r.iteration_us == 35.0
    assert r.busy_us == (30.0, 30.0)  # overlapping waves count once
    assert {i.lane for i in r.intervals if i.name.endswith("A0")} == {"link"}


@pytest.mark.parametrize("plan", ["round_robin", "tick_tock"])
def test_simulate_cli_wavelet_plans(plan):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "tidal", "simulate", "vgg16_small", "--gpus", "2",
                        "--global-batch", "8", "--plan", plan], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"  {plan}" in r.stdout and "rank 1:" in r.stdout


def test_scaling_strategies_and_steps_table(tmp_path):
    from tidal.runtime.sim.scaling import StepsTable, scaling_speedups

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


def test_simulate_cli_scaling_chart(tmp_path):
    import subprocess
    import sys

    (tmp_path / "steps.csv").write_text("8,1000\n64,200\n512,100\n")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "tidal", "simulate", "vgg16_small", "--gpus", "4",
                        "--global-batch", "16", "--scaling", str(tmp_path / "steps.csv"),
                        "--scaling-svg", str(tmp_path / "s.svg")], cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "batch-optimal" in r.stdout and "<polyline" in (tmp_path / "s.svg").read_text()

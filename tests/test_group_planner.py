"""The grouping planner: PipeSwitch's search, tidal's fast solver and brute force agree."""
import random

import pytest

from tidal.ir.plan import Plan
from tidal.ir.plans.layer_groups import LayerGroupPlan, timeline
from tidal.passes.group_planner import (
    SearchBudgetExceeded, brute_force, dp_grouping, make_plan, optimal_grouping, per_layer, pipeline_time,
    pipeswitch_search, single_group,
)


def _instance(seed, n):
    r = random.Random(seed)
    kind = seed % 3  # transfer-bound, execution-bound, mixed
    scale_b, scale_e = [(1e5, 10.0), (1e3, 500.0), (3e4, 100.0)][kind]
    layer_bytes = [r.choice([0, int(r.uniform(0, scale_b)), int(r.uniform(0, 10 * scale_b))])
                   for _ in range(n)]
    exec_us = [r.choice([0.0, r.uniform(0, scale_e), r.uniform(0, 5 * scale_e)])
               for _ in range(n)]
    return layer_bytes, exec_us, dict(bytes_per_us=r.uniform(50, 2000),
                                      overhead_us=r.choice([0.0, r.uniform(0, 50)]))


def _close(a, b):
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


@pytest.mark.parametrize("seed", range(300))
def test_fast_and_pipeswitch_match_brute_force(seed):
    layer_bytes, exec_us, kw = _instance(seed, 1 + seed % 12)
    best = brute_force(layer_bytes, exec_us, **kw)
    fast = optimal_grouping(layer_bytes, exec_us, **kw)
    ref = pipeswitch_search(layer_bytes, exec_us, **kw)
    dp = dp_grouping(layer_bytes, exec_us, **kw)
    assert _close(dp.time_us, best.time_us), (dp, best)
    assert _close(fast.time_us, best.time_us), (fast, best)
    assert _close(ref.time_us, best.time_us), (ref, best)
    # the reported time is the true time of the reported grouping
    assert _close(pipeline_time(fast.groups, layer_bytes, exec_us, **kw), fast.time_us)
    assert _close(pipeline_time(ref.groups, layer_bytes, exec_us, **kw), ref.time_us)


def _model_like(seed, n):
    """Layers shaped like a CNN/transformer: many weight-free layers, log-normal sizes."""
    r = random.Random(seed)
    layer_bytes = [int(r.lognormvariate(10, 2)) if r.random() < 0.6 else 0 for _ in range(n)]
    exec_us = [r.lognormvariate(3, 1) for _ in range(n)]
    return layer_bytes, exec_us, dict(bytes_per_us=r.uniform(500, 20000),
                                      overhead_us=r.uniform(1, 20))


@pytest.mark.parametrize("seed", range(40))
def test_fast_dp_and_pipeswitch_agree_on_larger_instances(seed):
    layer_bytes, exec_us, kw = _model_like(seed, 13 + seed)
    fast = optimal_grouping(layer_bytes, exec_us, **kw)
    dp = dp_grouping(layer_bytes, exec_us, **kw)
    assert _close(fast.time_us, dp.time_us), (fast, dp)
    try:  # Algorithm 1 is exponential on some instances: compare where it finishes
        ref = pipeswitch_search(layer_bytes, exec_us, max_calls=30_000, **kw)
    except SearchBudgetExceeded:
        assert seed >= 10, "Algorithm 1 should finish on the smaller instances"
        return
    assert _close(fast.time_us, ref.time_us), (fast.time_us, ref.time_us)


@pytest.mark.parametrize("seed", range(20))
def test_fast_matches_dp_on_model_sized_instances(seed):
    layer_bytes, exec_us, kw = (_instance if seed % 2 else _model_like)(500 + seed, 150 + 10 * seed)
    fast = optimal_grouping(layer_bytes, exec_us, **kw)
    dp = dp_grouping(layer_bytes, exec_us, **kw)
    assert _close(fast.time_us, dp.time_us), (fast, dp)


def test_each_pruning_alone_is_exact_and_prunes():
    layer_bytes, exec_us, kw = _instance(7, 11)
    best = brute_force(layer_bytes, exec_us, **kw).time_us
    calls = {}
    for p1 in (False, True):
        for p2 in (False, True):
            g = pipeswitch_search(layer_bytes, exec_us, prune_bound=p1, prune_hidden=p2, **kw)
            assert _close(g.time_us, best)
            calls[p1, p2] = g.visited
    assert calls[True, True] <= min(calls[True, False], calls[False, True])
    assert calls[True, True] < calls[False, False]


def test_extremes_pick_the_obvious_grouping():
    # transfers negligible, heavy per-transfer overhead: one group is optimal
    g = optimal_grouping([10] * 6, [100.0] * 6, bytes_per_us=1e6, overhead_us=1000.0)
    assert g.groups == single_group(6)
    # no overhead, transfer equal to execution per layer: per-layer pipelining is optimal
    g = optimal_grouping([100] * 5, [1.0] * 5, bytes_per_us=100.0, overhead_us=0.0)
    assert g.time_us == pytest.approx(6.0)
    assert pipeline_time(per_layer(5), [100] * 5, [1.0] * 5, 100.0, 0.0) == pytest.approx(6.0)


def test_timeline_respects_link_order_and_dependencies():
    layer_bytes, exec_us, kw = _instance(3, 9)
    groups = optimal_grouping(layer_bytes, exec_us, **kw).groups
    times = timeline(groups, layer_bytes, exec_us, kw["bytes_per_us"], kw["overhead_us"])
    for prev, cur in zip(times, times[1:]):
        assert cur.tx_start == prev.tx_end
        assert cur.ex_start >= max(cur.tx_end, prev.ex_end)


def test_bad_input_is_a_value_error():
    for bw in (0, -1.0):
        with pytest.raises(ValueError, match="bandwidth"):
            optimal_grouping([1], [1.0], bytes_per_us=bw, overhead_us=0.0)
        with pytest.raises(ValueError, match="bandwidth"):
            pipeswitch_search([1], [1.0], bytes_per_us=bw, overhead_us=0.0)
    with pytest.raises(ValueError, match="exec_us\\[1\\]"):
        optimal_grouping([1, 2], [1.0, -2.0], bytes_per_us=1.0, overhead_us=0.0)
    with pytest.raises(ValueError, match="2 layers"):
        optimal_grouping([1, 2], [1.0], bytes_per_us=1.0, overhead_us=0.0)
    with pytest.raises(ValueError, match="cover"):
        pipeline_time(((0, 0),), [1, 2], [1.0, 1.0], 1.0, 0.0)


def test_plan_round_trips_and_prints_its_table():
    layer_bytes, exec_us, kw = _instance(5, 8)
    plan = make_plan([f"l{i}" for i in range(8)], layer_bytes, exec_us, **kw)
    again = Plan.from_json(plan.to_json())
    assert isinstance(again, LayerGroupPlan) and again == plan
    table = plan.table()
    assert table.splitlines()[0].split()[:3] == ["group", "layers", "bytes"]
    assert len(table.splitlines()) == 2 + len(plan.groups) + 1
    assert plan.total_us <= min(plan.per_layer_us, plan.single_group_us) + 1e-9
    ref = make_plan([f"l{i}" for i in range(8)], layer_bytes, exec_us, algorithm="pipeswitch",
                    **kw)
    assert _close(ref.total_us, plan.total_us)

"""DeepPool's Figure 9 scenarios for one compiled model: data parallel (DP), burst parallel (BP)
and burst parallel with a background job collocated on every GPU (BP+Col), all simulated.

The scenarios start from what ``tidal.compile(..., passes=["burst_parallel"])`` made (the graph
and its ``BurstPlan``): the simulator never compiles (``tidal.compiler.sim_scenarios`` compiles
a model and calls :func:`simulate_fig9`).

Example (tiny model, FLOP-derived times):
    >>> import torch, tidal
    >>> from tidal.sim.scenarios import simulate_fig9
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    >>> cluster = tidal.Cluster(gpus=2, peak_tflops=0.001)
    >>> c = tidal.compile(model, (torch.randn(8, 64),), passes=["burst_parallel"], cluster=cluster,
    ...                   sync="paper")
    >>> s = simulate_fig9(c.graph_module, c.plan.get("burst_parallel"), cluster, batch=8)
    >>> sorted(s)
    ['bg_only', 'bp', 'bp_col', 'bp_col_sm', 'bp_overlap', 'dp', 'dp_planner', 'fallback', 'single']
"""
from __future__ import annotations

import functools
from typing import Any

import torch.fx as fx

from tidal.ir import layer_graph
from tidal.ir.cluster import Cluster
from tidal.ir.plans.burst import BurstPlan
from tidal.sim.collocation import BackgroundJob, collocate, job_utilization, kernel_utilization
from tidal.sim.programs import (burst_execution, burst_parallel, data_parallel, layer_times,
                                output_bytes, summarize)


def simulate_fig9(gm: fx.GraphModule, plan: BurstPlan, cluster: Cluster, batch: int, *,
                  bg_batch: int = 8, interference: float = 1.1) -> dict[str, Any]:
    """Simulated throughputs (samples/s) of one iteration of ``gm`` at global ``batch`` under
    the ``burst_parallel`` pass's ``plan`` (made for ``cluster``):
    ``single`` (one GPU), ``dp`` (DDP-style: bucketed all-reduces overlapping backward),
    ``dp_planner`` (data parallelism under the planner's model, where each layer's
    synchronization follows it without overlap, as DeepPool §4 assumes), ``bp`` (the plan under
    that model), ``bp_overlap`` (the same plan run as a training step: all forwards, then all
    backwards, each layer's gradients all-reduced on its ranks in DDP-style buckets that overlap
    the rest of backward, ``burst_execution(..., sync="overlap")``; on a data-parallel plan this
    is ``dp``), ``bp_col`` (a dict with ``fg``, ``bg`` and ``cluster`` throughput when the same
    model at ``bg_batch`` runs in every GPU's idle time of ``bp_overlap``, the foreground slowed
    by ``interference``), ``bp_col_sm`` (the same, the background also using the GPU capacity
    each foreground piece leaves unused: the SM-sharing bound of ``tidal.sim.collocation``) and
    ``bg_only`` (the background alone on every GPU); ``fallback`` says whether the planner chose
    data parallelism."""
    # per-GPU batch -> layer times, computed once: the utilization probes ask for many batches
    times = functools.lru_cache(maxsize=None)(lambda b: layer_times(gm, cluster, b))
    single = summarize(data_parallel(times, 1, batch, cluster), 1, batch)
    dp = summarize(data_parallel(times, cluster.gpus, batch, cluster), cluster.gpus, batch)
    lg = layer_graph.build(gm)
    preds = {n: list(lg.predecessors(n)) for n in lg.nodes}
    bp = summarize(burst_parallel(plan, preds), cluster.gpus, batch)
    tasks = burst_execution(plan, preds, times, cluster, output_bytes(gm), sync="overlap")
    bp_overlap = summarize(tasks, cluster.gpus, batch)
    bg_iter = summarize(data_parallel(times, 1, bg_batch, cluster), 1, bg_batch).iteration_us
    bg = BackgroundJob(bg_iter, bg_batch, job_utilization(times, bg_batch))
    col = collocate(tasks, cluster.gpus, batch, bg, interference)
    col_sm = collocate(tasks, cluster.gpus, batch, bg, interference,
                       fg_utilization=_plan_utilization(plan, times, batch))
    return {"single": single.throughput, "dp": dp.throughput, "bp": bp.throughput,
            "bp_overlap": bp_overlap.throughput,
            "dp_planner": batch / plan.dp_time_us * 1e6,
            "bp_col": {"fg": col.foreground.throughput, "bg": col.bg_throughput,
                       "cluster": col.cluster_throughput},
            "bp_col_sm": {"fg": col_sm.foreground.throughput, "bg": col_sm.bg_throughput,
                          "cluster": col_sm.cluster_throughput},
            "bg_only": bg.solo_throughput(cluster.gpus), "fallback": plan.fallback}


def _plan_utilization(plan: BurstPlan, times, batch: int) -> dict[str, float]:
    """The GPU share each forward (``F:layer``) and backward (``B:layer``) piece of ``plan``
    uses at its per-GPU batch."""
    per_batch = {b: kernel_utilization(times, b)
                 for b in {-(-batch // p.gpus) for p in plan.layers}}
    util: dict[str, float] = {}
    for p in plan.layers:
        f, b = per_batch[-(-batch // p.gpus)].get(p.layer, (1.0, 1.0))
        util[f"F:{p.layer}"], util[f"B:{p.layer}"] = f, b
    return util

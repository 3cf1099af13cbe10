"""DeepPool's Figure 9 scenarios for one model: data parallel (DP), burst parallel (BP) and
burst parallel with a background job collocated on every GPU (BP+Col), all simulated.

Example (tiny model, FLOP-derived times):
    >>> import torch, tidal
    >>> from tidal.sim.scenarios import fig9_scenarios
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    >>> s = fig9_scenarios(model, (torch.randn(8, 64),), tidal.Cluster(gpus=2, peak_tflops=0.001))
    >>> sorted(s)
    ['bg_only', 'bp', 'bp_col', 'bp_col_sm', 'bp_overlap', 'dp', 'dp_planner', 'fallback', 'single']
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from tidal.ir.cluster import Cluster


def fig9_scenarios(model: torch.nn.Module, inputs: Sequence[Any], cluster: Cluster, *,
                   bg_batch: int = 8, interference: float = 1.1, leaf_modules=(),
                   **burst_options: Any) -> dict[str, Any]:
    """Simulated throughputs (samples/s) of one iteration at the inputs' global batch:
    ``single`` (one GPU), ``dp`` (DDP-style: bucketed all-reduces overlapping backward),
    ``dp_planner`` (data parallelism under the planner's model, where each layer's
    synchronization follows it without overlap, as DeepPool §4 assumes), ``bp`` (the
    burst_parallel pass's plan under that model), ``bp_overlap`` (the same plan run as a
    training step: all forwards, then all backwards, each layer's gradients all-reduced on its
    ranks in DDP-style buckets that overlap the rest of backward, ``burst_execution(...,
    sync="overlap")``; on a data-parallel plan this is ``dp``),
    ``bp_col`` (a dict with ``fg``, ``bg`` and ``cluster`` throughput when the same model at
    ``bg_batch`` runs in every GPU's idle time of ``bp_overlap``, the foreground slowed by
    ``interference``), ``bp_col_sm`` (the same, the background also using the GPU capacity each
    foreground piece leaves unused: the SM-sharing bound of ``tidal.sim.collocation``)
    and ``bg_only`` (the
    background alone on every GPU); ``fallback`` says whether the planner chose data
    parallelism. The plan is made under DeepPool's model of gradient sync, one all-reduce per
    layer (``burst_parallel(sync="paper")``), unless ``burst_options`` say otherwise."""
    import tidal
    from tidal.ir import layer_graph
    from tidal.ir.cost import example_batch
    from tidal.sim.collocation import (BackgroundJob, collocate, job_utilization,
                                       kernel_utilization)
    from tidal.sim.programs import (burst_execution, burst_parallel, data_parallel,
                                    layer_times, output_bytes, summarize)

    batch = example_batch(inputs)
    burst_options = {"sync": "paper", **burst_options}  # DeepPool §4's planning model
    compiled = tidal.compile(model, inputs, passes=["burst_parallel"], cluster=cluster,
                             leaf_modules=leaf_modules, **burst_options)
    gm = compiled.graph_module
    # per-GPU batch -> layer times, computed once: the utilization probes ask for many batches
    times = functools.lru_cache(maxsize=None)(lambda b: layer_times(gm, cluster, b))
    single = summarize(data_parallel(times, 1, batch, cluster), 1, batch)
    dp = summarize(data_parallel(times, cluster.gpus, batch, cluster), cluster.gpus, batch)
    plan = compiled.plan.get("burst_parallel")
    lg = layer_graph.build(gm)
    preds = {n: list(lg.predecessors(n)) for n in lg.nodes}
    bp = summarize(burst_parallel(plan, preds), cluster.gpus, batch)
    tasks = burst_execution(plan, preds, times, cluster, output_bytes(gm), sync="overlap")
    bp_overlap = summarize(tasks, cluster.gpus, batch)
    bg_iter = summarize(data_parallel(times, 1, bg_batch, cluster), 1, bg_batch).iteration_us
    bg = BackgroundJob(bg_iter, bg_batch, job_utilization(times, bg_batch))
    col = collocate(tasks, cluster.gpus, batch, bg, interference)
    per_batch = {b: kernel_utilization(times, b)
                 for b in {-(-batch // p.gpus) for p in plan.layers}}
    util: dict[str, float] = {}
    for p in plan.layers:
        f, b = per_batch[-(-batch // p.gpus)].get(p.layer, (1.0, 1.0))
        util[f"F:{p.layer}"], util[f"B:{p.layer}"] = f, b
    col_sm = collocate(tasks, cluster.gpus, batch, bg, interference, fg_utilization=util)
    return {"single": single.throughput, "dp": dp.throughput, "bp": bp.throughput,
            "bp_overlap": bp_overlap.throughput,
            "dp_planner": batch / plan.dp_time_us * 1e6,
            "bp_col": {"fg": col.foreground.throughput, "bg": col.bg_throughput,
                       "cluster": col.cluster_throughput},
            "bp_col_sm": {"fg": col_sm.foreground.throughput, "bg": col_sm.bg_throughput,
                          "cluster": col_sm.cluster_throughput},
            "bg_only": bg.solo_throughput(cluster.gpus), "fallback": plan.fallback}

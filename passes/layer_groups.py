"""The ``layer_groups`` pass: PipeSwitch's optimal layer grouping for pipelined weight loading.

The forward graph is cut into layers in topological (graph) order: every module call and every
``get_attr`` of a parameter or buffer starts a layer, and the function/method nodes after it
belong to it (PipeSwitch counts layers the same way, by module calls: 464 for ResNet-152).
Each layer gets its weight bytes (``param_bytes + buffer_bytes`` of the cost annotation, a
module counted once) and its forward time (:func:`tidal.ir.cost.node_time_us`, profile-aware).
With ``T(i, j) = overhead + bytes / bandwidth`` the planner (:mod:`.group_planner`) picks the
grouping whose pipelined transfer + execution finishes first, and the pass inserts a
``tidal::group_boundary(k)`` marker before the first node of each group. Without a weight
loader the markers do nothing, so the graph computes exactly what the model computes; under
:func:`tidal.runtime.programs.layer_groups.run_pipelined` each group's compute waits for
its load.

Options: ``group_bandwidth_gbps`` (link, default the cluster's ``bandwidth_gbps``),
``group_overhead_us`` (per transfer, default the cluster's ``latency_us``), ``grouping``
(``optimal``, ``per_layer`` or ``single``), ``group_algorithm`` (``fast``, ``dp`` or ``pipeswitch``)
and ``weight_store`` (a store path: the compiled model's first call streams its weights in).

Example:
    >>> import torch, tidal
    >>> from tidal.passes.layer_groups import LayerGroups
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    >>> x = torch.randn(2, 64)
    >>> c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer")])
    >>> [n.args for n in c.graph_module.graph.nodes if n.op == "call_function"]
    [(0,), (1,), (2,)]
    >>> torch.equal(c(x), model(x))
    True
"""
from __future__ import annotations

import dataclasses

from typing import Optional

import torch.fx as fx

from tidal.ir import cost, meta, ops
from tidal.ir.cluster import Cluster
from tidal.ir.pass_api import Pass, PassContext, PassResult
from tidal.ir.plans.layer_groups import LayerGroupPlan
from tidal.ir.plot import Bar, Row, color, gantt_chart
from tidal.passes.group_planner import SOLVERS, make_plan, per_layer, single_group

_STRUCTURAL = ("placeholder", "output")


def _starts_layer(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return True
    c = meta.get_cost(n)
    return n.op == "get_attr" and c is not None and (c.param_bytes + c.buffer_bytes) > 0


def split_layers(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The graph's nodes (placeholders and output excluded) cut into layers in graph order:
    each module call or weight ``get_attr`` starts a layer; nodes before the first one join it."""
    layers: list[list[fx.Node]] = []
    pending: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op in _STRUCTURAL:
            continue
        if _starts_layer(gm, n) or not (layers or pending):
            layers.append(pending + [n])
            pending = []
        elif layers:
            layers[-1].append(n)
        else:
            pending.append(n)
    if pending:
        layers.append(pending)
    return layers


def layer_costs(gm: fx.GraphModule, layers: list[list[fx.Node]], batch: int, cluster: Cluster
                ) -> tuple[list[str], list[int], list[float]]:
    """Name, weight bytes and forward time (us) of each layer; a module's or attribute's
    bytes count at its first use only."""
    names, nbytes, times, seen = [], [], [], set()
    node_us = cost.node_times_us(gm, batch, cluster)
    for layer in layers:
        b = 0
        t = 0.0
        for n in layer:
            c = meta.get_cost(n)
            if c is not None and n.op in ("call_module", "get_attr") and n.target not in seen:
                seen.add(n.target)
                b += c.param_bytes + c.buffer_bytes
            t += node_us[n.name][0]
        first = layer[0]
        names.append(str(first.target) if first.op in ("call_module", "get_attr") else first.name)
        nbytes.append(b)
        times.append(t)
    return names, nbytes, times


class LayerGroups(Pass):
    """Groups layers for pipelined weight transmission (PipeSwitch) and marks each group's
    first node with ``tidal::group_boundary(k)``."""

    name = "layer_groups"

    def __init__(self, group_bandwidth_gbps: Optional[float] = None,
                 group_overhead_us: Optional[float] = None, grouping: str = "optimal",
                 group_algorithm: str = "fast", weight_store: Optional[str] = None):
        if group_bandwidth_gbps is not None and not group_bandwidth_gbps > 0:
            raise ValueError(f"layer_groups: group_bandwidth_gbps={group_bandwidth_gbps!r} "
                             "must be > 0")
        if group_overhead_us is not None and not group_overhead_us >= 0:
            raise ValueError(f"layer_groups: group_overhead_us={group_overhead_us!r} "
                             "must be >= 0")
        if grouping not in ("optimal", "per_layer", "single"):
            raise ValueError(f"layer_groups: grouping={grouping!r}: expected 'optimal', "
                             "'per_layer' or 'single'")
        if group_algorithm not in SOLVERS:
            raise ValueError(f"layer_groups: group_algorithm={group_algorithm!r}: expected "
                             f"one of {sorted(SOLVERS)}")
        self.bandwidth_gbps = group_bandwidth_gbps
        self.overhead_us = group_overhead_us
        self.grouping = grouping
        self.algorithm = group_algorithm
        self.weight_store = weight_store

    def requires(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        if any(n.target is ops.GROUP_BOUNDARY for n in gm.graph.nodes):
            self.fail("the graph already has group_boundary markers")
        if not any(n.op not in _STRUCTURAL for n in gm.graph.nodes):
            self.fail("the graph has no nodes to group")

    def ensures(self, gm: fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        marks = [n.args[0] for n in gm.graph.nodes if n.target is ops.GROUP_BOUNDARY]
        if marks != list(range(len(result.plan.groups))):
            self.fail(f"markers {marks} do not number the {len(result.plan.groups)} groups")

    def plan(self, gm: fx.GraphModule, ctx: PassContext) -> tuple[list[list[fx.Node]],
                                                                  LayerGroupPlan]:
        """The layers of ``gm`` and the grouping plan for them (no graph change)."""
        cluster = ctx.cluster
        bw_gbps = self.bandwidth_gbps if self.bandwidth_gbps is not None \
            else cluster.bandwidth_gbps
        oh = self.overhead_us if self.overhead_us is not None else cluster.latency_us
        layers = split_layers(gm)
        names, nbytes, times = layer_costs(gm, layers, ctx.batch_size, cluster)
        plan = make_plan(names, nbytes, times, bytes_per_us=bw_gbps * 1e3 / 8,
                         overhead_us=oh, strategy=self.grouping, algorithm=self.algorithm)
        return layers, plan

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        layers, plan = self.plan(gm, ctx)
        for k, (first, _) in enumerate(plan.groups):
            with gm.graph.inserting_before(layers[first][0]):
                gm.graph.call_function(ops.GROUP_BOUNDARY, (k,))
        gm.recompile()
        if self.weight_store:
            plan = dataclasses.replace(plan, weight_store=str(self.weight_store))
        svg = timeline_svg(plan)
        notes = (f"{len(plan.groups)} groups over {len(plan.layers)} layers; predicted "
                 f"{plan.total_us:.1f} us vs per-layer {plan.per_layer_us:.1f} us and one "
                 f"group {plan.single_group_us:.1f} us",)
        return PassResult(gm, plan=plan, artifacts={"layer_groups_timeline.svg": svg},
                          notes=notes)


def timeline_svg(plan: LayerGroupPlan, width: int = 900) -> str:
    """A two-lane (transfer, execution) timeline of the plan's grouping beside the per-layer
    and single-group pipelines, as SVG text: one heading per pipeline with its predicted
    total, then its transfer and execute lanes with one bar per group."""
    n = len(plan.layers)
    pipelines = [(f"{plan.strategy} ({len(plan.groups)} groups)", plan.times),
                 (f"per-layer ({n} groups)", plan.timeline_of(per_layer(n))),
                 ("one group", plan.timeline_of(single_group(n)))]
    span = max(plan.total_us, plan.per_layer_us, plan.single_group_us) or 1.0
    rows: list[Row] = []
    for title, times in pipelines:
        rows.append(Row(f"{title}: {times[-1].ex_end:.0f} us", heading=True))
        for lane, spans in (("transfer", [(t.tx_start, t.tx_end) for t in times]),
                            ("execute", [(t.ex_start, t.ex_end) for t in times])):
            bars = tuple(Bar(a, b, color(k), title=f"group {k}: {a:.1f}-{b:.1f} us")
                         for k, (a, b) in enumerate(spans))
            rows.append(Row(lane, bars, track=True))
    return gantt_chart(rows, title=f"layer_groups: predicted pipeline (0 .. {span:.0f} us)",
                       span=span, width=width, row_h=20)

"""``burst_parallel``: DeepPool's burst-parallel training (§4) as a graph pass.

The planner (``tidal.passes.burst_planner``) picks each layer's GPU count from the per-layer
costs of the annotated graph (``tidal.ir.cost.node_time_us`` at the per-GPU batch, so a
DeepPool device profile on the cluster is used where its layers match), the output bytes per
sample and the parameter bytes, under the GPU-sec amplification limit. The pass then rewrites
the forward graph: where a value crosses from one layer's GPU set to another's it inserts
``tidal::scatter`` (the set grows) or ``tidal::gather`` (it shrinks); model inputs are scattered
from every rank's copy of the global batch and the output is gathered to every rank. Each layer
node is marked with its placement (``meta.get_pass_meta(node, "burst_parallel")``, a
``tidal.ir.meta.BurstPlacement``); the runtime builds each rank's program from the plan and
these marks (``tidal.runtime.programs.burst.from_plan``), which all-reduces each GPU set's
gradients on its ranks as soon as backward has finished them. In one process the ops are the identity: the rewritten graph
computes exactly what the model does.

Options (``tidal.compile(..., amp_limit=2.0, power_of_two=True, plan=None)``): ``amp_limit``,
``power_of_two`` (GPU counts 1, 2, 4, ... or every count), ``sync`` (how gradient sync is
charged, :func:`build_problem`: ``"overlap"``, the default, as the runtime runs it, bucketed
all-reduces beside the rest of backward; ``"bucketed"``: one all-reduce per GPU set after the
layers; ``"paper"``: DeepPool's model, one per layer, no overlap), ``plan`` (a saved ``BurstPlan`` or its JSON: replayed without search),
``algorithm`` (``"exact"`` or ``"paper"``), ``parallel_branches`` and ``amp_min_us`` (see
``plan_burst``).

Example:
    >>> import torch, tidal
    >>> from tidal.passes.burst_parallel import BurstParallel
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
    ...                             torch.nn.Linear(512, 10))
    >>> x = torch.randn(8, 64)
    >>> c = tidal.compile(model, (x,), passes=[BurstParallel(amp_limit=4.0)],
    ...                   cluster=tidal.Cluster(gpus=4, bandwidth_gbps=1000, latency_us=1))
    >>> torch.allclose(c(x), model(x))      # one process: same results
    True
    >>> c.plan.get("burst_parallel").world
    4
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple, Optional, Union

import numpy as np
import torch
import torch.fx as fx

from tidal.ir import batch_dim, cost, meta
from tidal.ir.burst_rows import ALL, Share, TransferRows, placement_shares
from tidal.ir.cluster import Cluster
from tidal.ir.comm_cost import DDP_BUCKET_BYTES
from tidal.ir.collectives import GATHER, SCATTER, check_layer_ranks, layout, rows_like
from tidal.ir.errors import PlanError
from tidal.ir.pass_api import Pass, PassContext, PassResult
from tidal.ir.plans.burst import BurstPlan, LayerPlacement
from tidal.passes import burst_units
from tidal.passes.burst_planner import (BurstProblem, OverlapSync, allreduce_us,
                                        candidate_counts, per_gpu_batch, plan_burst)

PASS_NAME = "burst_parallel"


SYNC_MODELS = ("overlap", "bucketed", "paper")
SYNC_ALIASES = {"per_layer": "paper"}
"""Older names of the sync models (``"per_layer"``: DeepPool's model, now ``"paper"``)."""


def sync_model(sync: str) -> str:
    """The sync model ``sync`` names (an alias resolved); ``ValueError`` for an unknown one.

    >>> sync_model("per_layer"), sync_model("overlap")
    ('paper', 'overlap')
    """
    name = SYNC_ALIASES.get(sync, sync) if isinstance(sync, str) else sync
    if name not in SYNC_MODELS:
        raise ValueError(f"burst_parallel(sync={sync!r}): expected one of {SYNC_MODELS}")
    return name


def build_problem(gm: fx.GraphModule, cluster: Cluster, batch: int,
                  power_of_two: bool = True, example_inputs: Any = None,
                  units: Optional[burst_units.Units] = None,
                  sync: str = "overlap") -> BurstProblem:
    """The planner's input for an annotated graph (``tidal.ir.cost.annotate``) whose example
    batch is ``batch``: its units (``tidal.passes.burst_units``; the graph is analysed by
    ``tidal.ir.batch_dim`` first, from ``example_inputs``, unless it already was), per-unit
    forward + backward time at each candidate count's per-GPU batch (inf above one GPU for a
    unit pinned to one), all-reduce time of each unit's parameters, and the bytes per sample of
    the values other units read. Raises ``ValueError`` naming a bad GPU count or an output
    that cannot be gathered by rows.

    ``sync``: how gradient all-reduce is charged. ``"overlap"`` (default) as the runtime runs
    it (``tidal.passes.burst_planner.OverlapSync``): consecutive units on the same ranks sync
    in DDP-sized buckets, each all-reduce issued when backward has finished its units and run
    beside the rest of backward, so a plan pays only what runs past the end of backward (data
    parallelism: the simulator's DDP model, ``tidal.sim.programs.data_parallel``); the search
    charges a unit its bytes over the ring and a share of the latency of its bucket, less what
    hides. ``"bucketed"``: no overlap, the gradients of all units on one set of GPUs in one
    all-reduce, each unit paying its bytes and a share of the ring latency in proportion to
    its bytes. ``"paper"`` (alias ``"per_layer"``): DeepPool's model (§4, Table 3, Fig. 9), a
    full ring all-reduce (latency included) after each layer, no overlap."""
    sync = sync_model(sync)
    if units is None:
        units = analyse(gm, example_inputs, batch)
    counts = candidate_counts(cluster.gpus, power_of_two)
    nodes = {n.name: n for n in gm.graph.nodes}
    L, K = len(units.units), len(counts)
    comp, bwd, sync_us, act = np.zeros((L, K)), np.zeros((L, K)), np.zeros((L, K)), np.zeros(L)
    times = {g: cost.node_times_us(gm, per_gpu_batch(batch, g), cluster) for g in counts}
    pbytes = _unit_param_bytes(gm, units)
    # the bytes that share one latency: all of a GPU set's (bucketed), a bucket's (overlap)
    shared = max(min(sum(pbytes), DDP_BUCKET_BYTES) if sync == "overlap" else sum(pbytes), 1)
    for i, unit in enumerate(units.units):
        read = [m for m in unit.outputs if any(
            u.op == "output" or units.roles.get(u.name) in (burst_units.CUT, burst_units.OTHER)
            for u in nodes[m].users)]
        act[i] = sum(t.nbytes for m in read for t in meta.get_tensors(nodes[m])) / batch
        latency = cluster.latency_us * (1.0 if sync == "paper" else min(1.0, pbytes[i] / shared))
        for k, g in enumerate(counts):
            comp[i, k] = sum(sum(times[g][m]) for m in unit.members)
            bwd[i, k] = sum(times[g][m][1] for m in unit.members)
            sync_us[i, k] = allreduce_us(pbytes[i], g, cluster.bytes_per_us, latency)
        if unit.pinned:
            comp[i, 1:] = bwd[i, 1:] = np.inf
    overlap = OverlapSync(bwd, np.array(pbytes)) if sync == "overlap" else None
    return BurstProblem([u.name for u in units.units], units.preds, comp, sync_us, act, counts,
                        batch, cluster.bytes_per_us, cluster.latency_us, overlap=overlap)


def _unit_param_bytes(gm: fx.GraphModule, units: burst_units.Units) -> list[float]:
    """Parameter bytes each unit syncs: its nodes' own, plus those of the nodes outside every
    unit that hold parameters (``get_attr`` weights of ``addmm``, a position embedding of
    replicated ids), each charged to the first unit that reads it."""
    index = {m: i for i, u in enumerate(units.units) for m in u.members}
    out = [0.0] * len(units.units)
    for n in gm.graph.nodes:
        c = meta.get_cost(n)
        if c is None or not c.param_bytes:
            continue
        if n.name in index:
            out[index[n.name]] += c.param_bytes
            continue
        seen, todo, found = set(), list(n.users), []
        while todo:
            u = todo.pop()
            if u.name in seen:
                continue
            seen.add(u.name)
            if u.name in index:
                found.append(index[u.name])
            else:
                todo.extend(u.users)
        if found:
            out[min(found)] += c.param_bytes
    return out


def analyse(gm: fx.GraphModule, example_inputs: Any, batch: int) -> burst_units.Units:
    """Batch-dimension analysis of ``gm`` (unless done; without ``example_inputs``, from zeros
    of the input shapes ``tidal.ir.cost.annotate`` recorded) and its burst units."""
    if not any(meta.get_batch_dim(n) is not None for n in gm.graph.nodes):
        if example_inputs is None:  # zeros of the annotated input shapes
            example_inputs = tuple(
                torch.zeros(t[0].shape, dtype=t[0].dtype) if (t := meta.get_tensors(n))
                else None for n in gm.graph.nodes if n.op == "placeholder")
        batch_dim.analyze(gm, example_inputs, batch)
    return burst_units.build(gm)


def check_plan(plan: BurstPlan, gpus: int) -> None:
    """Check a saved plan against a cluster of ``gpus`` GPUs before it is replayed: every layer
    lists as many ranks and sample ranges as its GPU count, needs no more GPUs than the cluster
    has, runs on distinct ranks of it, and its ranges split the plan's batch into contiguous
    rows. Raises ``PlanError`` naming the first layer at fault."""
    for l in plan.layers:
        if l.gpus < 1 or len(l.ranks) != l.gpus or len(l.ranges) != l.gpus:
            raise PlanError(f"burst_parallel: layer {l.layer!r} has gpus={l.gpus} but lists "
                            f"{len(l.ranks)} ranks and {len(l.ranges)} sample ranges")
    check_layer_ranks(((l.layer, l.ranks) for l in plan.layers), gpus, "the cluster")
    for l in plan.layers:
        bounds = [b for lo_hi in sorted(l.ranges) for b in lo_hi]
        if bounds[0] != 0 or bounds[-1] != plan.batch or bounds[1:-1:2] != bounds[2::2] \
                or any(lo > hi for lo, hi in l.ranges):
            raise PlanError(f"burst_parallel: layer {l.layer!r} has sample ranges "
                            f"{[list(r) for r in l.ranges]}, which do not split the batch of "
                            f"{plan.batch} into contiguous rows")


Rows = tuple[tuple[int, int], ...]
"""Per rank of the world, the ``[lo, hi)`` samples it holds (``(0, 0)``: none)."""


class Placed(NamedTuple):
    """Which samples each rank of the world holds of a value: at the plan's batch (``rows``,
    the plan's ranges) and as parts of any batch (``shares``, ``tidal.ir.burst_rows``)."""

    rows: Rows
    shares: tuple[Share, ...]


def _placed(placement: LayerPlacement, world: int) -> Placed:
    held = dict(zip(placement.ranks, placement.ranges))
    return Placed(tuple(held.get(r, (0, 0)) for r in range(world)),
                  placement_shares(placement.ranks, placement.ranges, world))


def _holders(flat: list[int]) -> int:
    return sum(1 for k in range(0, len(flat), 2) if flat[k + 1] > flat[k])


def _factor(node: fx.Node) -> int:
    fact = meta.get_batch_dim(node)
    return fact.factor if isinstance(fact, batch_dim.BatchDim) and fact.splits else 1


class _Rewriter:
    """Inserts the redistributions of one plan into ``gm`` (see :func:`rewrite`)."""

    def __init__(self, gm: fx.GraphModule, plan: BurstPlan, units: burst_units.Units):
        self.gm, self.units = gm, units
        self.world, self.batch = plan.world, plan.batch
        self.everyone = Placed(((0, plan.batch),) * plan.world, (ALL,) * plan.world)
        self.unit_rows = {l.layer: _placed(l, plan.world) for l in plan.layers}
        self.held: dict[str, Placed] = {}   # cut value -> the samples each rank holds of it
        for u in units.units:
            for m in u.members:
                self.held[m] = self.unit_rows[u.name]
        self.made: dict[tuple, fx.Node] = {}

    def whole(self, node: fx.Node) -> int:
        """Dim 0 of a value with no sample dim 0 (the output of a unit pinned to one GPU),
        which moves whole; 0 for a value split by samples."""
        if node.op != "placeholder" and not burst_units.splits_rows(node):
            return meta.get_tensors(node)[0].shape[0]
        return 0

    def layout(self, node: fx.Node, rows: Rows) -> list[int]:
        """The rows of ``node``'s dim 0 each rank holds when it holds samples ``rows``. A value
        with no sample dim 0 (the output of a unit pinned to one GPU) moves whole."""
        n = self.whole(node)
        if n:
            if any(r not in ((0, 0), (0, self.batch)) for r in rows):
                raise PlanError(f"burst_parallel: {node.name!r} has no sample dimension 0 "
                                f"({meta.get_batch_dim(node)}) but would be split by samples")
            return layout((0, n) if hi > lo else (0, 0) for lo, hi in rows)
        f = _factor(node)
        return layout((lo * f, hi * f) for lo, hi in rows)

    def mark(self, made: fx.Node, arg: fx.Node, src: Placed, dst: Placed) -> None:
        """Record on ``made`` (a transfer or stand-in of ``arg``) what it moves for any batch
        (``tidal.ir.burst_rows.TransferRows``: the runtime re-lays it out for another one)."""
        meta.set_pass_meta(made, PASS_NAME, TransferRows(src.shares, dst.shares,
                                                         _factor(arg), self.whole(arg)))

    def source(self, arg: fx.Node) -> Optional[Placed]:
        if arg.name in self.held:
            return self.held[arg.name]
        if arg.op == "placeholder" and burst_units.splits_rows(arg):
            return self.everyone
        return None

    def value(self, arg: fx.Node, dst: Placed, before: fx.Node) -> fx.Node:
        """``arg`` as seen by a node whose rank ``r`` holds samples ``dst.rows[r]``."""
        src = self.source(arg)
        role = self.units.roles.get(arg.name)
        if src is None:
            if role in (burst_units.SIZE, burst_units.INPUT):
                return self._recompute(arg, dst, before, shape_only=role == burst_units.SIZE)
            return arg  # parameters, replicated values and inputs
        if src == dst:
            return arg
        # a value written in place moves anew for each reader, after the writes before it
        key = (arg.name, dst, before.name if arg.name in self.units.mutated else "")
        if key not in self.made:
            s, d = self.layout(arg, src.rows), self.layout(arg, dst.rows)
            if dst == self.everyone or src == self.everyone:
                op = GATHER if dst == self.everyone else SCATTER
            else:
                op = GATHER if _holders(d) < _holders(s) else SCATTER
            with self.gm.graph.inserting_before(before):
                self.made[key] = self.gm.graph.call_function(op, (arg, s, d))
            meta.set_tensors(self.made[key], meta.get_tensors(arg))
            self.mark(self.made[key], arg, src, dst)
        return self.made[key]

    def _recompute(self, arg: fx.Node, dst: Rows, before: fx.Node, shape_only: bool) -> fx.Node:
        """A copy of a size or input-derived node computed from ``dst``'s rows (a size node
        reads a stand-in of the tensors it measures: only their shapes are needed)."""
        key = (arg.name, dst)
        if key not in self.made:
            inputs = {}
            for a in arg.all_input_nodes:
                src = self.source(a)
                if shape_only and src is not None and src != dst:
                    with self.gm.graph.inserting_before(before):
                        inputs[a] = self.gm.graph.call_function(
                            rows_like, (a, self.layout(a, src.rows), self.layout(a, dst.rows)))
                    self.mark(inputs[a], a, src, dst)
                else:
                    inputs[a] = self.value(a, dst, before)
            if all(v is a for a, v in inputs.items()):
                self.made[key] = arg
            else:
                with self.gm.graph.inserting_before(before):
                    self.made[key] = self.gm.graph.node_copy(arg, lambda a: inputs[a])
        return self.made[key]

    def run(self) -> None:
        for node in list(self.gm.graph.nodes):
            unit = self.units.of(node.name) if node.name in self.held else None
            if unit is not None:
                dst = self.unit_rows[unit.name]
            elif node.op == "output":
                dst = self.everyone
            else:
                continue
            for arg in list(node.all_input_nodes):
                if unit is not None and arg.name in unit.members:
                    continue
                new = self.value(arg, dst, node)
                if new is not arg:
                    node.replace_input_with(arg, new)


def rewrite(gm: fx.GraphModule, plan: BurstPlan, units: burst_units.Units) -> None:
    """Insert scatter/gather where a value changes GPU set and mark each unit's nodes with
    their placement (``tidal.ir.meta.BurstPlacement``, from which the runtime builds the
    executor). Replicated values stay as they are; a size or input-derived node is recomputed
    for each GPU set that reads it, from the rows that set holds. A folded value (``factor``
    rows per sample) moves ``factor`` rows per sample."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for unit, l in zip(units.units, plan.layers):
        for m in unit.members:
            meta.set_pass_meta(nodes[m], PASS_NAME,
                               meta.BurstPlacement(unit.name, l.gpus, l.ranks, l.ranges))
    _Rewriter(gm, plan, units).run()
    gm.recompile()


class BurstParallel(Pass):
    """Burst-parallel training: per-layer GPU counts from DeepPool's planner, scatter/gather
    where the count changes, per-layer gradient sync on the layer's ranks."""

    name = PASS_NAME
    exclusive = "parallelism"

    def __init__(self, amp_limit: float = 2.0, power_of_two: bool = True,
                 plan: Union[BurstPlan, str, None] = None, algorithm: str = "exact",
                 parallel_branches: bool = True, amp_min_us: float = 0.0,
                 sync: str = "overlap"):
        if isinstance(amp_limit, bool) or not isinstance(amp_limit, (int, float)) \
                or not amp_limit >= 1:
            raise ValueError(f"burst_parallel(amp_limit={amp_limit!r}): must be a number >= 1")
        if isinstance(plan, str):
            plan = BurstPlan.from_json(plan)
        if plan is not None and not isinstance(plan, BurstPlan):
            raise ValueError(f"burst_parallel(plan=...): expected a BurstPlan or its JSON, got "
                             f"{type(plan).__name__}")
        self.amp_limit = float(amp_limit)
        self.power_of_two = power_of_two
        self.plan: Optional[BurstPlan] = plan
        self.algorithm = algorithm
        self.parallel_branches = parallel_branches
        self.amp_min_us = amp_min_us
        self.sync = sync_model(sync)
        self._analysed: Optional[tuple[tuple, burst_units.Units]] = None

    def _units(self, gm: fx.GraphModule, ctx: PassContext) -> burst_units.Units:
        """The graph's units, analysed once per graph (``auto`` asks ``why_not`` first, then
        runs the pass on the same, unchanged graph)."""
        key = (id(gm), tuple(n.name for n in gm.graph.nodes), ctx.batch_size,
               tuple(getattr(v, "shape", None) for v in ctx.example_inputs))
        if self._analysed is None or self._analysed[0] != key:
            batch_dim.analyze(gm, ctx.example_inputs, ctx.batch_size)
            self._analysed = (key, burst_units.build(gm))
        return self._analysed[1]

    def why_not(self, gm: fx.GraphModule, ctx: PassContext) -> str:
        if ctx.cluster.gpus < 2:
            return f"it needs at least 2 GPUs; the cluster has {ctx.cluster.gpus}"
        try:
            build_problem(gm, ctx.cluster, ctx.batch_size, self.power_of_two,
                          units=self._units(gm, ctx), sync=self.sync)
        except ValueError as e:
            return f"the planner cannot take this graph: {e}"
        return ""

    def _replay(self, problem: BurstProblem) -> BurstPlan:
        plan = self.plan
        names = tuple(l.layer for l in plan.layers)
        if names != problem.names:
            missing = sorted(set(problem.names) ^ set(names))[:3]
            self.fail(f"saved plan does not match this graph's layers (differ: {missing})")
        if plan.world != problem.gpus or plan.batch != problem.batch:
            self.fail(f"saved plan is for {plan.world} GPUs and batch {plan.batch}, the compile "
                      f"is for {problem.gpus} GPUs and batch {problem.batch}")
        check_plan(plan, problem.gpus)
        return plan

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        try:
            units = self._units(gm, ctx)
            problem = build_problem(gm, ctx.cluster, ctx.batch_size, self.power_of_two,
                                    units=units, sync=self.sync)
            plan = self._replay(problem) if self.plan is not None else plan_burst(
                problem, self.amp_limit, algorithm=self.algorithm,
                amp_min_us=self.amp_min_us, parallel_branches=self.parallel_branches)
        except ValueError as e:
            self.fail(str(e))
        plan = replace(plan, composites=_composites(units))
        rewrite(gm, plan, units)
        notes = [plan.summary()]
        notes += [f"layer {name}: {what}" for name, what in plan.composites]
        if plan.fallback:
            notes.append(f"no burst plan beats data parallelism under amp_limit="
                         f"{plan.amp_limit:g}: running data parallel")
        return PassResult(gm, plan=plan, notes=tuple(notes),
                          artifacts={"burst_plan.svg": plan.svg(), "burst_plan.txt": plan.table()})


def _composites(units: burst_units.Units) -> tuple[tuple[str, str], ...]:
    out = []
    for u in units.units:
        what = [w for w in (u.collapsed, f"runs on one GPU: {u.pinned}" if u.pinned else "")
                if w]
        if what:
            out.append((u.name, f"{len(u.members)} nodes ({u.members[0]} .. {u.members[-1]}); "
                                + "; ".join(what)))
    return tuple(out)

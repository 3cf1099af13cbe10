"""``burst_parallel``: DeepPool's burst-parallel training (§4) as a graph pass.

The planner (``tidal.passes.burst_planner``) picks each layer's GPU count from the per-layer
costs of the annotated graph (``tidal.ir.cost.node_time_us`` at the per-GPU batch, so a
DeepPool device profile on the cluster is used where its layers match), the output bytes per
sample and the parameter bytes, under the GPU-sec amplification limit. The pass then rewrites
the forward graph: where a value crosses from one layer's GPU set to another's it inserts
``tidal::scatter`` (the set grows) or ``tidal::gather`` (it shrinks); model inputs are scattered
from every rank's copy of the global batch and the output is gathered to every rank. Each layer
node is marked with its placement (``meta.get_pass_meta(node, "burst_parallel")``) and the
returned executor (``tidal.runtime.burst_exec.BurstExecutor``) all-reduces each layer's
gradients on the layer's ranks. In one process the ops are the identity: the rewritten graph
computes exactly what the model does.

Options (``tidal.compile(..., amp_limit=2.0, power_of_two=True, plan=None)``): ``amp_limit``,
``power_of_two`` (GPU counts 1, 2, 4, ... or every count), ``plan`` (a saved ``BurstPlan`` or
its JSON: replayed without search), ``algorithm`` (``"exact"`` or ``"paper"``),
``parallel_branches`` and ``amp_min_us`` (see ``plan_burst``).

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

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch.fx as fx

from tidal.ir import cost, layer_graph, meta
from tidal.ir.cluster import Cluster
from tidal.ir.collectives import GATHER, SCATTER, layout, replicated
from tidal.ir.errors import PlanError
from tidal.ir.pass_api import Pass, PassContext, PassResult
from tidal.passes.burst_planner import (BurstPlan, BurstProblem, allreduce_us, candidate_counts,
                                        per_gpu_batch, plan_burst)
from tidal.runtime.burst_exec import BurstExecutor, check_layer_ranks

PASS_NAME = "burst_parallel"


@dataclass(frozen=True)
class BurstLayerMeta:
    """What ``burst_parallel`` records on a layer node: its GPU count, the ranks (the subgroup
    that all-reduces its parameters) and each rank's sample range."""

    gpus: int
    ranks: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]


def build_problem(gm: fx.GraphModule, cluster: Cluster, batch: int,
                  power_of_two: bool = True) -> BurstProblem:
    """The planner's input for an annotated graph (``tidal.ir.cost.annotate``) whose example
    batch is ``batch``: layers of ``tidal.ir.layer_graph``, per-layer forward + backward time at
    each candidate count's per-GPU batch, all-reduce time of each layer's parameters, and
    output bytes per sample. Raises ``ValueError`` naming a layer whose output has no batch
    dimension, a bad GPU count or an unsupported graph shape."""
    lg = layer_graph.build(gm)
    names = layer_graph.chain_order(lg)
    index = {n: i for i, n in enumerate(names)}
    preds = [tuple(sorted(index[p] for p in lg.predecessors(n))) for n in names]
    counts = candidate_counts(cluster.gpus, power_of_two)
    nodes = {n.name: n for n in gm.graph.nodes}
    L, K = len(names), len(counts)
    comp, sync, act = np.zeros((L, K)), np.zeros((L, K)), np.zeros(L)
    times = {g: cost.node_times_us(gm, per_gpu_batch(batch, g), cluster) for g in counts}
    for i, name in enumerate(names):
        node = nodes[name]
        tensors = meta.get_tensors(node)
        if not tensors or not tensors[0].shape or tensors[0].shape[0] != batch:
            shape = tensors[0].shape if tensors else None
            raise ValueError(f"burst_parallel: layer {name!r} ({meta.get_layer(node).kind}) "
                             f"outputs shape {shape}, not a batch of {batch} samples; only "
                             f"batch-parallel layers can be split over GPUs")
        act[i] = sum(t.nbytes for t in tensors) / batch
        c = meta.get_cost(node)
        pbytes = c.param_bytes if c is not None else 0
        for k, g in enumerate(counts):
            comp[i, k] = sum(times[g][name])
            sync[i, k] = allreduce_us(pbytes, g, cluster.bytes_per_us, cluster.latency_us)
    return BurstProblem(names, preds, comp, sync, act, counts, batch, cluster.bytes_per_us,
                        cluster.latency_us)


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


def _layout(placement, world: int) -> list[int]:
    rows = dict(zip(placement.ranks, placement.ranges))
    return layout(rows.get(r, (0, 0)) for r in range(world))


def _holders(flat: list[int]) -> int:
    return sum(1 for k in range(0, len(flat), 2) if flat[k + 1] > flat[k])


def rewrite(gm: fx.GraphModule, plan: BurstPlan) -> dict[str, tuple[int, ...]]:
    """Insert scatter/gather where a value changes GPU set, mark each layer node with its
    placement, and return the ranks of the layer that owns each parameter and buffer (all
    ranks for one used by layers on different sets). A non-tensor node between layers (such as
    ``x.size(0)`` in ``x.view(x.size(0), -1)``) is recomputed for each GPU set that reads it,
    from the rows that set holds."""
    world, batch = plan.world, plan.batch
    placements = {l.layer: l for l in plan.layers}
    layouts = {name: _layout(l, world) for name, l in placements.items()}
    everyone = replicated(batch, world)
    made: dict[tuple[str, tuple[int, ...]], fx.Node] = {}
    owners: dict[str, tuple[int, ...]] = {}

    def source(arg: fx.Node) -> Optional[list[int]]:
        if arg.name in layouts:
            return layouts[arg.name]
        if arg.op == "placeholder":
            t = meta.get_tensors(arg)
            return everyone if t and t[0].shape and t[0].shape[0] == batch else None
        return None

    def value(arg: fx.Node, dst: list[int], before: fx.Node) -> fx.Node:
        """``arg`` as seen by a layer on layout ``dst``."""
        src = source(arg)
        if src is None:
            if arg.op not in ("call_function", "call_method", "call_module"):
                return arg  # parameters, non-batch inputs
            key = (arg.name, tuple(dst))
            if key not in made:  # a looked-through node (size(), getattr): follow its inputs
                inputs = {a: value(a, dst, before) for a in arg.all_input_nodes}
                if all(v is a for a, v in inputs.items()):
                    made[key] = arg
                else:
                    with gm.graph.inserting_before(before):
                        made[key] = gm.graph.node_copy(arg, lambda a: inputs[a])
            return made[key]
        if src == dst:
            return arg
        key = (arg.name, tuple(dst))
        if key not in made:
            if dst == everyone or src == everyone:
                op = GATHER if dst == everyone else SCATTER
            else:
                op = GATHER if _holders(dst) < _holders(src) else SCATTER
            with gm.graph.inserting_before(before):
                made[key] = gm.graph.call_function(op, (arg, list(src), list(dst)))
            meta.set_tensors(made[key], meta.get_tensors(arg))
        return made[key]

    for node in list(gm.graph.nodes):
        if node.name in layouts:
            dst = layouts[node.name]
            l = placements[node.name]
            meta.set_pass_meta(node, PASS_NAME, BurstLayerMeta(l.gpus, l.ranks, l.ranges))
            if node.op == "call_module":
                sub = gm.get_submodule(node.target)
                for pname in [n for n, _ in sub.named_parameters()] + \
                        [n for n, _ in sub.named_buffers()]:
                    full = f"{node.target}.{pname}"
                    owners[full] = l.ranks if owners.get(full, l.ranks) == l.ranks \
                        else tuple(range(world))
        elif node.op == "output":
            dst = everyone
        else:
            continue
        for arg in list(node.all_input_nodes):
            new = value(arg, dst, node)
            if new is not arg:
                node.replace_input_with(arg, new)
    gm.recompile()
    return owners


class BurstParallel(Pass):
    """Burst-parallel training: per-layer GPU counts from DeepPool's planner, scatter/gather
    where the count changes, per-layer gradient sync on the layer's ranks."""

    name = PASS_NAME
    exclusive = "parallelism"

    def __init__(self, amp_limit: float = 2.0, power_of_two: bool = True,
                 plan: Union[BurstPlan, str, None] = None, algorithm: str = "exact",
                 parallel_branches: bool = True, amp_min_us: float = 0.0):
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

    def why_not(self, gm: fx.GraphModule, ctx: PassContext) -> str:
        if ctx.cluster.gpus < 2:
            return f"it needs at least 2 GPUs; the cluster has {ctx.cluster.gpus}"
        try:
            build_problem(gm, ctx.cluster, ctx.batch_size, self.power_of_two)
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
            problem = build_problem(gm, ctx.cluster, ctx.batch_size, self.power_of_two)
            plan = self._replay(problem) if self.plan is not None else plan_burst(
                problem, self.amp_limit, algorithm=self.algorithm,
                amp_min_us=self.amp_min_us, parallel_branches=self.parallel_branches)
        except ValueError as e:
            self.fail(str(e))
        owners = rewrite(gm, plan)
        notes = [plan.summary()]
        if plan.fallback:
            notes.append(f"no burst plan beats data parallelism under amp_limit="
                         f"{plan.amp_limit:g}: running data parallel")
        executor = BurstExecutor(plan.world, plan.batch, tuple(sorted(owners.items())),
                                 tuple((l.layer, l.ranks) for l in plan.layers))
        return PassResult(gm, plan=plan, notes=tuple(notes), executor=executor,
                          artifacts={"burst_plan.svg": plan.svg(), "burst_plan.txt": plan.table()})

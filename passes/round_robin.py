"""``round_robin``: Wavelet's model parallelism with round-robin partition switching (§3.3).

The model is split into N partitions (N = ranks) balanced by predicted time: an exact DP over
the chain of layers (``balanced_partition``: minimise the slowest partition, then the bytes
crossing the cuts) restricted to cuts where only single tensors cross. The schedule is the one
of Figure 10: at forward cycle c every rank loads partition c and rank i runs it on batch
(i − c) mod N; activations then move to the next rank; backward mirrors it (partition N−1
first, gradients move to the previous rank); after the backward of partition p on all batches
one all-reduce per partition sums its gradient, then every rank updates its replica. So one
step is N-micro-batch gradient accumulation of the whole global batch, with N − 1 tock waves
on top of the tick wave. Every rank switches partition every cycle; the switches and the
weight bytes they load are counted and reported as the context-switch cost.

The graph is rewritten with ``torch.fx.passes.split_module`` into ``submod_0 .. submod_{N-1}``,
each returning a tuple (``tidal.ir.compat.split_module_tuple``), with the same parameters and
outputs; the runtime's program (``tidal.runtime.programs.round_robin``) runs the
schedule on N gloo ranks, or all N ranks in one process without a process group.

Example:
    >>> import torch, tidal
    >>> from tidal.passes.round_robin import RoundRobin
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    >>> c = tidal.compile(model, (torch.randn(4, 8),), passes=[RoundRobin(partitions=2)],
    ...                   loss_fn=lambda out, y: ((out - y) ** 2).mean(),
    ...                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> print(c.plan.get("round_robin").schedule.line(1))
    S0 F0,1 X0,1 S1 F1,0 B1,0 A1 X1,0 S0 B0,1 A0 U0
    >>> loss = c.step((torch.randn(4, 8),), torch.randn(4, 8))
"""
from __future__ import annotations

import itertools
import operator
from typing import Optional, Sequence

import torch.fx as fx

from tidal.ir.comm_cost import ring_allreduce_us
from tidal.ir import cost, layer_graph, meta
from tidal.ir.capture import buffer_writes, refuse_buffer_writes
from tidal.ir.compat import split_module_tuple
from tidal.ir.param_owners import unowned
from tidal.ir.plans.round_robin import RoundRobinPlan
from tidal.ir.pass_api import Pass, PassContext, PassResult
from tidal.ir.schedule import Action, Schedule

_NAME = "round_robin"


# -- planner (pure) ------------------------------------------------------------------------
def balanced_partition(costs: Sequence[float], parts: int,
                       allowed_cuts: Optional[Sequence[int]] = None,
                       cut_bytes: Optional[Sequence[float]] = None) -> tuple[int, ...]:
    """Split a chain of ``costs`` into ``parts`` contiguous non-empty partitions minimising the
    largest partition sum, and among those the total ``cut_bytes`` of the cuts (an exact DP).

    A cut ``k`` (1 <= k < len(costs)) starts a partition at element k; ``allowed_cuts``
    restricts the cuts (default: all); ``cut_bytes[k]`` is the cost of cutting at k (default
    0). Returns the start index of every partition (the first is 0). Raises ``ValueError``
    naming the value for ``parts < 2``, fewer elements than parts, or no feasible cuts.
    """
    n = len(costs)
    if not isinstance(parts, int) or parts < 2:
        raise ValueError(f"partitions={parts!r}: round-robin needs at least 2 partitions")
    if n < parts:
        raise ValueError(f"the model has {n} layers, fewer than partitions={parts}")
    allowed = set(range(1, n)) if allowed_cuts is None else {int(k) for k in allowed_cuts}
    bad = sorted(k for k in allowed if not 0 < k < n)
    if bad:
        raise ValueError(f"allowed_cuts has {bad[0]} outside 1..{n - 1}")
    cb = [0.0] * (n + 1) if cut_bytes is None else [float(x) for x in cut_bytes] + [0.0]
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def seg(i: int, j: int) -> float:  # elements i..j-1
        return prefix[j] - prefix[i]

    starts = sorted(allowed)
    inf = float("inf")
    # phase 1: best bottleneck. best[k][j]: elements 0..j-1 in k partitions, j a start or n
    ends = starts + [n]
    best: list[dict[int, float]] = [{0: 0.0}]
    for k in range(1, parts + 1):
        row: dict[int, float] = {}
        for j in ends:
            if k == parts and j != n:
                continue
            v = inf
            for i, prev in best[k - 1].items():
                if i < j:
                    v = min(v, max(prev, seg(i, j)))
            if v < inf:
                row[j] = v
        best.append(row)
    if n not in best[parts]:
        raise ValueError(f"no way to cut {n} layers into {parts} partitions at the allowed "
                         f"cut points {starts[:10]}{'...' if len(starts) > 10 else ''}")
    bottleneck = best[parts][n]
    limit = bottleneck + 1e-9 * max(1.0, abs(bottleneck))
    # phase 2: least cut bytes with every partition within the bottleneck
    comm: list[dict[int, tuple[float, int]]] = [{0: (0.0, -1)}]
    for k in range(1, parts + 1):
        row2: dict[int, tuple[float, int]] = {}
        for j in ends:
            if k == parts and j != n:
                continue
            cand = [(prev[0] + (cb[j] if j < n else 0.0), i) for i, prev in comm[k - 1].items()
                    if i < j and seg(i, j) <= limit]
            if cand:
                row2[j] = min(cand)
        comm.append(row2)
    out, j = [], n
    for k in range(parts, 0, -1):
        i = comm[k][j][1]
        out.append(i)
        j = i
    return tuple(reversed(out))


def brute_force_partition(costs: Sequence[float], parts: int,
                          allowed_cuts: Optional[Sequence[int]] = None,
                          cut_bytes: Optional[Sequence[float]] = None) -> tuple[float, float]:
    """(bottleneck, cut bytes) of the best partition by enumeration (for testing the DP)."""
    n = len(costs)
    allowed = sorted(set(range(1, n)) if allowed_cuts is None else set(allowed_cuts))
    cb = [0.0] * n if cut_bytes is None else list(cut_bytes)
    best = None
    for cuts in itertools.combinations(allowed, parts - 1):
        bounds = (0, *cuts, n)
        key = (max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])), sum(cb[k] for k in cuts))
        best = key if best is None or key < best else best
    if best is None:
        raise ValueError("no feasible partition")
    return best


def partition_cost(costs: Sequence[float], starts: Sequence[int],
                   cut_bytes: Optional[Sequence[float]] = None) -> tuple[float, float]:
    """(bottleneck, cut bytes) of a partition given by its start indices."""
    bounds = (*starts, len(costs))
    cb = [0.0] * len(costs) if cut_bytes is None else list(cut_bytes)
    return (max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])),
            sum(cb[k] for k in starts[1:]))


def round_robin_schedule(fwd_us: Sequence[float], bwd_us: Sequence[float],
                         send_us: Sequence[float] = (), switch_us: Sequence[float] = (),
                         allreduce_us: Sequence[float] = ()) -> Schedule:
    """Figure 10's schedule for N = len(fwd_us) ranks and partitions: forward cycle c loads
    partition c (``S``) and rank i runs ``F c,(i-c) mod N`` then sends its activations (``X``);
    the backward mirrors it from partition N−1 down; ``A p`` (lane ``comm``) all-reduces
    partition p after its backward; ``U`` updates after the last all-reduce. Times are the
    per-partition predictions (missing ones are 0)."""
    n = len(fwd_us)
    if n < 2:
        raise ValueError(f"round_robin_schedule: {n} partition(s); need at least 2")

    def get(seq: Sequence[float], p: int) -> float:
        return float(seq[p]) if p < len(seq) else 0.0

    ranks: list[list[Action]] = [[] for _ in range(n)]
    t = 0.0
    for c in range(n):  # forward cycles
        for i in range(n):
            ranks[i].append(Action("S", partition=c, start_us=t, dur_us=get(switch_us, c)))
            b = (i - c) % n
            ranks[i].append(Action("F", b, c, start_us=t + get(switch_us, c),
                                   dur_us=get(fwd_us, c)))
        t += get(switch_us, c) + get(fwd_us, c)
        if c < n - 1:
            for i in range(n):
                ranks[i].append(Action("X", (i - c) % n, c, start_us=t, dur_us=get(send_us, c)))
            t += get(send_us, c)
    ar_end = 0.0
    for d in range(n):  # backward cycles, partition n-1 first
        p = n - 1 - d
        sw = 0.0 if d == 0 else get(switch_us, p)
        for i in range(n):
            if d > 0:
                ranks[i].append(Action("S", partition=p, start_us=t, dur_us=sw))
            ranks[i].append(Action("B", (i - p) % n, p, start_us=t + sw, dur_us=get(bwd_us, p)))
        t += sw + get(bwd_us, p)
        ar_start = max(t, ar_end)
        ar_end = ar_start + get(allreduce_us, p)
        for i in range(n):
            ranks[i].append(Action("A", partition=p, lane="comm", start_us=ar_start,
                                   dur_us=get(allreduce_us, p)))
        if p > 0:
            for i in range(n):
                ranks[i].append(Action("X", (i - p) % n, p, start_us=t,
                                       dur_us=get(send_us, p - 1)))
            t += get(send_us, p - 1)
    t = max(t, ar_end)
    for i in range(n):
        ranks[i].append(Action("U", start_us=t, dur_us=0.0))
    switch_actions = [a for a in ranks[0] if a.kind == "S"]
    notes = (("switches_per_rank", float(len(switch_actions))),
             ("switch_us_per_rank", float(sum(a.dur_us for a in switch_actions))))
    return Schedule(name=_NAME, ranks=tuple(tuple(r) for r in ranks), partitions=n,
                    batches=n, notes=notes)


# -- graph analysis -----------------------------------------------------------------------
def _is_container(n: fx.Node) -> bool:
    return bool(n.users) and all(u.op == "call_function" and u.target is operator.getitem
                                 for u in n.users)


def assign_partitions(gm: fx.GraphModule, layer_part: dict[str, int]) -> dict[str, int]:
    """Partition of every non-placeholder node: layers as given; other nodes (``size()``,
    attributes) go with their earliest user, so only layer outputs cross partitions."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    part: dict[str, int] = {}
    for n in reversed(nodes):
        if n.name in layer_part:
            part[n.name] = layer_part[n.name]
            continue
        users = [part[u.name] for u in n.users if u.name in part]
        if users:
            part[n.name] = min(users)
    for n in nodes:  # nodes with no users: with their inputs
        if n.name not in part:
            ins = [part[a.name] for a in n.all_input_nodes if a.name in part]
            part[n.name] = max(ins, default=0)
    return part


def _crossing(gm: fx.GraphModule, part: dict[str, int], cut: int) -> list[fx.Node]:
    """Nodes produced before partition ``cut`` and used at or after it."""
    out = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output") or part[n.name] >= cut:
            continue
        if any(u.op == "output" or part.get(u.name, 0) >= cut for u in n.users):
            out.append(n)
    return out


def _cut_info(gm: fx.GraphModule, layers: list[str], micro: int
              ) -> tuple[list[int], list[float]]:
    """Allowed cut indices over ``layers`` (only single tensors cross) and their bytes."""
    allowed, cut_bytes = [], [0.0] * len(layers)
    nodes = {n.name: n for n in gm.graph.nodes}
    for k in range(1, len(layers)):
        part = assign_partitions(gm, {name: int(i >= k) for i, name in enumerate(layers)})
        cross = _crossing(gm, part, 1)
        if any(len(meta.get_tensors(n)) != 1 or _is_container(n) for n in cross):
            continue
        allowed.append(k)
        cut_bytes[k] = sum(float(meta.get_cost(n).at(micro)["out_bytes"])
                           if meta.get_cost(n) else float(meta.get_tensors(n)[0].nbytes)
                           for n in cross if nodes[n.name])
    return allowed, cut_bytes


def _param_bytes(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> int:
    seen: set[int] = set()
    total = 0
    for n in nodes:
        if n.op == "call_module":
            params = list(gm.get_submodule(n.target).parameters())
        elif n.op == "get_attr":
            try:
                params = [gm.get_parameter(n.target)]
            except AttributeError:
                params = []
        else:
            params = []
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


def _unused_note(gm: fx.GraphModule, ctx: PassContext) -> tuple[str, ...]:
    """A note naming the model's trainable parameters the traced forward never uses (they get
    no gradient, so no partition syncs them), or nothing."""
    used = {id(p) for p in gm.parameters()}
    model = ctx.model if ctx.model is not None else gm
    unused = unowned(model, used)
    if not unused:
        return ()
    return (f"{len(unused)} trainable parameter(s) the forward never uses get no gradient and "
            f"are not synced: {', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}",)


_BUFFER_WHY = ("each partition runs once per micro-batch, so the buffer would be updated N "
               "times per step on micro-batches instead of once on the global batch (BatchNorm "
               "statistics are the one exception: averaged per partition)")


class RoundRobin(Pass):
    """Wavelet round-robin model parallelism: N time-balanced partitions, every rank runs
    partition c on batch (i − c) mod N at cycle c, one all-reduce per partition.

    Options: ``partitions`` (N, default the cluster's GPU count; the world size under
    torchrun).
    """

    name = _NAME
    training_only = True
    exclusive = "parallelism"

    def __init__(self, partitions: Optional[int] = None):
        if partitions is not None and (not isinstance(partitions, int) or partitions < 2):
            raise ValueError(f"round_robin: partitions={partitions!r}; need an integer >= 2")
        self.partitions = partitions

    def _n(self, ctx: PassContext) -> int:
        n = self.partitions if self.partitions is not None else ctx.cluster.gpus
        if n < 2:
            self.fail(f"partitions={n}: round-robin needs at least 2 (give partitions=N or "
                      f"Cluster(gpus=N))")
        return n

    def why_not(self, gm: fx.GraphModule, ctx: PassContext) -> str:
        n = self.partitions if self.partitions is not None else ctx.cluster.gpus
        if n < 2:
            return f"it needs at least 2 partitions (GPUs); the cluster has {n}"
        if ctx.batch_size % n:
            return f"batch {ctx.batch_size} is not divisible into {n} micro-batches"
        writes = buffer_writes(gm)
        if writes:
            return f"buffer {writes[0].buffer!r} is updated in place in forward ({_BUFFER_WHY})"
        return ""

    def plan(self, gm: fx.GraphModule, ctx: PassContext) -> tuple[RoundRobinPlan, dict[str, int]]:
        """The partition plan and the partition of every node."""
        n = self._n(ctx)
        if ctx.batch_size % n:
            self.fail(f"batch size {ctx.batch_size} is not divisible by partitions={n} "
                      f"(one micro-batch per rank)")
        micro = ctx.batch_size // n
        lg = layer_graph.build(gm)
        layers = layer_graph.chain_order(lg)
        if len(layers) < n:
            self.fail(f"the model has {len(layers)} layers, fewer than partitions={n}")
        node_us = cost.node_times_us(gm, micro, ctx.cluster)
        times = [node_us[name] for name in layers]
        allowed, cut_bytes = _cut_info(gm, layers, micro)
        try:
            starts = balanced_partition([f + b for f, b in times], n, allowed, cut_bytes)
        except ValueError as e:
            self.fail(str(e))
        layer_part = {name: sum(i >= s for s in starts[1:]) for i, name in enumerate(layers)}
        part = assign_partitions(gm, layer_part)
        bounds = (*starts, len(layers))
        fwd = tuple(sum(times[i][0] for i in range(a, b)) for a, b in zip(bounds, bounds[1:]))
        bwd = tuple(sum(times[i][1] for i in range(a, b)) for a, b in zip(bounds, bounds[1:]))
        pbytes = tuple(_param_bytes(gm, [x for x in gm.graph.nodes
                                         if part.get(x.name) == p]) for p in range(n))
        cuts = tuple(cut_bytes[s] for s in starts[1:])
        cl = ctx.cluster
        schedule = round_robin_schedule(
            fwd, bwd, send_us=[cl.transfer_us(c) for c in cuts],
            switch_us=[cl.transfer_us(b) for b in pbytes],
            allreduce_us=[ring_allreduce_us(b, n, cl.bytes_per_us, cl.latency_us)
                          for b in pbytes])
        plan = RoundRobinPlan(
            partitions=n, micro_batch=micro, first_layers=tuple(layers[s] for s in starts),
            layers_per_partition=tuple(b - a for a, b in zip(bounds, bounds[1:])),
            fwd_us=fwd, bwd_us=bwd, param_bytes=pbytes, cut_bytes=cuts, schedule=schedule)
        return plan, part

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        refuse_buffer_writes(gm, _NAME, _BUFFER_WHY)
        plan, part = self.plan(gm, ctx)
        split = split_module_tuple(gm, ctx.model, lambda x: part[x.name],
                                   keep_original_order=True)
        plan.schedule.check()
        notes = (f"{plan.partitions} partitions starting at {', '.join(plan.first_layers)}",
                 f"context switches: {int(plan.schedule.note('switches_per_rank'))} per rank "
                 f"per step, {plan.switch_bytes_per_step() / 2**20:.3g} MiB of weights loaded",
                 f"schedule rank 0: {plan.schedule.line(0)}") + _unused_note(gm, ctx)
        return PassResult(split, plan=plan, notes=notes,
                          artifacts={"round_robin_gantt.svg": plan.schedule.gantt_svg()})

    def ensures(self, gm: fx.GraphModule, ctx: PassContext, result: PassResult) -> None:
        subs = [n for n in result.gm.graph.nodes if n.op == "call_module"]
        if len(subs) != result.plan.partitions:
            self.fail(f"split produced {len(subs)} submodules, expected {result.plan.partitions}")

"""Runs a burst-parallel graph on every rank: forward with the plan's scatter/gather ops, the loss
on the gathered global output, backward, per-layer gradient all-reduce on the layer's subgroup,
then the optimizer step.

Every rank passes the same global batch. Each layer runs on its ranks' sample ranges; a rank
outside a layer's set skips it: on its first distributed call the executor specialises the graph
for its rank, replacing each such layer with an empty (zero-row) tensor of the layer's output
shape, so code such as ``x.view(x.size(0), -1)`` never runs on zero rows. The empty tensor
requires grad exactly when the layer's output would (its module has trainable parameters or an
input requires grad), so every rank takes part in the same backward transfers. The model output
is gathered to every rank, so every rank computes the same global loss, and backward sends each
row's gradient back to the rank that computed the row. A parameter's gradient is then summed
over the ranks of its layer (a subgroup all-reduce) and broadcast to the other ranks, so every
replica takes the same optimizer step and the parameters stay identical everywhere (through a
``GradSync`` when the ``compression`` pass wraps the sync). Buffers a layer updates in training
(BatchNorm's running statistics) are averaged over the layer's ranks after each step and
broadcast to the others, so every rank holds the same model; BatchNorm normalizes each rank's
rows with their own statistics, as data parallelism without ``SyncBatchNorm`` does. Without a
process group (one process) the ops are the identity and ``step`` is plain training.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.runtime.burst_exec import BurstExecutor
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    >>> gm = fx.symbolic_trace(model)
    >>> ex = BurstExecutor(world=1, batch=4, param_ranks=(("0.weight", (0,)), ("0.bias", (0,))))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    >>> float(ex.step(gm, model, (x,), y, torch.nn.functional.cross_entropy, opt)) > 0
    True
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from tidal.ir import meta
from tidal.ir.collectives import SubgroupCache, check_layer_ranks
from tidal.ir.errors import PlanError
from tidal.ir.node_runner import fetch_attr
from tidal.runtime.distributed import all_reduce_tensors, copy_from_flat, is_distributed
from tidal.runtime.grad_sync import GradSync, GradSyncFactory

_NO_GRAD = (torch.detach, torch.Tensor.detach)
PASS_NAME = "burst_parallel"
"""The pass whose node marks (``tidal.ir.meta.BurstPlacement``) this executor reads."""


def skipped_layer(tail: tuple[int, ...], dtype: torch.dtype, grad: bool, *inputs: Any
                  ) -> torch.Tensor:
    """What a rank outside a layer's set computes instead of the layer: zero rows of the
    layer's output shape (``(0,) + tail``) on the inputs' device. It requires grad when grad is
    enabled and ``grad`` (the layer's own parameters train) or an input requires grad, and it is
    tied into autograd to every input that requires grad (adding their sums to no elements), so
    backward still reaches the transfers that fed the layer, as on the layer's own ranks."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else None
    differentiable = dtype.is_floating_point or dtype.is_complex
    out = torch.zeros((0,) + tuple(tail), dtype=dtype, device=device,
                      requires_grad=differentiable and grad and torch.is_grad_enabled())
    if differentiable and torch.is_grad_enabled():
        for t in tensors:
            if t.requires_grad:
                out = out + t.sum().to(dtype)
    return out


def specialise(gm: fx.GraphModule, layer_ranks: dict[str, tuple[int, ...]], rank: int,
               unit_members: Optional[dict[str, tuple[str, ...]]] = None) -> fx.GraphModule:
    """A copy of ``gm`` for ``rank`` in which every layer whose ranks exclude ``rank`` is
    replaced by :func:`skipped_layer` (sharing ``gm``'s modules and parameters). A layer may be
    a unit of several nodes (``unit_members``, by layer name; default: the layer node alone):
    each member whose value a node outside the unit reads is replaced, tied to the unit's
    inputs that come before it (an input after every such member feeds only members whose
    values nothing reads, on any rank), and the members nothing reads any more are dropped.
    A member whose output is not one tensor keeps running (on zero rows)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    new_of = {old.name: node for old, node in env.items()}
    old_of = {old.name: old for old in env}
    for name, ranks in layer_ranks.items():
        if rank in ranks:
            continue
        members = (unit_members or {}).get(name, (name,))
        inside = {new_of[m] for m in members if m in new_of}
        position = _position(graph)
        inputs = list(dict.fromkeys(a for n in sorted(inside, key=position)
                                    for a in n.all_input_nodes if a not in inside))
        for m in members:
            old, node = old_of.get(m), new_of.get(m)
            if node is None or node.op == "placeholder" or \
                    not any(u not in inside for u in node.users):
                continue
            tensors = meta.get_tensors(old)
            if len(tensors) != 1 or any(u.target is operator.getitem for u in old.users):
                continue
            before = [a for a in inputs if position(a) < position(node)]
            with graph.inserting_before(node):
                new = graph.call_function(skipped_layer, (tuple(tensors[0].shape[1:]),
                                                          tensors[0].dtype) + _grad_args(
                                                              gm, node, inside, before))
            new.meta = dict(node.meta)
            outside = [u for u in node.users if u not in inside]
            for u in outside:
                u.replace_input_with(node, new)
        for node in sorted(inside, key=_position(graph), reverse=True):
            if not node.users:
                graph.erase_node(node)
    return fx.GraphModule(gm, graph)


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _grad_args(gm: fx.GraphModule, node: fx.Node, inside: set, inputs: list) -> tuple:
    """``(grad, *inputs)`` for :func:`skipped_layer`: a value that never requires grad (a
    ``detach``) gets none; otherwise the unit's trainable modules and inputs decide."""
    if len(inside) == 1 and (node.target in _NO_GRAD or
                             (node.op == "call_method" and node.target == "detach")):
        return (False,)
    grad = any(n.op == "call_module" and any(
        p.requires_grad for p in gm.get_submodule(n.target).parameters()) for n in inside)
    return (grad,) + tuple(inputs)


def from_plan(gm: fx.GraphModule, plan: Any) -> "BurstExecutor":
    """The executor of a ``burst_parallel`` plan (a ``BurstPlan``: ``world``, ``batch`` and
    per layer its ``layer`` name and ``ranks``) on the graph the pass rewrote, whose nodes carry
    their placement (``tidal.ir.meta.BurstPlacement``)."""
    members: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        placed = meta.get_pass_meta(n, PASS_NAME)
        if isinstance(placed, meta.BurstPlacement):
            members.setdefault(placed.unit, []).append(n.name)
    ranks_of = {l.layer: tuple(l.ranks) for l in plan.layers}
    unit_of = {m: unit for unit, ms in members.items() for m in ms}
    owners = param_ranks(gm, plan.world, unit_of, ranks_of)
    return BurstExecutor(plan.world, plan.batch, tuple(sorted(owners.items())),
                         tuple(ranks_of.items()),
                         tuple((unit, tuple(ms)) for unit, ms in members.items()))


def param_ranks(gm: fx.GraphModule, world: int, unit_of: dict[str, str],
                ranks_of: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Per parameter and buffer name (every name of a shared one), the ranks of the one layer
    whose nodes use it (``unit_of``: node name -> layer; ``ranks_of``: layer -> ranks), or
    every rank when nodes on several GPU sets, or nodes computed on every rank (a position
    embedding of replicated ids), use it."""
    everyone = tuple(range(world))
    by_id: dict[int, tuple[int, ...]] = {}

    def use(tensor: Any, ranks: tuple[int, ...]) -> None:
        by_id[id(tensor)] = ranks if by_id.get(id(tensor), ranks) == ranks else everyone

    for node in gm.graph.nodes:
        if node.op == "call_module":
            ranks = ranks_of[unit_of[node.name]] if node.name in unit_of else everyone
            sub = gm.get_submodule(node.target)
            for t in list(sub.parameters()) + list(sub.buffers()):
                use(t, ranks)
        elif node.op == "get_attr":
            users = {unit_of.get(u.name) for u in node.users}
            one = next(iter(users)) if len(users) == 1 else None
            t = fetch_attr(gm, str(node.target))
            if isinstance(t, torch.Tensor):
                use(t, ranks_of[one] if one is not None else everyone)
    named = list(gm.named_parameters(remove_duplicate=False)) + \
        list(gm.named_buffers(remove_duplicate=False))
    return {name: by_id.get(id(t), everyone) for name, t in named}


class BurstExecutor:
    """The executor ``burst_parallel`` returns: ``world`` ranks, the plan's global ``batch``,
    per parameter (and buffer) name of the graph module the ranks of the layer that owns it,
    per layer name its ranks (``layer_ranks``; ranks outside a layer's set skip it) and, for a
    layer of several nodes, their names (``unit_members``)."""

    def __init__(self, world: int, batch: int, param_ranks: tuple[tuple[str, tuple[int, ...]], ...],
                 layer_ranks: tuple[tuple[str, tuple[int, ...]], ...] = (),
                 unit_members: tuple[tuple[str, tuple[str, ...]], ...] = ()):
        self.world = world
        self.batch = batch
        self.param_ranks = dict(param_ranks)
        self.layer_ranks = dict(layer_ranks)
        self.unit_members = dict(unit_members)
        self.groups = SubgroupCache()
        self._ready = False
        self._local: Optional[tuple[fx.GraphModule, fx.GraphModule]] = None
        self._sync_factory: Optional[GradSyncFactory] = None
        self._syncs: dict[tuple[int, ...], GradSync] = {}

    def use_grad_sync(self, factory: GradSyncFactory) -> None:
        """Sync each set of ranks' gradients through ``factory(group)`` (a :class:`GradSync`,
        e.g. a compressor from the ``compression`` pass) instead of a plain all-reduce."""
        self._sync_factory = factory
        self._syncs = {}

    def _check(self, inputs: tuple) -> None:
        size = dist.get_world_size()
        if size != self.world:
            raise ValueError(f"burst_parallel: the plan is for {self.world} GPUs but the job has "
                             f"{size} ranks; compile with tidal.Cluster(gpus={size})")
        first = next((v for v in inputs if isinstance(v, torch.Tensor)), None)
        if first is not None and first.shape[0] != self.batch:
            raise ValueError(f"burst_parallel: the plan is for a global batch of {self.batch}, "
                             f"got inputs with batch {first.shape[0]}")
        if not self._ready:  # the plan is fixed: its ranks are checked against the world once
            check_layer_ranks(self.layer_ranks.items(), size)
            self.groups.create(r for r in self.param_ranks.values() if len(r) < size)
            self._ready = True

    def local_module(self, gm: fx.GraphModule) -> fx.GraphModule:
        """``gm`` specialised for this rank (:func:`specialise`), built once per graph."""
        if self._local is None or self._local[0] is not gm:
            self._local = (gm, specialise(gm, self.layer_ranks, dist.get_rank(),
                                              self.unit_members))
        return self._local[1]

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """The global output on every rank."""
        if is_distributed():
            self._check(args)
            return self.local_module(gm)(*args, **kwargs)
        return gm(*args, **kwargs)

    def step(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """One training step on the global batch; returns the (global) loss."""
        distributed = is_distributed()
        if distributed:
            self._check(inputs)
        optimizer.zero_grad(set_to_none=True)
        run = self.local_module(gm) if distributed else gm
        loss = loss_fn(run(*inputs), targets)
        loss.backward()
        if distributed:
            self.sync_gradients(gm)
            self.sync_buffers(gm)
        optimizer.step()
        return loss.detach()

    def sync_buffers(self, gm: fx.GraphModule) -> None:
        """Give every rank the same buffers: floating-point ones (running statistics) averaged
        over their layer's ranks, then every buffer of a layer on a subset of the ranks
        broadcast from the first of them (ranks outside the set did not run the layer)."""
        rank, size = dist.get_rank(), dist.get_world_size()
        everyone = tuple(range(size))
        by_ranks: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for name, b in gm.named_buffers():
            by_ranks.setdefault(self.param_ranks.get(name, everyone), []).append(b)
        for ranks in sorted(by_ranks):
            group = None if len(ranks) == size else self.groups.get(ranks)
            floats = [b for b in by_ranks[ranks] if b.is_floating_point()]
            if len(ranks) > 1 and rank in ranks:
                all_reduce_tensors(floats, group, average=True)
            if len(ranks) < size:
                for dtype in sorted({b.dtype for b in by_ranks[ranks]}, key=str):
                    bufs = [b for b in by_ranks[ranks] if b.dtype == dtype]
                    flat = torch.cat([b.reshape(-1) for b in bufs])
                    dist.broadcast(flat, src=ranks[0])
                    copy_from_flat(flat, bufs)

    def sync_gradients(self, gm: fx.GraphModule) -> None:
        """Sum each parameter's gradient over its layer's ranks and give it to every rank.

        Each rank's gradient is already its share of the global-batch gradient (the loss is
        scaled by its rows), so the sync is a sum; through a :class:`GradSync` (which averages)
        the result is scaled back by the number of ranks."""
        rank, size = dist.get_rank(), dist.get_world_size()
        by_ranks: dict[tuple[int, ...], list[tuple[str, torch.nn.Parameter]]] = {}
        everyone = tuple(range(size))
        for name, p in gm.named_parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_ranks.setdefault(self.param_ranks.get(name, everyone), []).append((name, p))
        for ranks in sorted(by_ranks):
            named = by_ranks[ranks]
            group = None if len(ranks) == size else self.groups.get(ranks)
            if rank in ranks:
                flat = self._summed(ranks, group, named)
            else:
                flat = torch.empty(sum(p.numel() for _, p in named), dtype=named[0][1].dtype)
            if len(ranks) < size:
                dist.broadcast(flat, src=ranks[0])
            copy_from_flat(flat, [p.grad for _, p in named])

    def _summed(self, ranks: tuple[int, ...], group: Optional[dist.ProcessGroup],
                named: list[tuple[str, torch.nn.Parameter]]) -> torch.Tensor:
        """The gradients of ``named`` summed over ``ranks`` (this rank is one of them), flat."""
        if self._sync_factory is None:
            flat = torch.cat([p.grad.reshape(-1) for _, p in named])
            dist.all_reduce(flat, group=group)
            return flat
        if ranks not in self._syncs:
            self._syncs[ranks] = self._sync_factory(group)
        synced = self._syncs[ranks]({n: p.grad for n, p in named})
        return torch.cat([synced[n].reshape(-1) for n, _ in named]) * len(ranks)

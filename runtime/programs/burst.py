"""Burst-parallel training as a program (DeepPool §4–§5): each rank's forward and backward on
the compute stream, each gradient bucket's sync on the comm stream as soon as backward has
finished its layers, and on every rank only the state of the layers it runs.

Every rank passes the same global batch. Each layer runs on its ranks' sample ranges; a rank
outside a layer's set skips it: on its first distributed step the program specialises the graph
for its rank (:func:`specialise`), replacing each such layer with an empty (zero-row) tensor of
the layer's output shape (:func:`skipped_layer`), so code such as ``x.view(x.size(0), -1)``
never runs on zero rows. The empty tensor requires grad exactly when the layer's output would
(its module has trainable parameters or an input requires grad), so every rank takes part in
the same backward transfers. The model output is gathered to every rank, so every rank computes
the same global loss, and backward sends each row's gradient back to the rank that computed the
row. Without a process group (one process) the ops are the identity and a step is plain
training.

**Owner-only state.** A parameter or buffer belongs to the ranks of the one layer that uses it
(:func:`param_ranks`), or to every rank when nodes on several GPU sets, or nodes computed on
every rank, use it. A rank holds, updates and checkpoints only what it owns: on its distributed
steps the program removes every other parameter (and its state) from the optimizer's param
groups (:meth:`BurstProgram.own_optimizer`: the same optimizer object, so a learning-rate
scheduler on it keeps working; a group left empty stays, so group indices do not change), the
rank never receives the gradients of the others (their ``.grad`` stays ``None``), and buffers a
layer updates in training (BatchNorm's running statistics) are averaged over the layer's ranks
only. A rank's copy of a layer it does not run is stale after the first step and never read:
its graph skips the layer, and the forward (inference too) takes that layer's rows from its
owners through the gather. :meth:`BurstProgram.state_dict` checkpoints the rank's share (its
tensors by name, the optimizer, the compressors); :meth:`BurstProgram.state_bytes` counts what
the rank holds against data parallelism (:func:`state_table` for the ranks' rows). BatchNorm
normalizes each rank's rows with their own statistics, as data parallelism without
``SyncBatchNorm`` does.

**Gradient sync.** In backward order, the gradients of consecutive layers on the same set of
two or more ranks (no change of GPU set between them) go into buckets of at most
``bucket_bytes`` (:func:`sync_buckets`; 25 MiB by default, as DDP), and each bucket is summed
over its ranks (a subgroup all-reduce, or a ``GradSync`` when the ``compression`` pass wraps
the sync, :meth:`BurstProgram.use_grad_sync`) as soon as the backward of the bucket's earliest
layer has run: backward is cut right before the first node that uses one of the bucket's
parameters (:func:`stages`).

The program of one rank (:meth:`BurstProgram.layout`, built once per input shape and rank):

* ``forward`` (compute): the rank's graph with autograd, and the loss on the gathered output;
* ``backward k`` (compute), from the last segment to the first: the forward is cut before the
  node where a bucket's parameters are first used; each cut's live values are detached there,
  and ``backward k`` runs autograd from segment k's outputs (the loss, or the gradients the
  later stage left on the detached values) back to its inputs, so a bucket's gradients are
  final when its stage ends;
* per bucket of the rank, after the stage that finalises it: ``all_reduce r0,r1 a..b`` (comm,
  on the bucket's ranks only; ``a`` and ``b`` its first and last parameter in backward order);
* ``buffers all_reduce r0,r1`` (comm, after backward) per set of ranks with floating-point
  buffers;
* ``optimizer`` (compute), after the gradient syncs: it overlaps the buffer syncs.

The comm stream is one FIFO in program order and every rank issues its buckets in the same
order (the order of :func:`sync_buckets`, which agrees with every rank's stage order), so the
collectives match; they run on process groups of their own (a world-wide copy and the sets'
subgroups), so they overlap the scatter/gather transfers of backward, which use the default
group. The compute pieces run eagerly (``fallback_reason`` says why: the scatter/gather
collectives inside the graph), not as captured segments. The program is the same object the
simulator runs (``tidal.sim.programs.program_tasks``): a comm piece of the same name on several
ranks is one collective across them.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.runtime.program import ProgramExecutor
    >>> from tidal.runtime.programs.burst import BurstProgram
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    >>> gm = fx.symbolic_trace(model)
    >>> ex = ProgramExecutor(BurstProgram(world=1, batch=4,
    ...                                   param_ranks=(("0.weight", (0,)), ("0.bias", (0,)))))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    >>> float(ex.step(gm, model, (x,), y, torch.nn.functional.cross_entropy, opt)) > 0
    True
    >>> [(p.name, p.stream, p.deps) for p in ex.last_program.pieces]   # one process
    [('forward', 'compute', ()), ('backward 0', 'compute', (0,)), ('optimizer', 'compute', (1,))]
    >>> ex.close()
"""
from __future__ import annotations

import bisect
import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils import _pytree as pytree

from tidal.ir import meta
from tidal.ir.collectives import GATHER, SCATTER, SubgroupCache, check_layer_ranks, new_group
from tidal.ir.comm_cost import DDP_BUCKET_BYTES, bucket_partition
from tidal.ir.node_runner import fetch_attr, flat_tensors
from tidal.ir.table import format_table
from tidal.runtime.distributed import all_reduce_tensors, is_distributed
from tidal.runtime.comm.grad_sync import GradSync, GradSyncFactory
from tidal.runtime.program import COMM, COMPUTE, TRANSFER, Piece, Program

PLAN_KIND = "BurstPlan"
PASS_NAME = "burst_parallel"
"""The pass whose node marks (``tidal.ir.meta.BurstPlacement``) this program reads."""

_NO_GRAD = (torch.detach, torch.Tensor.detach)
_COLLECTIVES = (SCATTER, GATHER)

Ranks = tuple[int, ...]


def skipped_layer(tail: tuple[int, ...], dtype: torch.dtype, grad: bool, *inputs: Any
                  ) -> torch.Tensor:
    """What a rank outside a layer's set computes instead of the layer: zero rows of the
    layer's output shape (``(0,) + tail``) on the inputs' device. It requires grad when grad is
    enabled and ``grad`` (the layer's own parameters train) or an input requires grad, and it is
    tied into autograd to every input that requires grad (adding their sums to no elements), so
    backward still reaches the transfers that fed the layer, as on the layer's own ranks.

    >>> x = torch.ones(2, 3, requires_grad=True)
    >>> out = skipped_layer((5,), torch.float32, False, x)
    >>> tuple(out.shape), out.requires_grad
    ((0, 5), True)
    """
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


def specialise(gm: fx.GraphModule, layer_ranks: dict[str, Ranks], rank: int,
               unit_members: Optional[dict[str, tuple[str, ...]]] = None) -> fx.GraphModule:
    """A copy of ``gm`` for ``rank`` in which every layer whose ranks exclude ``rank`` is
    replaced by :func:`skipped_layer` (sharing ``gm``'s modules and parameters). A layer may be
    a unit of several nodes (``unit_members``, by layer name; default: the layer node alone):
    each member whose value a node outside the unit reads is replaced, tied to the unit's
    inputs that come before it (an input after every such member feeds only members whose
    values nothing reads, on any rank), and the members nothing reads any more are dropped.
    A member whose output is not one tensor keeps running (on zero rows).

    >>> from tidal.ir import cost
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()))
    >>> cost.annotate(gm, (torch.randn(4, 3),))     # output shapes on the nodes
    >>> local = specialise(gm, {"_0": (0,)}, rank=1)
    >>> [n.target.__name__ for n in local.graph.nodes if n.op == "call_function"]
    ['skipped_layer']
    """
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


def _position(graph: fx.Graph) -> Callable[[fx.Node], int]:
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


def param_ranks(gm: fx.GraphModule, world: int, unit_of: dict[str, str],
                ranks_of: dict[str, Ranks]) -> dict[str, Ranks]:
    """Per parameter and buffer name (every name of a shared one), the ranks of the one layer
    whose nodes use it (``unit_of``: node name -> layer; ``ranks_of``: layer -> ranks), or
    every rank when nodes on several GPU sets, or nodes computed on every rank (a position
    embedding of replicated ids), use it.

    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    >>> param_ranks(gm, 2, {"_0": "fc"}, {"fc": (1,)})
    {'0.weight': (1,), '0.bias': (1,)}
    """
    everyone = tuple(range(world))
    by_id: dict[int, Ranks] = {}

    def use(tensor: Any, ranks: Ranks) -> None:
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



def from_plan(gm: fx.GraphModule, plan: Any,
              bucket_bytes: float = DDP_BUCKET_BYTES) -> "BurstProgram":
    """The rank program of a ``burst_parallel`` plan (a ``BurstPlan``: ``world``, ``batch`` and
    per layer its ``layer`` name and ``ranks``) on the graph the pass rewrote, whose nodes carry
    their placement (``tidal.ir.meta.BurstPlacement``); gradient buckets of at most
    ``bucket_bytes``."""
    members: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        placed = meta.get_pass_meta(n, PASS_NAME)
        if isinstance(placed, meta.BurstPlacement):
            members.setdefault(placed.unit, []).append(n.name)
    ranks_of = {l.layer: tuple(l.ranks) for l in plan.layers}
    unit_of = {m: unit for unit, ms in members.items() for m in ms}
    owners = param_ranks(gm, plan.world, unit_of, ranks_of)
    return BurstProgram(plan.world, plan.batch, tuple(sorted(owners.items())),
                        tuple(ranks_of.items()),
                        tuple((unit, tuple(ms)) for unit, ms in members.items()),
                        bucket_bytes=bucket_bytes)


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: the ``ranks`` that sum it, its parameter ``names`` in backward
    order, and ``ready``, the position (in the graph module's node order) of the first node
    that reads one of them: the bucket's gradients are final once backward has run back to
    that node."""

    ranks: Ranks
    names: tuple[str, ...]
    ready: int

    @property
    def piece(self) -> str:
        """The name of the bucket's comm piece (the same on each of its ranks)."""
        last = f"..{self.names[-1]}" if len(self.names) > 1 else ""
        return f"all_reduce {_label(self.ranks)} {self.names[0]}{last}"


def first_use(gm: fx.GraphModule) -> dict[int, int]:
    """``id(tensor)`` -> the position of the first node of ``gm`` that computes with it, for
    every parameter and buffer: a ``call_module`` of a module holding it, or the first node
    that reads a ``get_attr`` of it (where its gradient comes from).

    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    >>> first_use(gm)[id(gm.get_submodule("0").weight)]      # node 0 is the input
    1
    """
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    used: dict[int, int] = {}
    for node, i in position.items():
        tensors: list[Any] = []
        if node.op == "call_module":
            sub = gm.get_submodule(node.target)
            tensors = list(sub.parameters()) + list(sub.buffers())
        elif node.op == "get_attr":
            tensors = [fetch_attr(gm, str(node.target))]
            i = min((position[u] for u in node.users), default=i)
        for t in tensors:
            if isinstance(t, torch.Tensor):
                used[id(t)] = min(used.get(id(t), i), i)
    return used


def sync_buckets(gm: fx.GraphModule, param_ranks: Mapping[str, Ranks], world: int,
                 bucket_bytes: float = DDP_BUCKET_BYTES) -> tuple[Bucket, ...]:
    """The gradient buckets of ``gm``'s trainable parameters, in the order every rank issues
    them. The parameters synced by two or more ranks (``param_ranks``: name -> ranks; every
    rank when missing) are taken in backward order (latest first use first; within a node, the
    reverse of their registration order, as DDP). A run of consecutive layers on the same ranks
    (consecutive parameters with the same ranks and no ``tidal::scatter``/``gather`` between
    their first uses: the pass puts one wherever the GPU set changes) is cut into buckets of at
    most ``bucket_bytes`` (``tidal.ir.comm_cost.bucket_partition``; a larger tensor gets a
    bucket of its own). A bucket is ready where its earliest parameter is first read (an unused
    parameter: at the start), and the buckets are ordered by readiness, latest first.

    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)))
    >>> both = dict.fromkeys(["0.weight", "0.bias", "1.weight", "1.bias"], (0, 1))
    >>> [(b.names, b.ready) for b in sync_buckets(gm, both, 2)]
    [(('1.bias', '1.weight', '0.bias', '0.weight'), 1)]
    >>> [b.piece for b in sync_buckets(gm, both, 2, bucket_bytes=32)]
    ['all_reduce 0,1 1.bias..0.bias', 'all_reduce 0,1 0.weight']
    >>> [b.piece for b in sync_buckets(gm, {**both, "1.weight": (1,), "1.bias": (1,)}, 2)]
    ['all_reduce 0,1 0.bias..0.weight']
    """
    everyone = tuple(range(world))
    used = first_use(gm)
    moves = [i for i, n in enumerate(gm.graph.nodes)
             if n.op == "call_function" and n.target in _COLLECTIVES]
    order = [(used.get(id(p), 0), i, name, p)
             for i, (name, p) in enumerate(gm.named_parameters()) if p.requires_grad]
    runs: list[tuple[tuple[Ranks, int], list[tuple[int, str, int]]]] = []
    for ready, _, name, p in sorted(order, key=lambda o: (-o[0], -o[1])):
        ranks = tuple(param_ranks.get(name, everyone))
        if len(ranks) < 2:
            continue
        key = (ranks, bisect.bisect_left(moves, ready))  # the ranks and the GPU-set segment
        if not runs or runs[-1][0] != key:
            runs.append((key, []))
        runs[-1][1].append((ready, name, p.numel() * p.element_size()))
    buckets = [Bucket(ranks, tuple(params[k][1] for k in part), min(params[k][0] for k in part))
               for (ranks, _), params in runs
               for part in bucket_partition([b for _, _, b in params], bucket_bytes)]
    return tuple(sorted(buckets, key=lambda b: -b.ready))


@dataclass(frozen=True)
class Stages:
    """How one rank's backward is cut: ``cuts``, the names of the nodes of the rank's graph
    before which the forward is cut (segment 0 runs up to ``cuts[0]``, segment k starts at
    ``cuts[k - 1]``), and per bucket the rank syncs, the segment whose backward stage
    finalises it (``buckets``, in issue order)."""

    cuts: tuple[str, ...]
    buckets: tuple[tuple[Bucket, int], ...]


def stages(gm: fx.GraphModule, run: fx.GraphModule, buckets: Sequence[Bucket],
           overlap: bool = True) -> Stages:
    """Where a rank cuts its backward for ``buckets`` (those it syncs, in
    :func:`sync_buckets`' order): the forward of ``run`` (the rank's graph: ``gm``
    specialised, :func:`specialise`) is cut before the first of its nodes at or after each
    bucket's ready position in ``gm``, and before and after each ``tidal::scatter``/``gather``
    node (so the backward of a transfer is a stage of its own, which waits for the other ranks
    without occupying the device), unless only inputs come before. Every node on the rank that
    reads one of the bucket's parameters is at or after that position, so the bucket is final
    once the backward of that segment has run. ``overlap=False`` syncs every bucket after the
    last stage.

    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(),
    ...                                            torch.nn.Linear(2, 2)))
    >>> both = dict.fromkeys(["0.weight", "0.bias", "2.weight", "2.bias"], (0, 1))
    >>> cut = stages(gm, gm, sync_buckets(gm, both, 2, bucket_bytes=24))
    >>> cut.cuts, [(b.names, k) for b, k in cut.buckets]
    (('_2',), [(('2.bias', '2.weight'), 1), (('0.bias',), 0), (('0.weight',), 0)])
    """
    nodes = list(run.graph.nodes)
    start = next((i for i, n in enumerate(nodes) if n.op != "placeholder"), len(nodes))
    moves = transfer_positions(run)
    at: dict[Bucket, int] = {}
    if overlap:
        position = {n.name: i for i, n in enumerate(gm.graph.nodes)}
        kept = [(position[n.name], i) for i, n in enumerate(nodes) if n.name in position]
        for b in buckets:
            k = bisect.bisect_left(kept, (b.ready, -1))
            index = kept[k][1] if k < len(kept) else len(nodes) - 1
            if index > start:
                at[b] = index
    cuts = sorted({i for i in list(at.values()) + moves + [m + 1 for m in moves]
                   if start < i < len(nodes)})
    return Stages(tuple(nodes[i].name for i in cuts),
                  tuple((b, bisect.bisect_right(cuts, at[b]) if b in at else 0)
                        for b in buckets))


def transfer_positions(run: fx.GraphModule) -> list[int]:
    """The positions (in node order) of ``run``'s ``tidal::scatter``/``gather`` nodes."""
    return [i for i, n in enumerate(run.graph.nodes)
            if n.op == "call_function" and n.target in _COLLECTIVES]


def transfer_name(node: fx.Node) -> str:
    """The piece name of a transfer node's forward (``"gather _5"``), the same on every rank:
    the transfers are in every rank's graph, in the same order."""
    return f"{'scatter' if node.target is SCATTER else 'gather'} {node.name}"


def forward_parts(run: fx.GraphModule) -> list[tuple[str, str, int, int]]:
    """``run``'s forward as consecutive pieces ``(name, stream, lo, hi)`` over its node
    positions ``[lo, hi)``: each ``tidal::scatter``/``gather`` node alone on the
    :data:`TRANSFER` stream (:func:`transfer_name`), the nodes between them on the compute
    stream (``"forward"``, or ``"forward k"`` when there are several), none empty.

    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    >>> forward_parts(gm)
    [('forward', 'compute', 0, 3)]
    """
    nodes = list(run.graph.nodes)
    moves = transfer_positions(run)
    bounds = sorted({0, len(nodes)} | set(moves) | {m + 1 for m in moves})
    spans = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    compute = [s for s in spans if s[0] not in moves]
    parts = []
    for lo, hi in spans:
        if lo in moves:
            parts.append((transfer_name(nodes[lo]), TRANSFER, lo, hi))
        else:
            name = "forward" if len(compute) == 1 else f"forward {compute.index((lo, hi))}"
            parts.append((name, COMPUTE, lo, hi))
    return parts


class _CutRunner(fx.Interpreter):
    """Runs a graph in consecutive ranges of nodes (:meth:`start`, then :meth:`advance`; the
    forward pieces), detaching every value that lives across a cut (before a node named in
    ``cuts``): each tensor that requires grad and is not a leaf becomes a new leaf (cloned, so
    later in-place ops keep working, unless it shares storage with another such value: then
    only detached, keeping the aliasing). ``pairs[k]``: (original, leaf) at cut k;
    ``result``: the graph's output once its output node ran."""

    def __init__(self, module: fx.GraphModule, cuts: tuple[str, ...]):
        super().__init__(module)
        self.cuts = set(cuts)
        order = {n: i for i, n in enumerate(module.graph.nodes)}
        missing = self.cuts - {n.name for n in order}
        if missing:
            raise ValueError(f"burst_parallel: the rank's graph has no node "
                             f"{sorted(missing)[0]!r} to cut backward before")
        self.nodes = list(order)
        self.order = order
        self.last_use = {n: max((order[u] for u in n.users), default=-1) for n in order}
        self.pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.result: Any = None
        self._next = 0

    def start(self, *args: Any) -> None:
        """Begin a run on ``args`` (the graph's inputs)."""
        self.env = {}
        self.args_iter = iter(self.graph.process_inputs(*args))
        self.pairs, self.result, self._next = [], None, 0

    def advance(self, stop: int) -> None:
        """Run the nodes from where the run stands up to position ``stop`` (excluded)."""
        if stop < self._next:
            raise RuntimeError(f"burst_parallel: forward pieces out of order (at node "
                               f"{self._next}, asked to run up to {stop})")
        for node in self.nodes[self._next:stop]:
            self.env[node] = self.run_node(node)
            if node.op == "output":
                self.result = self.graph.process_outputs(self.env[node])
            if self.garbage_collect_values:
                for dead in self.user_to_last_uses.get(node, []):
                    del self.env[dead]
        self._next = max(self._next, stop)

    def run_node(self, n: fx.Node) -> Any:
        if n.name in self.cuts:
            self._cut(self.order[n])
        return super().run_node(n)

    def _cut(self, here: int) -> None:
        live = [m for m in self.env if self.last_use[m] >= here]
        crossing = {id(t): t for m in live for t in flat_tensors(self.env[m])
                    if t.requires_grad and not t.is_leaf}
        storages: dict[int, int] = {}
        for t in crossing.values():
            if t.numel():
                key = t.untyped_storage().data_ptr()
                storages[key] = storages.get(key, 0) + 1
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        done: dict[int, torch.Tensor] = {}

        def cut(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or not t.requires_grad or t.is_leaf:
                return t
            if id(t) not in done:
                leaf = t.detach().requires_grad_()
                pairs.append((t, leaf))
                shared = t.numel() and storages[t.untyped_storage().data_ptr()] > 1
                done[id(t)] = leaf if shared else leaf.clone()
            return done[id(t)]

        for m in live:
            self.env[m] = pytree.tree_map(cut, self.env[m])
        self.pairs.append(pairs)


def _label(ranks: Ranks) -> str:
    return ",".join(map(str, ranks))


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class StateBytes:
    """The training state one rank holds (bytes) under owner-only burst state, beside data
    parallelism, where every rank holds all of it: ``params`` (parameters and buffers),
    ``grads`` (one gradient per trainable parameter) and ``optimizer`` (its state tensors, as
    measured; zero before the first step). ``dp_optimizer`` is estimated: the rank's optimizer
    bytes per byte of the parameters they belong to, times every trainable parameter's
    bytes."""

    rank: int
    params: int
    grads: int
    optimizer: int
    dp_params: int
    dp_grads: int
    dp_optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def dp_total(self) -> int:
        return self.dp_params + self.dp_grads + self.dp_optimizer


def state_table(rows: Sequence[StateBytes]) -> str:
    """The ranks' :class:`StateBytes` as a table (KiB, rounded), with each rank's share of
    data parallelism's bytes.

    >>> print(state_table([StateBytes(0, 4096, 2048, 4096, 8192, 4096, 8192)]))
    rank  params KiB  grads KiB  optimizer KiB  total KiB  data parallel KiB  share
    ----  ----------  ---------  -------------  ---------  -----------------  -----
       0           4          2              4         10                 20  0.500
    """
    def kib(n: int) -> int:
        return round(n / 1024)

    return format_table(
        ["rank", "params KiB", "grads KiB", "optimizer KiB", "total KiB", "data parallel KiB",
         "share"],
        [[r.rank, kib(r.params), kib(r.grads), kib(r.optimizer), kib(r.total), kib(r.dp_total),
          f"{r.total / r.dp_total if r.dp_total else 1.0:.3f}"] for r in rows])


class BurstProgram:
    """The rank program of ``burst_parallel`` (see the module docstring): ``world`` ranks, the
    plan's global ``batch``, per parameter (and buffer) name of the graph module the ranks of
    the layer that owns it (``param_ranks``), per layer name its ranks (``layer_ranks``; ranks
    outside a layer's set skip it) and, for a layer of several nodes, their names
    (``unit_members``). Gradient buckets hold at most ``bucket_bytes`` (read when a step's
    layout is built). ``overlap=False`` runs backward as one stage, every sync after it.
    ``groups`` holds the subgroups (created on the first distributed step, on every rank in
    the same order)."""

    def __init__(self, world: int, batch: int, param_ranks: tuple[tuple[str, Ranks], ...],
                 layer_ranks: tuple[tuple[str, Ranks], ...] = (),
                 unit_members: tuple[tuple[str, tuple[str, ...]], ...] = (),
                 overlap: bool = True, bucket_bytes: float = DDP_BUCKET_BYTES):
        if not bucket_bytes > 0:
            raise ValueError(f"BurstProgram(bucket_bytes={bucket_bytes!r}): must be > 0")
        self.world = world
        self.batch = batch
        self.param_ranks = dict(param_ranks)
        self.layer_ranks = dict(layer_ranks)
        self.unit_members = dict(unit_members)
        self.overlap = overlap
        self.bucket_bytes = bucket_bytes
        self.groups = SubgroupCache()
        self.comm_group: Optional[dist.ProcessGroup] = None
        self.fallback_reason = ""
        self._ready = False
        self._local: Optional[tuple[fx.GraphModule, fx.GraphModule]] = None
        self._layouts: dict[tuple, StepLayout] = {}
        self._sync_factory: Optional[GradSyncFactory] = None
        self._syncs: dict[Ranks, GradSync] = {}
        self.last_state: Optional[StateBytes] = None

    def use_grad_sync(self, factory: GradSyncFactory) -> None:
        """Sync each bucket's gradients through ``factory(group)`` (one :class:`GradSync` per
        set of ranks, e.g. a compressor from the ``compression`` pass; each bucket goes through
        its ``bucket``) instead of a plain all-reduce."""
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
            self.groups.create(r for r in self.param_ranks.values() if 1 < len(r) < size)
            self.comm_group = new_group()  # the comm stream's world-wide collectives
            self._ready = True

    def local_module(self, gm: fx.GraphModule) -> fx.GraphModule:
        """``gm`` specialised for this rank (:func:`specialise`), built once per graph."""
        if self._local is None or self._local[0] is not gm:
            self._local = (gm, specialise(gm, self.layer_ranks, dist.get_rank(),
                                          self.unit_members))
        return self._local[1]

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """The global output on every rank (each layer's rows from the ranks that own it)."""
        if is_distributed():
            self._check(args)
            return self.local_module(gm)(*args, **kwargs)
        return gm(*args, **kwargs)

    # -- owner-only state ------------------------------------------------------------------
    def _rank(self, rank: Optional[int]) -> Optional[int]:
        """``rank``, else this process's rank when distributed (None: one process, which
        holds everything)."""
        if rank is None and is_distributed():
            return dist.get_rank()
        return rank

    def owned(self, gm: fx.GraphModule, rank: Optional[int] = None) -> dict[str, torch.Tensor]:
        """The parameters and buffers of ``gm`` that ``rank`` (default: this rank; in one
        process, all of them) holds, by name (a shared tensor under its first name)."""
        rank = self._rank(rank)
        everyone = tuple(range(self.world))
        named = list(gm.named_parameters()) + list(gm.named_buffers())
        return {n: t for n, t in named
                if rank is None or rank in self.param_ranks.get(n, everyone)}

    def foreign(self, gm: fx.GraphModule, rank: Optional[int] = None) -> list[str]:
        """The trainable parameters of ``gm`` that ``rank`` (default: this rank) does not own,
        by name: it neither receives their gradients nor updates them."""
        mine = {id(t) for t in self.owned(gm, rank).values()}
        return [n for n, p in gm.named_parameters() if p.requires_grad and id(p) not in mine]

    def own_optimizer(self, optimizer: torch.optim.Optimizer, gm: fx.GraphModule,
                      rank: Optional[int] = None) -> list[str]:
        """Remove from ``optimizer`` (in place: its param groups' lists and its state) every
        parameter of ``gm`` that ``rank`` (default: this rank) does not own; returns their
        names. A group left empty stays (a scheduler indexes groups); parameters the graph
        does not use stay. Idempotent: the program calls it on every distributed step.

        >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2),
        ...                                            torch.nn.Linear(2, 2)))
        >>> program = BurstProgram(2, 4, (("0.weight", (0,)), ("0.bias", (0,)),
        ...                               ("1.weight", (0, 1)), ("1.bias", (0, 1))))
        >>> opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        >>> program.own_optimizer(opt, gm, rank=1), [len(g["params"]) for g in opt.param_groups]
        (['0.weight', '0.bias'], [2])
        >>> sorted(program.owned(gm, rank=1))
        ['1.bias', '1.weight']
        >>> program.state_bytes(gm, opt, rank=1)  # doctest: +NORMALIZE_WHITESPACE
        StateBytes(rank=1, params=24, grads=24, optimizer=0, dp_params=56, dp_grads=56,
                   dp_optimizer=0)
        """
        names = self.foreign(gm, rank)
        _remove_params(optimizer, gm, names)
        return names

    def state_dict(self, gm: fx.GraphModule,
                   optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
        """This rank's checkpoint: its ``rank`` and ``world``, the entries of ``gm``'s
        ``state_dict`` it owns (``model``, copies), the state of ``optimizer`` (owner-only
        once a step has run, or after :meth:`own_optimizer`) and each gradient sync's
        compressor state by its ranks (``grad_sync``). Saved with ``torch.save``, it loads
        with ``weights_only=True``; the ranks' ``model`` entries together are the model's
        ``state_dict``."""
        rank = self._rank(None)
        return {"rank": 0 if rank is None else rank, "world": self.world,
                "model": {n: t.detach().clone() for n, t in self._saved(gm).items()},
                "optimizer": None if optimizer is None else optimizer.state_dict(),
                "grad_sync": {_label(r): s.state_dict() for r, s in sorted(self._syncs.items())}}

    def _saved(self, gm: fx.GraphModule) -> dict[str, torch.Tensor]:
        """What a checkpoint holds of ``gm``: the entries of its ``state_dict`` (every name of
        a shared tensor; no non-persistent buffer) that this rank owns."""
        mine = {id(t) for t in self.owned(gm).values()}
        return {n: t for n, t in gm.state_dict(keep_vars=True).items() if id(t) in mine}

    def load_state_dict(self, gm: fx.GraphModule, state: Mapping[str, Any],
                        optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Restore what :meth:`state_dict` returned on the same rank of a job of the same
        world: the owned tensors in place, ``optimizer`` (made owner-only first) and the
        compressors. Raises ``ValueError`` naming the checkpoint's rank, world or tensor that
        does not fit."""
        rank = self._rank(None)
        rank = 0 if rank is None else rank
        if (state.get("rank"), state.get("world")) != (rank, self.world):
            raise ValueError(f"burst_parallel: the checkpoint is rank {state.get('rank')} of "
                             f"{state.get('world')}, but this is rank {rank} of {self.world}")
        mine = self._saved(gm)
        given = state["model"]
        if set(given) != set(mine):
            odd = sorted(set(given) ^ set(mine))
            raise ValueError(f"burst_parallel: checkpoint of rank {rank}: tensor {odd[0]!r} is "
                             f"{'not owned by' if odd[0] in given else 'missing for'} this rank")
        with torch.no_grad():
            for n, t in mine.items():
                if given[n].shape != t.shape:
                    raise ValueError(f"burst_parallel: checkpoint tensor {n!r} has shape "
                                     f"{tuple(given[n].shape)}, the model {tuple(t.shape)}")
                t.copy_(given[n])
        if optimizer is not None and state.get("optimizer") is not None:
            if is_distributed():
                self.own_optimizer(optimizer, gm)
            optimizer.load_state_dict(state["optimizer"])
        for label, s in state.get("grad_sync", {}).items():
            ranks = tuple(int(r) for r in label.split(","))
            sync = self._sync(ranks)
            if sync is None:
                raise ValueError(f"burst_parallel: the checkpoint holds compressor state for "
                                 f"ranks {label}, but this program syncs without one")
            sync.load_state_dict(s)

    def state_bytes(self, gm: fx.GraphModule, optimizer: Optional[torch.optim.Optimizer] = None,
                    rank: Optional[int] = None) -> StateBytes:
        """The bytes of training state ``rank`` (default: this rank) holds, beside data
        parallelism (:class:`StateBytes`)."""
        everything = {id(t): t for t in list(gm.parameters()) + list(gm.buffers())}
        mine = {id(t): t for t in self.owned(gm, rank).values()}
        trainable = {i: p for i, p in everything.items()
                     if isinstance(p, torch.nn.Parameter) and p.requires_grad}
        held = [p for i, p in trainable.items() if i in mine]
        state = optimizer.state if optimizer is not None else {}
        with_state = [p for p in held if state.get(p)]
        opt = sum(_nbytes(t for t in state[p].values() if isinstance(t, torch.Tensor))
                  for p in with_state)
        per_byte = opt / _nbytes(with_state) if with_state else 0.0
        return StateBytes(
            rank=self._rank(rank) or 0, params=_nbytes(mine.values()), grads=_nbytes(held),
            optimizer=opt, dp_params=_nbytes(everything.values()),
            dp_grads=_nbytes(trainable.values()),
            dp_optimizer=round(opt + per_byte * (_nbytes(trainable.values()) - _nbytes(held))))

    # -- the step --------------------------------------------------------------------------
    def buffer_sets(self, gm: fx.GraphModule, size: int) -> dict[Ranks, list[str]]:
        """Buffer names of ``gm`` by the ranks of the layer that updates them (sorted)."""
        everyone = tuple(range(size))
        sets: dict[Ranks, list[str]] = {}
        for name, _ in gm.named_buffers():
            sets.setdefault(self.param_ranks.get(name, everyone), []).append(name)
        return dict(sorted(sets.items()))

    def layout(self, gm: fx.GraphModule, rank: int, size: int,
               run: Optional[fx.GraphModule] = None) -> "StepLayout":
        """This rank's step on ``size`` ranks (one process: forward, backward, optimizer):
        its :class:`Program` and what each piece does. ``run`` is the graph the rank runs
        (default: ``gm`` specialised for ``rank``)."""
        if size > 1:
            run = run if run is not None else specialise(gm, self.layer_ranks, rank,
                                                         self.unit_members)
            mine = [b for b in sync_buckets(gm, self.param_ranks, size, self.bucket_bytes)
                    if rank in b.ranks]
            cut = stages(gm, run, mine, self.overlap)
            parts = forward_parts(run)
        else:
            cut = Stages((), ())
            parts = [("forward", COMPUTE, 0, len(gm.graph.nodes))]
        pieces: list[Piece] = []
        actions: list[tuple[str, Any]] = []

        def add(name: str, stream: str, deps: tuple[int, ...], action: tuple[str, Any]) -> int:
            pieces.append(Piece(name, stream, deps))
            actions.append(action)
            return len(pieces) - 1

        stage = -1
        for k, (name, stream, lo, hi) in enumerate(parts):
            stage = add(name, stream, (stage,) if k else (),
                        ("forward", (hi, k == len(parts) - 1, len(parts) == 1)))
        names = [n.name for n in (run if size > 1 else gm).graph.nodes]
        bounds = [0] + [names.index(c) for c in cut.cuts] + [len(names)]
        moves = {lo: name for name, stream, lo, _ in parts if stream == TRANSFER}
        placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
        syncs: list[int] = []
        for k in range(len(cut.cuts), -1, -1):
            lo, hi = bounds[k], bounds[k + 1]
            move = next((moves[i] for i in range(lo, hi) if i in moves), None)
            if move is not None and not any(names[i] not in placeholders for i in
                                            range(lo, hi) if i not in moves):
                stage = add(f"{move} backward", TRANSFER, (stage,), ("backward", k))
            else:
                stage = add(f"backward {k}", COMPUTE, (stage,), ("backward", k))
            for bucket in (b for b, s in cut.buckets if s == k):
                syncs.append(add(bucket.piece, COMM, (stage,), ("all_reduce", bucket)))
        buffers = self.buffer_sets(gm, size)
        floats = {n for n, b in gm.named_buffers() if b.is_floating_point()}
        for ranks, names in buffers.items() if size > 1 else ():
            if len(ranks) > 1 and rank in ranks and floats.intersection(names):
                add(f"buffers all_reduce {_label(ranks)}", COMM, (stage,),
                    ("buffers_all_reduce", ranks))
        add("optimizer", COMPUTE, tuple(sorted(syncs + [stage])), ("optimizer", None))
        return StepLayout(Program(tuple(pieces), size), cut, tuple(actions), buffers,
                          tuple(self.foreign(gm, rank)) if size > 1 else (),
                          _eager_reason(gm))

    def step_notes(self) -> list[str]:
        """After a distributed step: the training state this rank holds against data
        parallelism (``Compiled.report()`` shows it)."""
        b = self.last_state
        if b is None:
            return []
        share = b.total / b.dp_total if b.dp_total else 1.0
        return [f"burst_parallel: rank {b.rank} holds {b.total / 2**20:.2f} MiB of training "
                f"state (parameters {b.params / 2**20:.2f}, gradients {b.grads / 2**20:.2f}, "
                f"optimizer {b.optimizer / 2**20:.2f}), {share:.0%} of data parallelism's "
                f"{b.dp_total / 2**20:.2f} MiB"]

    def uncaptured(self) -> list[tuple[str, str]]:
        """What the latest step ran uncaptured: the whole step (its compute pieces are eager
        forward/backward stages), with ``fallback_reason`` naming the collective node."""
        return [("-", self.fallback_reason)] if self.fallback_reason else []

    def bind(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> "BurstStep":
        """One training step on the global batch (see the module docstring); its program is
        built once per graph, rank, input shapes and bucket cap. On several ranks, the
        optimizer is made owner-only first (as :meth:`own_optimizer` does)."""
        distributed = is_distributed()
        if distributed:
            self._check(inputs)
        rank, size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        key = (id(gm), rank, size, self.bucket_bytes, self.overlap) + tuple(
            (tuple(t.shape), t.dtype) for t in flat_tensors((inputs, targets)))
        run = self.local_module(gm) if distributed else gm
        if key not in self._layouts:
            self._layouts[key] = self.layout(gm, rank, size, run)
        layout = self._layouts[key]
        self.fallback_reason = layout.reason
        if distributed:
            _remove_params(optimizer, gm, layout.foreign)
        return BurstStep(self, layout, gm, run, inputs, targets, loss_fn, optimizer)

    def _sync(self, ranks: Ranks) -> Optional[GradSync]:
        if self._sync_factory is None:
            return None
        if ranks not in self._syncs:
            self._syncs[ranks] = self._sync_factory(self._group(ranks))
        return self._syncs[ranks]

    def _group(self, ranks: Ranks) -> Optional[dist.ProcessGroup]:
        """The group a set's collectives run on (the comm stream's own, never the default
        group that backward's scatter/gather transfers use)."""
        return self.comm_group if len(ranks) == dist.get_world_size() else self.groups.get(ranks)


def _remove_params(optimizer: torch.optim.Optimizer, gm: fx.GraphModule,
                   names: Sequence[str]) -> None:
    """Take ``gm``'s parameters ``names`` out of ``optimizer``'s param groups (the lists
    themselves, in place) and state."""
    params = dict(gm.named_parameters())
    drop = {id(params[n]) for n in names}
    for group in optimizer.param_groups:
        removed = [p for p in group["params"] if id(p) in drop]
        if removed:
            group["params"][:] = [p for p in group["params"] if id(p) not in drop]
            for p in removed:
                optimizer.state.pop(p, None)


def _eager_reason(gm: fx.GraphModule) -> str:
    node = next((n for n in gm.graph.nodes if n.op == "call_function" and
                 n.target in _COLLECTIVES), None)
    if node is None:
        return ("burst_parallel: eager forward and backward pieces: each rank runs its "
                "specialised graph (skipped layers) with autograd")
    return (f"burst_parallel: eager forward and backward pieces: node {node.name!r} "
            f"({node.target}) is a collective inside the graph, run with autograd")


@dataclass(frozen=True)
class StepLayout:
    """One rank's step of a :class:`BurstProgram`: the ``program``, its backward ``stages``
    (with the rank's gradient buckets), per piece what it does (``actions``: the step method
    and its argument), the buffer names by the ranks that sync them, the trainable parameters
    the rank does not own (``foreign``) and why the pieces run eagerly (``reason``)."""

    program: Program
    stages: Stages
    actions: tuple[tuple[str, Any], ...]
    buffer_sets: dict[Ranks, list[str]]
    foreign: tuple[str, ...]
    reason: str


@dataclass
class BurstStep:
    """One step of a :class:`BurstProgram` bound to tensors (a ``StepWork``): ``work(index,
    piece)`` gives what each piece of ``program`` does, ``loss()`` the global loss after."""

    owner: BurstProgram
    layout: StepLayout
    gm: fx.GraphModule
    run: fx.GraphModule
    inputs: tuple
    targets: Any
    loss_fn: Callable
    optimizer: torch.optim.Optimizer
    _loss: Optional[torch.Tensor] = None
    _runner: Optional[_CutRunner] = None
    _pairs: list = field(default_factory=list)
    _synced: dict = field(default_factory=dict)

    @property
    def program(self) -> Program:
        return self.layout.program

    def work(self, index: int, piece: Piece) -> Callable[[], Any]:
        what, arg = self.layout.actions[index]
        method = getattr(self, f"_{what}")
        return method if arg is None else functools.partial(method, arg)

    def loss(self) -> torch.Tensor:
        if self._loss is None:
            raise RuntimeError("burst_parallel: the step's loss is read before its forward ran")
        return self._loss.detach()

    def _forward(self, part: tuple[int, bool, bool]) -> None:
        """Run the rank's graph up to node position ``stop`` (a forward piece: the nodes
        after the previous piece's); the last piece computes the loss on the output."""
        stop, last, whole = part
        if whole and not self.layout.stages.cuts:  # one piece, no cut: the module itself
            self.optimizer.zero_grad(set_to_none=True)
            self._loss = self.loss_fn(self.run(*self.inputs), self.targets)
            return
        if self._runner is None:
            self.optimizer.zero_grad(set_to_none=True)
            self._runner = _CutRunner(self.run, self.layout.stages.cuts)
            self._runner.start(*self.inputs)
        self._runner.advance(stop)
        if last:
            self._pairs = self._runner.pairs
            self._loss = self.loss_fn(self._runner.result, self.targets)
            self._runner = None

    def _backward(self, k: int) -> None:
        if k == len(self.layout.stages.cuts):
            self._loss.backward()
            return
        pairs = [(o, l.grad) for o, l in self._pairs[k] if l.grad is not None]
        self._pairs[k] = []
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def _all_reduce(self, bucket: Bucket) -> None:
        """Sum the bucket's gradients over its ranks (this rank is one of them).

        Each rank's gradient is already its share of the global-batch gradient (the loss is
        scaled by its rows), so the sync is a sum; through a :class:`GradSync` (which averages)
        the result is scaled back by the number of ranks."""
        params = dict(self.gm.named_parameters())
        named = [(n, params[n]) for n in bucket.names]
        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        sync = self.owner._sync(bucket.ranks)
        if sync is None:
            all_reduce_tensors([p.grad for _, p in named], self.owner._group(bucket.ranks))
        else:
            synced = sync.bucket({n: p.grad for n, p in named})
            for n, p in named:
                p.grad.copy_(synced[n] * len(bucket.ranks))
        for n, p in named:
            self._synced[n] = (p.grad, p.grad._version)

    def _buffers_all_reduce(self, ranks: Ranks) -> None:
        """Average the set's floating-point buffers (running statistics) over its ranks."""
        names = set(self.layout.buffer_sets[ranks])
        floats = [b for n, b in self.gm.named_buffers() if n in names and b.is_floating_point()]
        all_reduce_tensors(floats, self.owner._group(ranks), average=True)

    def _optimizer(self) -> None:
        params = dict(self.gm.named_parameters())
        for n in self.layout.foreign:  # a skipped unit's members that ran on zero rows
            params[n].grad = None
        for n, (grad, version) in self._synced.items():
            if params[n].grad is not grad or grad._version != version:
                raise RuntimeError(f"burst_parallel: the gradient of {n!r} changed after its "
                                   f"sync (a backward stage after the one that should "
                                   f"finalise it reached it)")
        self.optimizer.step()
        if is_distributed():
            self.owner.last_state = self.owner.state_bytes(self.gm, self.optimizer)

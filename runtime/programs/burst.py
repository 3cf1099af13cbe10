"""Burst-parallel training as a program: each rank's forward and backward on the compute stream,
each GPU set's gradient sync on the comm stream as soon as that set's gradients are final.

Every rank passes the same global batch. Each layer runs on its ranks' sample ranges; a rank
outside a layer's set skips it: on its first distributed step the program specialises the graph
for its rank (:func:`specialise`), replacing each such layer with an empty (zero-row) tensor of
the layer's output shape (:func:`skipped_layer`), so code such as ``x.view(x.size(0), -1)``
never runs on zero rows. The empty tensor requires grad exactly when the layer's output would
(its module has trainable parameters or an input requires grad), so every rank takes part in
the same backward transfers. The model output is gathered to every rank, so every rank computes
the same global loss, and backward sends each row's gradient back to the rank that computed the
row. A parameter's gradient is then summed over the ranks of its layer (a subgroup all-reduce)
and broadcast to the other ranks, so every replica takes the same optimizer step and the
parameters stay identical everywhere (through a ``GradSync`` when the ``compression`` pass wraps
the sync, :meth:`BurstProgram.use_grad_sync`). Buffers a layer updates in training (BatchNorm's
running statistics) are averaged over the layer's ranks after each step and broadcast to the
others, so every rank holds the same model; BatchNorm normalizes each rank's rows with their own
statistics, as data parallelism without ``SyncBatchNorm`` does. Without a process group (one
process) the ops are the identity and a step is plain training.

The program of one rank (:meth:`BurstProgram.layout`, built once per input shape and rank):

* ``forward`` (compute): the rank's graph with autograd, and the loss on the gathered output;
* ``backward k`` (compute), from the last segment to the first: the graph is cut after the
  ``tidal::scatter``/``gather`` node that ends the forward segment where some GPU set's
  parameters are last used; each cut's live values are detached there, and ``backward k`` runs
  autograd from segment k's outputs (the loss, or the gradients the later stage left on the
  detached values) back to its inputs, so a set's gradients are final when its stage ends;
* per GPU set, after the stage that finalises it: ``all_reduce r0,r1`` (comm, on the ranks of
  the set only) and, for a set smaller than the world, ``broadcast r0,r1`` (comm, every rank);
* ``buffers all_reduce ...`` / ``buffers broadcast ...`` (comm, after backward);
* ``optimizer`` (compute), after the gradient syncs: it overlaps the buffer syncs.

The comm stream is one FIFO in program order, so every rank issues its collectives in the same
order; they run on process groups of their own (a world-wide copy and the sets' subgroups), so
they overlap the scatter/gather transfers of backward, which use the default group. The compute
pieces run eagerly (``fallback_reason`` says why: the scatter/gather collectives inside the
graph), not as captured segments. The program is the same object the simulator runs
(``tidal.sim.programs.program_tasks``): a comm piece of the same name on several ranks is one
collective across them.

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

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils import _pytree as pytree

from tidal.ir import meta
from tidal.ir.collectives import GATHER, SCATTER, SubgroupCache, check_layer_ranks, new_group
from tidal.ir.node_runner import fetch_attr, flat_tensors
from tidal.runtime.distributed import all_reduce_tensors, copy_from_flat, is_distributed
from tidal.runtime.grad_sync import GradSync, GradSyncFactory
from tidal.runtime.program import COMM, COMPUTE, Piece, Program

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


def from_plan(gm: fx.GraphModule, plan: Any) -> "BurstProgram":
    """The rank program of a ``burst_parallel`` plan (a ``BurstPlan``: ``world``, ``batch`` and
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
    return BurstProgram(plan.world, plan.batch, tuple(sorted(owners.items())),
                        tuple(ranks_of.items()),
                        tuple((unit, tuple(ms)) for unit, ms in members.items()))


@dataclass(frozen=True)
class Stages:
    """How a graph's backward is cut: ``cuts``, the names of the collective nodes after which
    the forward is cut (segment k ends at ``cuts[k]``), and per GPU set (every set a parameter
    belongs to) the segment whose backward stage finalises its gradients (``final``, sorted by
    stage order: last segment first)."""

    cuts: tuple[str, ...]
    final: tuple[tuple[Ranks, int], ...]


def stages(gm: fx.GraphModule, sets: dict[Ranks, list[str]], overlap: bool = True) -> Stages:
    """The backward stages of ``gm`` for gradient sets ``sets`` (ranks -> parameter names): a
    set's gradients are final once the backward of the earliest forward segment (segments end
    at ``tidal::scatter``/``gather`` nodes) that uses one of its parameters has run. Only the
    cuts that finalise some set are kept; ``overlap=False`` keeps none (one backward stage).

    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    >>> stages(gm, {(0,): ["0.weight", "0.bias"]})
    Stages(cuts=(), final=(((0,), 0),))
    """
    collectives = [n for n in gm.graph.nodes if n.op == "call_function" and
                   n.target in _COLLECTIVES]
    segment: dict[int, int] = {}  # id(parameter) -> earliest segment using it
    seen = 0
    for node in gm.graph.nodes:
        used: list[Any] = []
        if node.op == "call_module":
            used = list(gm.get_submodule(node.target).parameters())
        elif node.op == "get_attr":
            used = [fetch_attr(gm, str(node.target))]
        for t in used:
            segment.setdefault(id(t), seen)
        if node.op == "call_function" and node.target in _COLLECTIVES:
            seen += 1
    params = dict(gm.named_parameters(remove_duplicate=False))
    first = {ranks: min((segment.get(id(params[n]), 0) for n in names), default=0)
             for ranks, names in sets.items()}
    keep = sorted(set(first.values()))[1:] if overlap else []  # the earliest: stage 0
    stage_of = {s: sum(1 for k in keep if k <= s) for s in set(first.values())}
    final = sorted(((r, stage_of[s]) for r, s in first.items()), key=lambda x: (-x[1], x[0]))
    return Stages(tuple(collectives[k - 1].name for k in keep), tuple(final))


class _CutRunner(fx.Interpreter):
    """Runs a graph, detaching every value that lives across a cut (after a node named in
    ``cuts``): each tensor that requires grad and is not a leaf becomes a new leaf (cloned, so
    later in-place ops keep working, unless it shares storage with another such value: then
    only detached, keeping the aliasing). ``pairs[k]``: (original, leaf) at cut k."""

    def __init__(self, module: fx.GraphModule, cuts: tuple[str, ...]):
        super().__init__(module)
        self.cuts = set(cuts)
        order = {n: i for i, n in enumerate(module.graph.nodes)}
        missing = self.cuts - {n.name for n in order}
        if missing:
            raise ValueError(f"burst_parallel: the rank's graph has no node {sorted(missing)[0]!r} "
                             f"to cut backward after (every rank must run every collective)")
        self.order = order
        self.last_use = {n: max((order[u] for u in n.users), default=-1) for n in order}
        self.pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        if n.name not in self.cuts:
            return value
        self.env[n] = value
        live = [m for m in self.env if self.last_use[m] > self.order[n]]
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
        return self.env[n]


def _label(ranks: Ranks) -> str:
    return ",".join(map(str, ranks))


class BurstProgram:
    """The rank program of ``burst_parallel`` (see the module docstring): ``world`` ranks, the
    plan's global ``batch``, per parameter (and buffer) name of the graph module the ranks of
    the layer that owns it (``param_ranks``), per layer name its ranks (``layer_ranks``; ranks
    outside a layer's set skip it) and, for a layer of several nodes, their names
    (``unit_members``). ``overlap=False`` runs backward as one stage, every sync after it.
    ``groups`` holds the subgroups (created on the first distributed step, on every rank in
    the same order)."""

    def __init__(self, world: int, batch: int, param_ranks: tuple[tuple[str, Ranks], ...],
                 layer_ranks: tuple[tuple[str, Ranks], ...] = (),
                 unit_members: tuple[tuple[str, tuple[str, ...]], ...] = (),
                 overlap: bool = True):
        self.world = world
        self.batch = batch
        self.param_ranks = dict(param_ranks)
        self.layer_ranks = dict(layer_ranks)
        self.unit_members = dict(unit_members)
        self.overlap = overlap
        self.groups = SubgroupCache()
        self.comm_group: Optional[dist.ProcessGroup] = None
        self.fallback_reason = ""
        self._ready = False
        self._local: Optional[tuple[fx.GraphModule, fx.GraphModule]] = None
        self._layouts: dict[tuple, StepLayout] = {}
        self._sync_factory: Optional[GradSyncFactory] = None
        self._syncs: dict[Ranks, GradSync] = {}

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
            self.comm_group = new_group()  # the comm stream's world-wide collectives
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

    def grad_sets(self, gm: fx.GraphModule, size: int) -> dict[Ranks, list[str]]:
        """Trainable parameter names of ``gm`` by the ranks that sync them (sorted)."""
        everyone = tuple(range(size))
        sets: dict[Ranks, list[str]] = {}
        for name, p in gm.named_parameters():
            if p.requires_grad:
                sets.setdefault(self.param_ranks.get(name, everyone), []).append(name)
        return dict(sorted(sets.items()))

    def buffer_sets(self, gm: fx.GraphModule, size: int) -> dict[Ranks, list[str]]:
        """Buffer names of ``gm`` by the ranks of the layer that updates them (sorted)."""
        everyone = tuple(range(size))
        sets: dict[Ranks, list[str]] = {}
        for name, _ in gm.named_buffers():
            sets.setdefault(self.param_ranks.get(name, everyone), []).append(name)
        return dict(sorted(sets.items()))

    def layout(self, gm: fx.GraphModule, rank: int, size: int) -> "StepLayout":
        """This rank's step on ``size`` ranks (one process: forward, backward, optimizer):
        its :class:`Program` and what each piece does."""
        grads, buffers = self.grad_sets(gm, size), self.buffer_sets(gm, size)
        cut = stages(gm, grads, self.overlap) if size > 1 else Stages((), ())
        pieces: list[Piece] = []
        actions: list[tuple[str, Any]] = []

        def add(name: str, stream: str, deps: tuple[int, ...], action: tuple[str, Any]) -> int:
            pieces.append(Piece(name, stream, deps))
            actions.append(action)
            return len(pieces) - 1

        stage = add("forward", COMPUTE, (), ("forward", None))
        syncs: list[int] = []
        for k in range(len(cut.cuts), -1, -1):
            stage = add(f"backward {k}", COMPUTE, (stage,), ("backward", k))
            for ranks in (r for r, s in cut.final if s == k):
                if rank in ranks:
                    syncs.append(add(f"all_reduce {_label(ranks)}", COMM, (stage,),
                                     ("all_reduce", ranks)))
                if len(ranks) < size:
                    syncs.append(add(f"broadcast {_label(ranks)}", COMM, (stage,),
                                     ("broadcast", ranks)))
        floats = {n for n, b in gm.named_buffers() if b.is_floating_point()}
        for ranks, names in buffers.items() if size > 1 else ():
            if len(ranks) > 1 and rank in ranks and floats.intersection(names):
                add(f"buffers all_reduce {_label(ranks)}", COMM, (stage,),
                    ("buffers_all_reduce", ranks))
            if len(ranks) < size:
                add(f"buffers broadcast {_label(ranks)}", COMM, (stage,),
                    ("buffers_broadcast", ranks))
        add("optimizer", COMPUTE, tuple(sorted(syncs + [stage])), ("optimizer", None))
        return StepLayout(Program(tuple(pieces), size), cut, tuple(actions), grads, buffers,
                          _eager_reason(gm))

    def uncaptured(self) -> list[tuple[str, str]]:
        """What the latest step ran uncaptured: the whole step (its compute pieces are eager
        forward/backward stages), with ``fallback_reason`` naming the collective node."""
        return [("-", self.fallback_reason)] if self.fallback_reason else []

    def bind(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> "BurstStep":
        """One training step on the global batch (see the module docstring); its program is
        built once per graph, rank and input shapes."""
        distributed = is_distributed()
        if distributed:
            self._check(inputs)
        rank, size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        key = (id(gm), rank, size) + tuple((tuple(t.shape), t.dtype)
                                           for t in flat_tensors((inputs, targets)))
        if key not in self._layouts:
            self._layouts[key] = self.layout(gm, rank, size)
        layout = self._layouts[key]
        self.fallback_reason = layout.reason
        run = self.local_module(gm) if distributed else gm
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
    """One rank's step of a :class:`BurstProgram`: the ``program``, its backward ``stages``,
    per piece what it does (``actions``: the step method and its argument), the trainable
    parameter and the buffer names by the ranks that sync them, and why the pieces run eagerly
    (``reason``)."""

    program: Program
    stages: Stages
    actions: tuple[tuple[str, Any], ...]
    grad_sets: dict[Ranks, list[str]]
    buffer_sets: dict[Ranks, list[str]]
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
    _pairs: list = field(default_factory=list)
    _flat: dict = field(default_factory=dict)
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

    def _forward(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.layout.stages.cuts:
            runner = _CutRunner(self.run, self.layout.stages.cuts)
            out = runner.run(*self.inputs)
            self._pairs = runner.pairs
        else:
            out = self.run(*self.inputs)
        self._loss = self.loss_fn(out, self.targets)

    def _backward(self, k: int) -> None:
        if k == len(self.layout.stages.cuts):
            self._loss.backward()
            return
        pairs = [(o, l.grad) for o, l in self._pairs[k] if l.grad is not None]
        self._pairs[k] = []
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def _params(self, ranks: Ranks) -> list[tuple[str, torch.nn.Parameter]]:
        names = self.layout.grad_sets[ranks]
        params = dict(self.gm.named_parameters())
        named = [(n, params[n]) for n in names]
        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return named

    def _all_reduce(self, ranks: Ranks) -> None:
        """Sum the set's gradients over its ranks (this rank is one of them).

        Each rank's gradient is already its share of the global-batch gradient (the loss is
        scaled by its rows), so the sync is a sum; through a :class:`GradSync` (which averages)
        the result is scaled back by the number of ranks."""
        named = self._params(ranks)
        sync = self.owner._sync(ranks)
        if sync is None:
            flat = torch.cat([p.grad.reshape(-1) for _, p in named])
            dist.all_reduce(flat, group=self.owner._group(ranks))
        else:
            synced = sync({n: p.grad for n, p in named})
            flat = torch.cat([synced[n].reshape(-1) for n, _ in named]) * len(ranks)
        if len(ranks) < self.program.world:
            self._flat[ranks] = flat
        else:
            self._copy(flat, named)

    def _broadcast(self, ranks: Ranks) -> None:
        """Give the set's summed gradients to every rank, from its first rank."""
        named = self._params(ranks)
        flat = self._flat.pop(ranks, None)
        if flat is None:
            flat = torch.empty(sum(p.numel() for _, p in named), dtype=named[0][1].dtype)
        dist.broadcast(flat, src=ranks[0], group=self.owner.comm_group)
        self._copy(flat, named)

    def _copy(self, flat: torch.Tensor, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        copy_from_flat(flat, [p.grad for _, p in named])
        for n, p in named:
            self._synced[n] = (p.grad, p.grad._version)

    def _buffers(self, ranks: Ranks) -> list[torch.Tensor]:
        names = set(self.layout.buffer_sets[ranks])
        return [b for n, b in self.gm.named_buffers() if n in names]

    def _buffers_all_reduce(self, ranks: Ranks) -> None:
        """Average the set's floating-point buffers (running statistics) over its ranks."""
        floats = [b for b in self._buffers(ranks) if b.is_floating_point()]
        all_reduce_tensors(floats, self.owner._group(ranks), average=True)

    def _buffers_broadcast(self, ranks: Ranks) -> None:
        """Every buffer of a layer on a subset of the ranks, from the first of them (the
        ranks outside the set did not run the layer)."""
        bufs = self._buffers(ranks)
        for dtype in sorted({b.dtype for b in bufs}, key=str):
            same = [b for b in bufs if b.dtype == dtype]
            flat = torch.cat([b.reshape(-1) for b in same])
            dist.broadcast(flat, src=ranks[0], group=self.owner.comm_group)
            copy_from_flat(flat, same)

    def _optimizer(self) -> None:
        params = dict(self.gm.named_parameters())
        for n, (grad, version) in self._synced.items():
            if params[n].grad is not grad or grad._version != version:
                raise RuntimeError(f"burst_parallel: the gradient of {n!r} changed after its "
                                   f"sync (a backward stage after the one that should "
                                   f"finalise it reached it)")
        self.optimizer.step()

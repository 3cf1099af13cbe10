"""Wavelet's round-robin model parallelism (§3.3) as a program of pieces on streams.

A ``RoundRobinPlan`` carries, per rank, the action list of Figure 10's schedule on a graph the
pass split into ``submod_0 .. submod_{N-1}``. :class:`RoundRobinProgram` turns each rank's list
into a :class:`~tidal.runtime.program.Program` that
:class:`~tidal.runtime.program.ProgramExecutor` runs:

- ``S p`` (stream ``load``) switches the rank to partition p: with a process group it loads
  p's weights, accumulated gradients and optimizer state and evicts every partition the rank
  no longer needs (``tidal.runtime.weights.residency``: the bytes go to a per-rank store, the
  tensors keep their identity and hold no bytes), so that a rank holds at most two partitions:
  the one it computes and the one it prefetches. A switch keeps the partition of the latest
  compute piece and the one waiting for its update, and waits only for the pieces that used a
  partition it evicts (``S p+1`` for ``F p−1`` and its transfer; in the backward ``S p−1`` for
  ``U p+1``), so it overlaps the compute of the partition it keeps. ``F``/``B`` of p wait for
  it. In one process it only counts the switch and the weight bytes it would load;
- ``F p,b`` (``compute``) runs partition p on batch b with the activations received from the
  previous rank; ``B p,b`` (``compute``) runs its backward with the gradients received from the
  next rank. Both are segments of one captured joint graph of the partition (``make_fx`` of its
  forward, the loss on the last partition, and ``torch.autograd.grad`` with respect to its
  parameters and its input activations, the gradients of its outputs as inputs): ``F`` runs the
  nodes the outputs need (and the buffer updates), ``B`` the rest, on the values ``F`` left.
  The joint graph is lowered and captured (``tidal.runtime.program.CapturedProgram``: CUDA
  graphs on a GPU, the straight-line replay on the CPU), one copy per rank of this process,
  since the runs of a partition on different micro-batches are alive at once; a node that
  cannot be captured (an in-place buffer update, a host sync) runs uncaptured in its segment,
  and ``uncaptured()`` names it. A partition that cannot be captured at all (data-dependent
  code) runs eagerly with autograd, and ``fallback_reason`` says which and why;
- ``X`` (``comm``) moves activations to the next rank (forward) or their gradients to the
  previous rank (backward) with ``torch.distributed`` point-to-point ops;
- ``A p`` (``comm``) all-reduces partition p's gradients (the sum over the N batches: each
  micro-batch loss is divided by N, so the result is the global-batch mean gradient) and
  averages its floating-point buffers; after the ``compression`` pass each partition's
  gradients go through a compressor of their own instead (``use_grad_sync``);
- ``loss`` (``comm``) all-reduces the step's loss as soon as the last forward ran;
- ``U`` steps the optimizer. With a process group each partition is updated on its own,
  ``U p`` (on its own compute stream, ``update``) after ``A p`` and while p is still resident (its state tensors too), in
  the backward of partition p − 1 (Wavelet: "update the parameters of each model partition
  accordingly"), before the switch that evicts p; the step then ends with ``restore``
  (``load``), which loads every partition back, so that between steps the model is whole
  (``state_dict()``, inference, the gradients); the next step's first switch evicts again, and
  ``stats`` reports the most this rank held during the step against the whole model, and
  what the switches, the updates and the restore cost (``step_notes()``). In one process,
  ``U`` (``compute``) steps the optimizer once, after every all-reduce.

Dependencies come from the schedule, so communication overlaps compute where the schedule lets
it: the all-reduce of partition p runs during the backward of partition p − 1 (its gradient
transfer goes first on the comm stream, so that backward waits only for the transfer), and the
loss all-reduce during the first backward. Every rank's comm pieces are in the same order, so
the point-to-point ops and collectives match across ranks; a piece that fails makes the rest of
the step fail at once (naming it), so a rank waits for a dead peer at most the group's timeout.

With a process group of N ranks each rank runs its own list; with none, all N ranks' lists run
in this process as one program (pieces named ``r<rank>:``, the transfers move tensors between
the ranks' states, the all-reduce is the shared ``.grad`` accumulation and no compressor runs),
so the schedule runs anywhere.

Example:
    >>> import torch, tidal
    >>> from tidal.passes.round_robin import RoundRobin
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> c = tidal.compile(model, (torch.randn(4, 4),), passes=[RoundRobin(partitions=2)],
    ...                   loss_fn=torch.nn.functional.cross_entropy,
    ...                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> _ = c.step((torch.randn(4, 4),), torch.tensor([0, 1, 1, 0]))
    >>> c.executor.stats["switches"], c.executor.fallback_reason, c.executor.uncaptured()
    (3, '', [])
    >>> [(p.name, p.stream) for p in c.executor.last_program.pieces][:6]
    [('r0:S0', 'load'), ('r1:S0', 'load'), ('r0:F0,0', 'compute'), ('r1:F0,1', 'compute'),
     ('r0:X0 fwd', 'comm'), ('r1:X0 fwd', 'comm')]
"""
from __future__ import annotations

import functools
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_unflatten

from tidal.ir.errors import PlanError, TraceError
from tidal.ir.node_runner import fetch_attr
from tidal.ir.schedule import split_batch
from tidal.runtime.backend import backend_for
from tidal.runtime.distributed import all_reduce_tensors, collective_device, rank_and_size
from tidal.runtime.comm.grad_sync import GradSync, GradSyncFactory
from tidal.runtime.program import (COMM, COMPUTE, CapturedProgram, CapturedRun, Piece,
                                   Program)
from tidal.runtime.weights.residency import PartitionResidency

PLAN_KIND = "RoundRobinPlan"
LOAD = "load"
UPDATE = "update"
"""The stream of the per-partition optimizer steps (a compute stream of its own: an update
overlaps the backward of the next partition down, as Wavelet's Fig. 10 runs it)."""


def from_plan(gm: fx.GraphModule, plan: Any) -> "RoundRobinProgram":
    """The rank program of a ``round_robin`` plan on the graph the pass split into
    partitions."""
    return RoundRobinProgram(gm, plan)


def check_all_owned(root: torch.nn.Module, owned_ids: set[int]) -> None:
    """Raise ``PlanError`` naming the trainable parameters of ``root`` whose ids are not in
    ``owned_ids``: no partition would all-reduce them, so the ranks' copies would drift apart
    while the loss still looks right.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 2)
        >>> check_all_owned(m, {id(m.weight)})
        Traceback (most recent call last):
        ...
        tidal.ir.errors.PlanError: round_robin: parameter(s) 'bias' belong to no partition, ...
    """
    left = [k for k, prm in root.named_parameters()
            if prm.requires_grad and id(prm) not in owned_ids]
    if left:
        raise PlanError(f"round_robin: parameter(s) {', '.join(map(repr, left[:5]))}"
                        f"{' and more' if len(left) > 5 else ''} belong to no partition, so "
                        "their gradients would never be all-reduced and the ranks would drift "
                        "apart")


# -- the split graph ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Stage:
    module: torch.nn.Module
    args: tuple[fx.Node, ...]
    produced: tuple[str, ...]      # names of the top-level values this partition outputs
    sends: tuple[str, ...]         # names live after this partition (sent to the next rank)


class _Param(NamedTuple):
    """A trainable parameter a partition uses: its ``name`` (``submod_p.<local>`` or the
    top-level ``get_attr`` target), the parameter, and its name inside the partition's
    submodule (None for one the top level hands over through ``get_attr``)."""

    name: str
    param: torch.nn.Parameter
    local: Optional[str]


def _recv_buffer(like: torch.Tensor) -> torch.Tensor:
    """A contiguous buffer to receive a tensor shaped like ``like`` (point-to-point ops need
    contiguous buffers; ``empty_like`` keeps a transposed tensor's strides)."""
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _floats(values: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in values.items() if v.is_floating_point()]


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad`` as autograd accumulates (a copy first: graph outputs may alias)."""
    if param.grad is None:
        param.grad = grad.detach().clone()
    else:
        param.grad.add_(grad)


def _size(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _failed_line(exc: BaseException) -> str:
    """The innermost line of generated graph code (an fx node) in ``exc``'s traceback, or in
    that of the error it was raised from ('' if none)."""
    for e in (exc, exc.__cause__):
        if e is not None:
            line = next((f.line.strip() for f in reversed(traceback.extract_tb(
                e.__traceback__)) if f.filename.startswith("<eval_with_key") and f.line), "")
            if line:
                return line
    return ""


def _failure(what: str, exc: BaseException) -> str:
    """``what``, the innermost line of generated graph code (an fx node) that raised, and the
    error's first line."""
    line = _failed_line(exc)
    where = f" at `{line}`" if line else ""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{what}{where}: {type(exc).__name__}: {first}"


# -- a partition's captured forward and backward ----------------------------------------------
@dataclass(frozen=True)
class _StageGraph:
    """Partition p's forward and backward on one micro-batch shape as one joint aten graph
    (``joint``), its nodes ordered so that the ``F`` segment (``forward_nodes``: what the
    forward outputs need, and the buffer updates) comes before the ``B`` segment
    (``backward_nodes``: the rest). Its inputs: the trainable parameters, the float input
    activations and the constants (buffers, model inputs, integer activations, targets), bound
    at ``F``, then the gradients of the float outputs (``n_grads`` of them), filled in at ``B``;
    its outputs: the forward values (``n_forward``; the micro-batch loss on the last
    partition), the gradients of the float input activations (``n_leaves``), then those of the
    parameters that get one (``has_grad``).

    The joint graph runs lowered and captured (``tidal.runtime.program.CapturedProgram``: a
    CUDA graph per static run of nodes on a GPU, the straight-line replay on the CPU; a node
    that cannot be captured runs uncaptured, named by ``uncaptured``), one captured copy per
    rank of this process (:meth:`run`): on a GPU a copy's inputs and outputs are static
    buffers, and in one process the N ranks' runs of a partition are alive at once. ``example``
    holds the flat inputs a copy is captured on (on copies of them), ``labels`` what the
    constants' placeholders hold (``'buffer running_mean'``), for :meth:`uncaptured`."""

    joint: fx.GraphModule
    forward_nodes: tuple[str, ...]
    backward_nodes: tuple[str, ...]
    n_forward: int
    n_leaves: int
    n_grads: int
    has_grad: tuple[bool, ...]
    example: tuple
    labels: dict[str, str]
    copies: dict = field(default_factory=dict, compare=False)  # rank -> CapturedProgram

    def captured(self, rank: int) -> CapturedProgram:
        """Rank ``rank``'s captured copy (lowered and captured on first use)."""
        if rank not in self.copies:
            device = next((t.device for t in self.example if isinstance(t, torch.Tensor)), "cpu")
            pieces = (Piece("F", COMPUTE, (), self.forward_nodes),
                      Piece("B", COMPUTE, (0,), self.backward_nodes))
            self.copies[rank] = CapturedProgram.build(Program(pieces, 1), self.joint,
                                                      self.example, backend_for(device))
        return self.copies[rank]

    def uncaptured(self) -> list[tuple[str, str]]:
        """(node, reason) of the joint graph's nodes that run uncaptured, the reason naming
        what the node's constant inputs hold."""
        nodes = {x.name: x for x in self.joint.graph.nodes}
        out = []
        for node, why in self.captured(next(iter(self.copies), 0)).uncaptured():
            held = [self.labels[a.name] for a in nodes[node].all_input_nodes
                    if a.name in self.labels]
            out.append((node, f"{why} ({', '.join(held)})" if held else why))
        return out

    def run(self, rank: int, bound: Sequence[Any]) -> tuple[CapturedRun, list[torch.Tensor]]:
        """A run of rank ``rank``'s copy on the inputs bound at ``F``, and the buffers its
        ``B`` reads the output gradients from (copy them in before it runs)."""
        grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device)
                 for t in self.example[len(self.example) - self.n_grads:]]
        return self.captured(rank).run([*bound, *grads]), grads

    def segment(self, run: CapturedRun, index: int) -> None:
        """Run ``F`` (``index`` 0) or ``B`` (1) of ``run`` (a segment with no nodes: nothing)."""
        if index in run.captured.steps:
            run.segment(index)()

    def outputs(self, run: CapturedRun, start: int, stop: Optional[int]) -> list[Any]:
        """The joint graph's outputs ``start:stop`` once the segment computing them ran (on a
        GPU, static buffers that the copy's next run overwrites)."""
        out = next(n for n in self.joint.graph.nodes if n.op == "output")
        return [run.value(a) if isinstance(a, fx.Node) and a.op != "get_attr" else
                fetch_attr(self.joint, a.target) if isinstance(a, fx.Node) else a
                for a in list(out.args[0])[start:stop]]


def _split_joint(gm: fx.GraphModule, n_bound: int, n_forward: int
                 ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split a joint graph into the nodes the forward outputs (and the in-place buffer updates
    that do not wait for output gradients) need, and the rest, moving the rest after the
    first in ``gm`` (still in topological order: nothing the forward needs comes from the
    rest); see :class:`_StageGraph`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    grads_in = placeholders[n_bound:]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    roots = [o for o in outputs[:n_forward] if isinstance(o, fx.Node)]
    # backward work: what reads an output gradient or a forward output (the loss's seed); an
    # in-place op before the first of it is the forward's (a BatchNorm statistic's update)
    late: set[fx.Node] = set(grads_in) | {o for o in roots if o.op != "placeholder"}
    backward_began = False
    for n in gm.graph.nodes:
        if any(a in late for a in n.all_input_nodes):
            late.add(n)
            backward_began = True
        elif (not backward_began and isinstance(n.target, torch._ops.OpOverload)
              and n.target._schema.is_mutable):
            roots.append(n)
    need: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(n.all_input_nodes)
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    first = [n for n in body if n in need]
    rest = [n for n in body if n not in need]
    for n in rest:
        output.prepend(n)
    gm.recompile()
    return tuple(n.name for n in first), tuple(n.name for n in rest)


class _Probe(torch.nn.Module):
    """Runs the split graph and returns every top-level value by node name (for shapes)."""

    def __init__(self, split: fx.GraphModule):
        super().__init__()
        self.split = split

    def forward(self, *args: Any) -> dict[str, Any]:
        interp = fx.Interpreter(self.split, garbage_collect_values=False)
        interp.run(*args)
        return {n.name: v for n, v in interp.env.items()}


# -- one step's state ------------------------------------------------------------------------
@dataclass
class _Run:
    """One (partition, batch) on one rank from its ``F`` to its ``B``."""

    sent: dict[str, torch.Tensor] = field(default_factory=dict)  # to the next rank
    loss: Optional[torch.Tensor] = None        # the last partition's micro-batch loss / N
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)   # eager: input leaves
    captured: Optional[CapturedRun] = None     # captured: the run B goes on with
    grads_in: list[torch.Tensor] = field(default_factory=list)  # captured: B's output grads
    leaf_grads: list[torch.Tensor] = field(default_factory=list)  # after B, to the previous rank


@dataclass
class _RankState:
    inbox: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # partition -> inputs
    runs: dict[tuple[int, int], _Run] = field(default_factory=dict)
    grad_out: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    loss: float = 0.0


class _Slot(NamedTuple):
    """What a piece does: the schedule action ``kind`` ('S', 'F', 'B', 'X', 'A', 'U', 'L' for
    the loss all-reduce or 'R' for the end-of-step restore) of ``rank`` on (``partition``,
    ``batch``); ``backward`` tells a backward transfer or switch from a forward one. With a
    process group, ``keep`` is the partitions a switch leaves resident and 'U' updates
    ``partition`` alone; without one, 'U' (``partition`` -1) updates them all."""

    kind: str
    rank: int
    partition: int = 0
    batch: int = 0
    backward: bool = False
    keep: tuple[int, ...] = ()


class _Residency:
    """Which partitions one rank keeps resident while ``_program`` lays out its pieces: a
    switch to ``p`` keeps ``p``, the partition of the latest compute piece (the first switch:
    the next one's, so that it need not load it again) and the partition all-reduced but not
    yet updated, and evicts the others; it waits for every piece that used a partition it
    evicts since that partition was loaded (``users``)."""

    def __init__(self, n: int, switches: Sequence[int]):
        self.resident = set(range(n))   # a step starts whole (the last one's restore)
        self.users: dict[int, list[int]] = {q: [] for q in range(n)}
        self.switches = list(switches)  # the partitions of the switches still to lay out
        self.last: Optional[int] = None
        self.pending: Optional[int] = None

    def use(self, p: int, piece: int, compute: bool = False) -> None:
        self.users[p].append(piece)
        if compute:
            self.last = p

    def switch(self, p: int) -> tuple[tuple[int, ...], list[int]]:
        """(partitions kept, pieces to wait for) of the next switch, to partition ``p``."""
        self.switches.pop(0)
        keep = {p} | ({self.last} if self.last is not None else set(self.switches[:1]))
        keep |= {self.pending} if self.pending is not None else set()
        evicted = self.resident - keep
        deps = sorted(i for q in evicted for i in self.users[q])
        for q in evicted:
            self.users[q] = []
        self.resident = keep
        return tuple(sorted(keep)), deps


class RoundRobinProgram:
    """The rank program of a round-robin plan on the split graph ``split`` (see the module
    docstring). ``model``: the module whose trainable parameters must each be owned by one
    partition (the traced graph before the split, which shares the model's parameters; default
    ``split``). ``stats`` accumulates ``steps``, ``switches`` and ``switch_bytes`` (per rank:
    with a process group the bytes the switches moved in and out, in one process the weight
    bytes they would load) and, with a process group, holds the latest step's residency
    (``resident_peak_partitions``/``resident_peak_bytes``: the most partitions and bytes of
    parameters, gradients and optimizer state this rank held at once during the step, read
    from its tensors; ``whole_model_bytes``: what all partitions' take; ``switch_us`` and
    ``step_switch_bytes``: the switches' time and bytes; ``update_us``: the per-partition
    updates'; ``restore_us``/``restore_bytes``: the end-of-step restore's). ``syncs`` holds
    each partition's gradient sync once ``use_grad_sync`` set one and a step ran;
    ``fallback_reason`` names the partitions that run eagerly and why ('' when every
    partition runs as a captured graph)."""

    def __init__(self, split: fx.GraphModule, plan: Any,
                 model: Optional[torch.nn.Module] = None):
        self.split = split
        self._model = model if model is not None else split
        self.plan = plan
        self.n = plan.partitions
        self.stats: dict[str, float] = {
            "steps": 0, "switches": 0, "switch_bytes": 0, "resident_peak_partitions": 0,
            "resident_peak_bytes": 0, "whole_model_bytes": 0, "switch_us": 0.0,
            "step_switch_bytes": 0, "update_us": 0.0, "restore_us": 0.0, "restore_bytes": 0}
        self.fallback_reason = ""
        self._sync_factory: Optional[GradSyncFactory] = None
        self.syncs: dict[int, GradSync] = {}
        self._stages = self._build_stages()
        self._placeholders = [x for x in split.graph.nodes if x.op == "placeholder"]
        self._output = next(x for x in split.graph.nodes if x.op == "output")
        self._params = [self._partition_params(p) for p in range(self.n)]
        # each trainable parameter once (one may reach a partition both ways)
        self._trainable = [list(dict.fromkeys(x.param for x in ps)) for ps in self._params]
        self._owned = self._param_owners()
        # (name, parameter) per partition, each parameter once: what a switch moves
        self._named = [list({id(x.param): (x.name, x.param) for x in ps}.values())
                       for ps in self._params]
        self._residency: Optional[PartitionResidency] = None  # the latest step's (a group)
        self._rank = 0
        self._buffers = self._buffer_owners()
        self._graphs: dict[tuple, list[Optional[_StageGraph]]] = {}
        self._stopped: dict[tuple, list[tuple[str, str]]] = {}  # eager partitions, named
        self._latest: Optional[tuple] = None  # the shape of the latest bound step
        self._programs: dict[tuple, tuple[Program, tuple[_Slot, ...]]] = {}

    def _build_stages(self) -> list[_Stage]:
        g = self.split.graph
        calls = [x for x in g.nodes if x.op == "call_module"]
        if len(calls) != self.n:
            raise ValueError(f"round_robin: the split graph has {len(calls)} partitions, "
                             f"the plan {self.n}")
        part_of: dict[str, int] = {}
        produced: list[list[str]] = [[] for _ in calls]
        for p, call in enumerate(calls):
            for u in call.users:
                part_of[u.name] = p
                produced[p].append(u.name)
        last_use: dict[str, int] = {}
        for p, call in enumerate(calls):
            for a in call.args:
                if isinstance(a, fx.Node) and a.op != "placeholder":
                    last_use[a.name] = max(last_use.get(a.name, -1), p)
        out_node = next(x for x in g.nodes if x.op == "output")
        for a in out_node.all_input_nodes:
            if a.op != "placeholder":
                last_use[a.name] = self.n
        order = [x.name for x in g.nodes]
        stages = []
        for p, call in enumerate(calls):
            sends = tuple(nm for nm in order if nm in part_of and part_of[nm] <= p
                          and last_use.get(nm, -1) > p)
            stages.append(_Stage(self.split.get_submodule(call.target), tuple(call.args),
                                 tuple(produced[p]), sends))
        return stages

    def _partition_params(self, p: int) -> list[_Param]:
        """The trainable parameters partition ``p`` uses: its submodule's and those the top
        level hands it through ``get_attr`` (``x + self.pos_embedding``, a ``cls_token``,
        weights used through ``addmm``)."""
        st = self._stages[p]
        named = [_Param(f"submod_{p}.{k}", prm, k) for k, prm in st.module.named_parameters()]
        for a in st.args:
            value = fetch_attr(self.split, a.target) if a.op == "get_attr" else None
            if isinstance(value, torch.nn.Parameter):
                named.append(_Param(str(a.target), value, None))
        return [x for x in named if x.param.requires_grad]

    def _param_owners(self) -> list[list[tuple[str, torch.nn.Parameter]]]:
        """Each trainable parameter's owning partition, the one whose all-reduce syncs it: the
        lowest partition using it (its last backward). Raises ``PlanError`` naming any
        trainable parameter of the graph that no partition owns."""
        owned: list[list[tuple[str, torch.nn.Parameter]]] = [[] for _ in range(self.n)]
        seen: set[int] = set()
        for p in range(self.n):
            for x in self._params[p]:
                if id(x.param) not in seen:
                    seen.add(id(x.param))
                    owned[p].append((x.name, x.param))
        check_all_owned(self._model, seen)
        return owned

    def _buffer_owners(self) -> list[list[torch.Tensor]]:
        """Per partition, its floating-point buffers (each in its first partition only)."""
        owned: list[list[torch.Tensor]] = [[] for _ in range(self.n)]
        seen: set[int] = set()
        for p, st in enumerate(self._stages):
            for b in st.module.buffers():
                if id(b) not in seen and b.is_floating_point():
                    seen.add(id(b))
                    owned[p].append(b)
        return owned

    def use_grad_sync(self, factory: GradSyncFactory) -> None:
        """Sync each partition's gradients through its own ``factory(None)`` (a
        :class:`~tidal.runtime.comm.grad_sync.GradSync`, e.g. the ``compression`` pass's
        compressor, with its own error-feedback state) instead of a plain all-reduce."""
        if self.syncs:
            raise RuntimeError("round_robin: the gradient sync is fixed after the first step")
        self._sync_factory = factory

    def uncaptured(self) -> list[tuple[str, str]]:
        """(node, reason) of the nodes of the latest bound step's program that run uncaptured:
        per partition, the joint-graph nodes its lowering left out of the captured segments
        (an in-place update of a buffer, a host sync...), and for a partition that runs eagerly
        the node that stopped its capture ('-' when unknown) with ``fallback_reason``'s part
        for it. Empty when every compute piece is captured (or before the first step)."""
        if self._latest is None:
            return []
        out = list(self._stopped[self._latest])
        for p, graph in enumerate(self._graphs[self._latest]):
            if graph is not None:
                out += [(node, f"partition {p}: {why}") for node, why in graph.uncaptured()]
        return out

    # -- the RankProgram protocol -----------------------------------------------------------
    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """Inference: the split graph in this process (every partition loaded first)."""
        self.materialize()
        return self.split(*args, **kwargs)

    def materialize(self) -> None:
        """Load every partition the latest step left evicted (none after a step that ended:
        its last piece restores them all; after a failed one, those it had evicted)."""
        if self._residency is not None:
            self._residency.load_all()

    def resident_partitions(self) -> list[int]:
        """The partitions whose parameters hold bytes on this rank now, read from the
        tensors (see ``tidal.runtime.weights.residency``); all of them between steps."""
        res = self._residency or PartitionResidency(self._named, rank=self._rank)
        return res.resident_partitions()

    def step_notes(self) -> list[str]:
        """For ``Compiled.report()``, after a step on a process group: how much of the model
        this rank held at most, against holding all of it, and what the switches cost."""
        s = self.stats
        if not s["whole_model_bytes"]:
            return []
        share = s["resident_peak_bytes"] / s["whole_model_bytes"]
        return [f"round_robin: rank {self._rank} held at most {s['resident_peak_partitions']} "
                f"of {self.n} partitions resident: {_size(s['resident_peak_bytes'])} of "
                f"{_size(s['whole_model_bytes'])} ({share:.0%}) of parameters, gradients and "
                f"optimizer state; switches moved {_size(s['step_switch_bytes'])} in "
                f"{s['switch_us'] / 1e3:.1f} ms, per-partition updates took "
                f"{s['update_us'] / 1e3:.1f} ms, the end-of-step restore moved "
                f"{_size(s['restore_bytes'])} in {s['restore_us'] / 1e3:.1f} ms"]

    def bind(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> "_Step":
        """One training step of the global batch under the round-robin schedule: the program
        of this rank (all ranks without a process group), built once per micro-batch shape."""
        self.materialize()  # capture, zero_grad and a failed step's leftovers need them all
        rank, world = rank_and_size()
        if world > 1 and world != self.n:
            raise ValueError(f"round_robin: planned for {self.n} ranks but the world size is "
                             f"{world}; compile with partitions={world}")
        here = (rank,) if world > 1 else tuple(range(self.n))
        batches = split_batch(tuple(inputs), self.n, "round_robin global batch")
        tgts = split_batch(targets, self.n, "round_robin targets")
        flat, spec = tree_flatten((batches[0], tgts[0]))
        shape = (str(spec), tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor)
                                  else repr(v) for v in flat))
        cuda = sorted({t.device.index or 0 for t in [*self.split.parameters(), *flat]
                       if isinstance(t, torch.Tensor) and t.is_cuda})
        if shape not in self._graphs:
            with torch.random.fork_rng(devices=cuda):  # a step draws as it would eagerly
                self._graphs[shape], self._stopped[shape] = self._capture_all(
                    batches[0], tgts[0], loss_fn, here[0])
        graphs = self._graphs[shape]
        missing = [(g, r) for g in graphs if g is not None for r in here if r not in g.copies]
        if missing:  # a captured copy per rank here: their runs are alive at once
            with torch.random.fork_rng(devices=cuda):
                for g, r in missing:
                    g.captured(r)
        self._latest = shape
        key = (shape, world, here)
        if key not in self._programs:
            self._programs[key] = self._program(here, world, graphs)
        program, slots = self._programs[key]
        optimizer.zero_grad(set_to_none=True)
        step = _Step(self, program, slots, graphs, here, world, batches, tgts, loss_fn,
                     optimizer)
        self._residency, self._rank = step.residency, here[0]
        return step

    # -- capture ----------------------------------------------------------------------------
    def _capture_all(self, inputs: tuple, target: Any, loss_fn: Callable, rank: int
                     ) -> tuple[list[Optional[_StageGraph]], list[tuple[str, str]]]:
        """Every partition's joint graph for micro-batches shaped like ``inputs``/``target``,
        captured for ``rank`` (None for a partition that runs eagerly; ``fallback_reason``
        says why), and (node that stopped the capture or '-', reason) per such partition."""
        values = self._micro_values(inputs)
        stopped: list[tuple[str, str]] = []
        graphs: list[Optional[_StageGraph]] = []
        for p in range(self.n):
            try:
                graphs.append(self._capture(p, values, inputs, target, loss_fn, rank))
            except Exception as e:  # noqa: BLE001 - this partition runs eagerly, named
                graphs.append(None)
                why = str(e) if isinstance(e, TraceError) else _failure("cannot capture it", e)
                line = _failed_line(e)
                node = line.split(" = ", 1)[0] if " = " in line else "-"
                stopped.append((node, f"partition {p} ({self.plan.first_layers[p]}) runs "
                                      f"eagerly: {why}"))
        self.fallback_reason = "; ".join(reason for _, reason in stopped)
        return graphs, stopped

    def _micro_values(self, inputs: tuple) -> dict[str, Any]:
        """Every top-level value of the split graph on one micro-batch (what crosses each cut):
        a forward without autograd on copies of the buffers, so no statistic changes."""
        state = {f"split.{k}": v.clone() for k, v in self.split.named_buffers()}
        with torch.no_grad():
            return torch.func.functional_call(_Probe(self.split), state, tuple(inputs))

    def _constants(self, p: int, received: dict[str, Any], inputs: tuple, target: Any) -> Any:
        """What partition ``p`` reads besides its trainable parameters and float activations:
        its submodule's buffers and frozen parameters, the top-level attributes it is handed,
        the model inputs, its integer activations and (last partition) the targets."""
        st = self._stages[p]
        trainable = {x.local for x in self._params[p]}
        state = {k: v for k, v in [*st.module.named_parameters(), *st.module.named_buffers()]
                 if k not in trainable}
        attrs = {str(a.target): fetch_attr(self.split, a.target) for a in st.args
                 if a.op == "get_attr"}
        attrs = {k: v for k, v in attrs.items()
                 if not (isinstance(v, torch.nn.Parameter) and v.requires_grad)}
        ints = {k: v for k, v in received.items() if not v.is_floating_point()}
        values = [self._input(x, inputs) for x in self._placeholders]
        return state, attrs, values, ints, target if p == self.n - 1 else None

    def _capture(self, p: int, values: dict[str, Any], inputs: tuple, target: Any,
                 loss_fn: Callable, rank: int) -> _StageGraph:
        st, last = self._stages[p], p == self.n - 1
        params, trainable = self._params[p], self._trainable[p]
        at = {id(t): i for i, t in enumerate(trainable)}
        names_in = self._stages[p - 1].sends if p > 0 else ()
        # this partition's inputs on the first micro-batch (contiguous, as they are received)
        example = {nm: values[nm].detach().clone(memory_format=torch.contiguous_format)
                   for nm in names_in}
        floats = _floats(example)
        paths, spec = tree_flatten_with_path(self._constants(p, example, inputs, target))
        consts = [v for _, v in paths]
        tensor_at = [i for i, v in enumerate(consts) if isinstance(v, torch.Tensor)]
        has_grad: list[bool] = []

        def step(wrt: list, tensors: list, grads_out: list) -> list:
            flat = list(consts)
            for i, t in zip(tensor_at, tensors):
                flat[i] = t
            state, attrs, in_values, ints, tgt = tree_unflatten(flat, spec)
            state, attrs = dict(state), dict(attrs)
            for x in params:
                v = wrt[at[id(x.param)]]
                if x.local is None:
                    attrs[x.name] = v
                else:
                    state[x.local] = v
            env = dict(ints)
            env.update(zip(floats, wrt[len(trainable):]))

            def value(x: fx.Node) -> Any:
                if x.op == "placeholder":
                    return in_values[self._placeholders.index(x)]
                return attrs[str(x.target)] if x.op == "get_attr" else env[x.name]

            # a clone, so that an in-place first op (ReLU(inplace=True)) keeps the input intact
            args = [value(x).clone() if x.name in floats and x.op not in ("placeholder",
                    "get_attr") else value(x) for x in st.args]
            env.update(zip(st.produced, torch.func.functional_call(st.module, state,
                                                                   tuple(args))))
            if last:
                result = fx.node.map_arg(self._output.args[0], value)
                forward = [loss_fn(result, tgt) / self.n]
                pairs = [(forward[0], None)] if forward[0].requires_grad else []
            else:
                forward = [self._sent_value(p, nm, env[nm]) for nm in st.sends]
                fl = [v for v in forward if v.is_floating_point()]
                pairs = [(v, g) for v, g in zip(fl, grads_out) if v.requires_grad]
            grads = (torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                         allow_unused=True) if pairs else [None] * len(wrt))
            n = len(trainable)
            has_grad[:] = [g is not None for g in grads[:n]]
            leaf_grads = [torch.zeros_like(w) if g is None else g
                          for w, g in zip(wrt[n:], grads[n:])]
            return [*forward, *leaf_grads, *[g for g in grads[:n] if g is not None]]

        wrt = trainable + [example[nm].requires_grad_(True) for nm in floats]
        # the output gradients as they arrive: contiguous (a channels-last output's too)
        grads_out = [] if last else [torch.zeros_like(values[nm],
                                                      memory_format=torch.contiguous_format)
                                     for nm in st.sends if isinstance(values[nm], torch.Tensor)
                                     and values[nm].is_floating_point()]
        tensors = [consts[i] for i in tensor_at]
        gm = make_fx(step, tracing_mode="fake")(wrt, tensors, grads_out)
        n_forward = 1 if last else len(st.sends)
        fnodes, bnodes = _split_joint(gm, len(wrt) + len(tensor_at), n_forward)
        slots = [x.name for x in gm.graph.nodes if x.op == "placeholder"][len(wrt):]
        labels = {x: self._label(paths[i][0]) for x, i in zip(slots, tensor_at)}
        graph = _StageGraph(gm, fnodes, bnodes, n_forward, len(floats), len(grads_out),
                            tuple(has_grad), (*[w.detach() for w in wrt], *tensors, *grads_out),
                            labels)
        try:  # lowering runs it once on the first micro-batch, on copies (nothing real changes)
            graph.captured(rank)
        except Exception as e:
            try:  # the graph's own code, on copies, for a traceback naming the node at fault
                with torch.no_grad():
                    gm(*[[t.detach().clone() for t in ts] for ts in (wrt, tensors, grads_out)])
            except Exception as named:  # noqa: BLE001 - the diagnosis
                e = named
            raise TraceError(_failure("its captured graph fails to run", e)) from e
        return graph

    def _label(self, path: tuple) -> str:
        """What a constant at ``path`` in :meth:`_constants`'s value is, in words."""
        kind, key = path[0].idx, getattr(path[1], "key", None) if len(path) > 1 else None
        if kind == 2:
            return f"input {self._placeholders[path[1].idx].target}"
        return ("buffer", "attribute", "", "activation", "targets")[kind] + (
            f" {key}" if key is not None else "")

    def _sent_value(self, p: int, name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"round_robin: value {name!r} crossing from partition {p} "
                            f"is a {type(value).__name__}, not a tensor")
        return value

    def _input(self, node: fx.Node, inputs: tuple) -> Any:
        """The value of a model-input placeholder (the batch slice, or its pinned default) or
        of a top-level attribute."""
        if node.op == "get_attr":
            return fetch_attr(self.split, node.target)
        i = self._placeholders.index(node)
        if i < len(inputs):
            return inputs[i]
        return node.args[0] if node.args else None

    # -- the program --------------------------------------------------------------------------
    def _program(self, here: tuple[int, ...], world: int,
                 graphs: Sequence[Optional[_StageGraph]]) -> tuple[Program, tuple[_Slot, ...]]:
        """The pieces of the ranks ``here`` (one rank with a process group, all without), in
        schedule order with each all-reduce after the transfer that follows it. With a
        process group a switch moves partitions in and out (:class:`_Residency` says which and
        what it waits for), each partition is updated on its own (``U p``, on the update stream,
        after its all-reduce and before the switch that evicts it) and the step ends with the
        restore of every partition (``restore``)."""
        n, one = self.n, world == 1
        actions = self.plan.schedule.ranks
        order = list(range(len(actions[0])))
        for k in range(len(order) - 1):  # A p, X p -> X p, A p: the transfer goes first
            if actions[0][order[k]].kind == "A" and actions[0][order[k + 1]].kind == "X":
                order[k], order[k + 1] = order[k + 1], order[k]
        pieces: list[Piece] = []
        slots: list[_Slot] = []
        compute: dict[int, Optional[int]] = dict.fromkeys(here)
        load: dict[int, Optional[int]] = dict.fromkeys(here)
        ran: dict[tuple[str, int, int], int] = {}   # (kind, rank, partition) -> piece
        shared: list[int] = []                      # all-reduces and the loss, for U
        res = None if one else _Residency(n, [a.partition for a in actions[here[0]]
                                              if a.kind == "S"])
        updates: list[int] = []

        def add(name: str, stream: str, deps: Sequence[Optional[int]], slot: _Slot,
                nodes: tuple[str, ...] = ()) -> int:
            pieces.append(Piece(name, stream, tuple(sorted({d for d in deps if d is not None})),
                                nodes))
            slots.append(slot)
            return len(pieces) - 1

        def update(r: int) -> None:  # U p of the partition all-reduced last (a process group)
            q, res.pending = res.pending, None
            if q is not None:
                updates.append(add(f"U{q}", UPDATE, [ran[("A", r, q)]], _Slot("U", r, q)))
                res.use(q, updates[-1])

        in_backward: set[int] = set()
        for k in order:
            for r in here:
                a = actions[r][k]
                p, b, pre = a.partition, a.batch, f"r{r}:" if one else ""
                backward, graph = r in in_backward, graphs[p]
                if a.kind == "S":
                    keep, deps = res.switch(p) if res is not None else ((), [])
                    load[r] = add(f"{pre}S{p}{' bwd' if backward else ''}", LOAD, deps,
                                  _Slot("S", r, p, b, backward, keep))
                    if res is not None:
                        update(r)
                elif a.kind == "F":
                    src = (r - 1) % n if one else r
                    deps = [load[r], compute[r], ran.get(("Xf", src, p - 1))]
                    compute[r] = ran[("F", r, p)] = add(
                        f"{pre}F{p},{b}", COMPUTE, deps, _Slot("F", r, p, b),
                        graph.forward_nodes if graph is not None else ())
                    if res is not None:
                        res.use(p, compute[r], compute=True)
                    if p == n - 1 and not one:
                        shared.append(add("loss", COMM, [compute[r]], _Slot("L", r)))
                elif a.kind == "B":
                    in_backward.add(r)
                    src = (r + 1) % n if one else r
                    deps = [load[r], compute[r], ran[("F", r, p)], ran.get(("Xb", src, p + 1))]
                    compute[r] = ran[("B", r, p)] = add(
                        f"{pre}B{p},{b}", COMPUTE, deps, _Slot("B", r, p, b),
                        graph.backward_nodes if graph is not None else ())
                    if res is not None:
                        res.use(p, compute[r], compute=True)
                elif a.kind == "X":
                    tag = "Xb" if backward else "Xf"
                    after = ran[("B" if backward else "F", r, p)]
                    ran[(tag, r, p)] = add(f"{pre}X{p} {'bwd' if backward else 'fwd'}", COMM,
                                           [after], _Slot("X", r, p, b, backward))
                    if res is not None and not backward:  # what it sends may view a weight
                        res.use(p, ran[(tag, r, p)])
                elif a.kind == "A" and r == here[0]:  # one collective for the ranks here
                    ran[("A", r, p)] = add(f"A{p}", COMM, [ran[("B", q, p)] for q in here],
                                           _Slot("A", r, p))
                    shared.append(ran[("A", r, p)])
                    if res is not None:
                        res.use(p, ran[("A", r, p)])
                        res.pending = p
                elif a.kind == "U" and r == here[0]:
                    if res is None:
                        add("U", COMPUTE, [*shared, *compute.values()], _Slot("U", r, -1))
                        continue
                    update(r)
                    used = [i for q in range(n) for i in res.users[q]]
                    add("restore", LOAD, [*updates, *used, compute[r]], _Slot("R", r))
        return Program(tuple(pieces), world), tuple(slots)


class _Step:
    """One step of a :class:`RoundRobinProgram` bound to its tensors (a ``StepWork``)."""

    def __init__(self, owner: RoundRobinProgram, program: Program, slots: tuple[_Slot, ...],
                 graphs: Sequence[Optional[_StageGraph]], here: tuple[int, ...], world: int,
                 batches: list, targets: list, loss_fn: Callable,
                 optimizer: torch.optim.Optimizer):
        self.owner, self.program, self.slots, self.graphs = owner, program, slots, graphs
        self.here, self.world = here, world
        self.batches, self.targets, self.loss_fn, self.optimizer = (batches, targets, loss_fn,
                                                                    optimizer)
        self.states = {r: _RankState() for r in here}
        self.failed = ""
        self._loss: Optional[torch.Tensor] = None
        # with a process group the rank holds only the partitions it needs (see _switch)
        self.residency = (PartitionResidency(owner._named, optimizer, here[0])
                          if world > 1 else None)
        self.timing = {"switch_us": 0.0, "switch_bytes": 0, "update_us": 0.0}

    def work(self, index: int, piece: Piece) -> Callable[[], Any]:
        """What piece ``index`` does (after a piece of this step failed: fail at once, naming
        it, so that no rank waits on a peer that will not come)."""
        slot = self.slots[index]
        do = {"S": self._switch, "F": self._forward, "B": self._backward, "X": self._exchange,
              "A": self._all_reduce, "L": self._all_reduce_loss, "U": self._update,
              "R": self._restore}[slot.kind]
        return functools.partial(self._guarded, piece.name, functools.partial(do, slot))

    def _guarded(self, name: str, do: Callable[[], None]) -> None:
        if self.failed:
            raise RuntimeError(f"round_robin: {name} not run: {self.failed}")
        try:
            do()
        except BaseException as e:
            self.failed = f"{name} failed: {type(e).__name__}: {e}"
            raise

    def loss(self) -> torch.Tensor:
        """The global batch's loss (the sum of the micro-batch losses / N)."""
        if self._loss is not None:
            return self._loss
        return torch.tensor(sum(s.loss for s in self.states.values()))

    # -- the actions ------------------------------------------------------------------------
    def _switch(self, slot: _Slot) -> None:
        """Switch to partition p. With a process group: evict the partitions the rank no
        longer needs and load those of ``slot.keep`` it does not hold (weights, gradients,
        optimizer state), timed; in one process (the ranks share the parameters) count the
        switch and the weight bytes it would load."""
        o = self.owner
        if self.residency is None:
            if slot.rank == self.here[0]:  # per rank
                o.stats["switches"] += 1
                o.stats["switch_bytes"] += o.plan.param_bytes[slot.partition]
            return
        t0 = time.perf_counter()
        moved = self.residency.switch(slot.keep)
        self.timing["switch_us"] += (time.perf_counter() - t0) * 1e6
        self.timing["switch_bytes"] += moved.total
        o.stats["switches"] += 1
        o.stats["switch_bytes"] += moved.total
        self.residency.observe()

    def _restore(self, slot: _Slot) -> None:
        """The step's last piece (a process group): load every partition back, so that between
        steps the model is whole (``state_dict()``, inference, the gradients); the next step's
        first switch evicts again. Publishes the step's residency figures in ``stats``."""
        res, o = self.residency, self.owner
        res.observe()
        t0 = time.perf_counter()
        loaded = res.load_all()
        restore_us = (time.perf_counter() - t0) * 1e6
        o.stats.update(steps=o.stats["steps"] + 1, resident_peak_bytes=res.peak_bytes,
                       resident_peak_partitions=res.peak_partitions,
                       whole_model_bytes=res.resident_bytes(),
                       switch_us=self.timing["switch_us"],
                       step_switch_bytes=self.timing["switch_bytes"],
                       update_us=self.timing["update_us"], restore_bytes=loaded,
                       restore_us=restore_us)

    def _forward(self, slot: _Slot) -> None:
        o, st, p, b = self.owner, self.states[slot.rank], slot.partition, slot.batch
        names = o._stages[p - 1].sends if p > 0 else ()
        received = st.inbox.pop(p, [])
        if len(received) != len(names):
            raise RuntimeError(f"round_robin: partition {p} batch {b} expected {len(names)} "
                               f"activations, received {len(received)}")
        inputs, target = self.batches[b], self.targets[b]
        values = dict(zip(names, received))
        graph = self.graphs[p]
        if self.residency is not None:
            self.residency.require(p, f"F{p},{b}")
        run = (self._forward_eager(p, values, inputs, target) if graph is None
               else self._forward_captured(graph, slot.rank, p, values, inputs, target))
        if run.loss is not None:
            st.loss += float(run.loss.detach())
        st.runs[(p, b)] = run

    def _forward_captured(self, graph: _StageGraph, rank: int, p: int,
                          values: dict[str, torch.Tensor], inputs: tuple, target: Any) -> _Run:
        """The ``F`` segment of ``rank``'s captured copy of partition ``p``; the run stays
        alive (its values, on a GPU the copy's static buffers) until ``B``."""
        o = self.owner
        floats = _floats(values)
        consts = [v for v in tree_flatten(o._constants(p, values, inputs, target))[0]
                  if isinstance(v, torch.Tensor)]
        run, grads_in = graph.run(rank, [*o._trainable[p], *[values[nm] for nm in floats],
                                         *consts])
        graph.segment(run, 0)
        out = graph.outputs(run, 0, graph.n_forward)
        if p == o.n - 1:
            return _Run(loss=out[0], captured=run, grads_in=grads_in)
        return _Run(sent=dict(zip(o._stages[p].sends, out)), captured=run, grads_in=grads_in)

    def _forward_eager(self, p: int, values: dict[str, torch.Tensor], inputs: tuple,
                       target: Any) -> _Run:
        o = self.owner
        stage = o._stages[p]
        leaves = {nm: t.detach().requires_grad_(True) if t.is_floating_point() else t
                  for nm, t in values.items()}
        # a clone, so that an in-place first op (ReLU(inplace=True)) does not touch the leaf
        args = [o._input(x, inputs) if x.op in ("placeholder", "get_attr") else
                (leaves[x.name].clone() if leaves[x.name].requires_grad else leaves[x.name])
                for x in stage.args]
        env = dict(leaves)
        env.update(zip(stage.produced, stage.module(*args)))
        if p < o.n - 1:
            return _Run(sent={nm: o._sent_value(p, nm, env[nm]) for nm in stage.sends},
                        leaves=leaves)
        result = fx.node.map_arg(o._output.args[0], lambda x: env[x.name]
                                 if x.op not in ("placeholder", "get_attr")
                                 else o._input(x, inputs))
        return _Run(loss=self.loss_fn(result, target) / o.n, leaves=leaves)

    def _backward(self, slot: _Slot) -> None:
        st, p, b = self.states[slot.rank], slot.partition, slot.batch
        run = st.runs[(p, b)]
        grads = [] if p == self.owner.n - 1 else st.grad_out.pop((p, b))
        if self.residency is not None:
            self.residency.require(p, f"B{p},{b}")
        if self.graphs[p] is None:
            self._backward_eager(p, run, grads)
        else:
            self._backward_captured(self.graphs[p], p, run, grads)
        if self.residency is not None:  # the gradients it made are resident now
            self.residency.observe()

    def _backward_captured(self, graph: _StageGraph, p: int, run: _Run,
                           grads: list[torch.Tensor]) -> None:
        """The ``B`` segment of the run ``F`` left, on the output gradients ``grads`` (copied
        into the run's gradient inputs unless received there)."""
        for buf, g in zip(run.grads_in, grads):
            if buf is not g:
                buf.copy_(g)
        graph.segment(run.captured, 1)
        out = graph.outputs(run.captured, graph.n_forward, None)
        run.captured, run.grads_in = None, []
        run.leaf_grads = [g.contiguous() for g in out[:graph.n_leaves]]
        param_grads = iter(out[graph.n_leaves:])
        for param, has in zip(self.owner._trainable[p], graph.has_grad):
            if has:
                _accumulate(param, next(param_grads))

    def _backward_eager(self, p: int, run: _Run, grads: list[torch.Tensor]) -> None:
        if run.loss is not None:
            run.loss.backward()
        else:
            produced = set(self.owner._stages[p].produced)
            tensors, gts = [], []
            for nm, g in zip(_floats(run.sent), grads):
                if nm in produced:
                    if run.sent[nm].requires_grad:
                        tensors.append(run.sent[nm])
                        gts.append(g)
                else:  # passed through this partition unchanged
                    leaf = run.leaves[nm]
                    leaf.grad = g.clone() if leaf.grad is None else leaf.grad + g
            if tensors:
                torch.autograd.backward(tensors, gts)
        leaves = run.leaves
        run.leaf_grads = [(leaves[k].grad if leaves[k].grad is not None
                           else torch.zeros_like(leaves[k])).contiguous()
                          for k in _floats(leaves)]

    def _exchange(self, slot: _Slot) -> None:
        """Forward: send F p,b's activations to rank r+1 and receive partition p+1's input
        from r−1. Backward: send B p,b's input gradients to r−1 and receive the gradients of
        partition p−1's outputs (batch b's successor on this rank) from r+1."""
        n, r, p, b = self.owner.n, slot.rank, slot.partition, slot.batch
        st = self.states[r]
        run = st.runs[(p, b)]
        if not slot.backward:
            send = [t.detach().contiguous() for t in run.sent.values()]
            if self.world == 1:
                self.states[(r + 1) % n].inbox[p + 1] = send
                return
            st.inbox[p + 1] = self._send_recv(send, [_recv_buffer(t) for t in send],
                                              (r + 1) % n, (r - 1) % n)
        else:
            if self.world == 1:
                self.states[(r - 1) % n].grad_out[(p - 1, b)] = run.leaf_grads
                return
            mine = (p - 1, (r - p + 1) % n)
            prev = st.runs[mine]  # a captured run receives into its gradient inputs
            recv = (prev.grads_in if prev.captured is not None
                    else [_recv_buffer(prev.sent[k]) for k in _floats(prev.sent)])
            st.grad_out[mine] = self._send_recv(run.leaf_grads, recv, (r - 1) % n, (r + 1) % n)

    @staticmethod
    def _send_recv(send: list[torch.Tensor], recv: list[torch.Tensor], dest: int,
                   src: int) -> list[torch.Tensor]:
        ops = [dist.P2POp(dist.isend, t, dest) for t in send]
        ops += [dist.P2POp(dist.irecv, t, src) for t in recv]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return recv

    def _all_reduce(self, slot: _Slot) -> None:
        """Sum partition ``p``'s gradients over the ranks and average its floating-point
        buffers (BatchNorm's running statistics: every rank ran ``p`` on its own batch)."""
        if self.world == 1:
            return
        o, p = self.owner, slot.partition
        named = [(k, prm) for k, prm in o._owned[p] if prm.grad is not None]
        if o._sync_factory is None:
            all_reduce_tensors([prm.grad for _, prm in named])
        elif named:
            if p not in o.syncs:
                o.syncs[p] = o._sync_factory(None)
            synced = o.syncs[p]({k: prm.grad for k, prm in named})
            for k, prm in named:  # the sync averages; a round-robin step sums the N batches
                prm.grad.copy_(synced[k] * self.world)
        all_reduce_tensors(o._buffers[p], average=True)

    def _all_reduce_loss(self, slot: _Slot) -> None:
        loss = torch.tensor(self.states[slot.rank].loss, device=collective_device())
        dist.all_reduce(loss)
        self._loss = loss

    def _update(self, slot: _Slot) -> None:
        """Step the optimizer: on every parameter (one process), or (a process group) on the
        parameters partition p owns alone, while p is resident: the optimizer sees only their
        ``param_groups`` entries for this call (it must update each parameter from its own
        gradient and state, as every ``torch.optim`` optimizer but L-BFGS does)."""
        if slot.partition < 0:
            self.optimizer.step()
            self.owner.stats["steps"] += 1
            return
        p = slot.partition
        self.residency.require(p, f"U{p}")
        owned = {id(prm) for _, prm in self.owner._owned[p]}
        groups = self.optimizer.param_groups
        kept = [g["params"] for g in groups]
        t0 = time.perf_counter()
        try:
            for g in groups:
                g["params"] = [prm for prm in g["params"] if id(prm) in owned]
            self.optimizer.step()
        finally:
            for g, params in zip(groups, kept):
                g["params"] = params
        self.timing["update_us"] += (time.perf_counter() - t0) * 1e6
        self.residency.observe()  # its optimizer state may be new

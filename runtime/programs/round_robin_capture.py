"""A round-robin partition's forward and backward captured as one joint graph, per micro-batch
shape.

:func:`capture_partitions` captures every partition of the split graph
(:class:`~tidal.runtime.programs.round_robin_stages.Partitions`) for micro-batches of one shape:
``make_fx`` of the partition's forward (the loss on the last partition) and
``torch.autograd.grad`` with respect to its parameters and its float input activations, the
gradients of its outputs as inputs (:class:`StageGraph`; on the last partition, the gradient of
its loss: the backward's seed, ``tidal.ir.capture.loss_seed`` of the micro-batch's weight times
the open step's loss scale, so that a ``GradScaler``'s scale enters the backward as in eager
``scaler.scale(loss).backward()``). ``F`` runs the nodes the outputs need
(and the buffer updates), ``B`` the rest, on the values ``F`` left (:func:`split_joint`). A
partition that cannot be captured, or whose captured graph cannot run, runs eagerly with
autograd, named with the reason.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir.compat import split_module_tuple
    >>> from tidal.runtime.programs.round_robin_stages import Partitions
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> parts = Partitions(split_module_tuple(fx.symbolic_trace(model), model,
    ...                                       lambda n: int(n.name == "_2")), 2, model)
    >>> graphs, stopped = capture_partitions(parts, (torch.randn(2, 4),), torch.tensor([0, 1]),
    ...                                      torch.nn.functional.cross_entropy, rank=0)
    >>> [(g.n_forward, g.n_leaves, g.has_grad) for g in graphs], stopped
    ([(1, 0, (True, True)), (1, 1, (True, True))], [])
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten_with_path, tree_unflatten

from tidal.ir.capture import loss_seed, seed_for
from tidal.ir.errors import TraceError
from tidal.ir.node_runner import fetch_attr
from tidal.ir.program import COMPUTE, Piece, Program
from tidal.runtime.backend import backend_for
from tidal.runtime.program import CapturedProgram, CapturedRun, device_of
from tidal.runtime.programs.round_robin_stages import Partitions, floats
from tidal.runtime.programs.step_failures import failure, graph_line


@dataclass(frozen=True)
class StageGraph:
    """Partition p's forward and backward on one micro-batch shape as one joint aten graph
    (``joint``), its nodes ordered so that the ``F`` segment (``forward_nodes``: what the
    forward outputs need, and the buffer updates) comes before the ``B`` segment
    (``backward_nodes``: the rest). Its inputs: the trainable parameters, the float input
    activations and the constants (buffers, model inputs, integer activations, targets), bound
    at ``F``, then the gradients of the float outputs (``n_grads`` of them; on the last
    partition one, the loss's: the backward's seed, a 0-dim float32 tensor), filled in at
    ``B``;
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


def split_joint(gm: fx.GraphModule, n_bound: int, n_forward: int
                 ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split a joint graph into the nodes the forward outputs (and the in-place buffer updates
    that do not wait for output gradients) need, and the rest, moving the rest after the
    first in ``gm`` (still in topological order: nothing the forward needs comes from the
    rest); see :class:`StageGraph`."""
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


class _StageStep:
    """Partition ``p``'s step as ``make_fx`` traces it: ``(wrt, tensors, grads_out)`` -> the
    forward values, the input activations' gradients, then the parameters' that get one
    (``has_grad``, filled in by the trace). ``wrt``: the trainable parameters, then the float
    input activations (named ``float_names``); ``tensors``: the tensors among the constants
    (the rest of ``consts``, whose structure ``spec`` holds, stays as it is)."""

    def __init__(self, parts: Partitions, p: int, consts: list, spec: Any,
                 float_names: list[str], loss_fn: Callable):
        self.parts, self.p, self.loss_fn = parts, p, loss_fn
        self.consts, self.spec, self.float_names = consts, spec, float_names
        self.tensor_at = [i for i, v in enumerate(consts) if isinstance(v, torch.Tensor)]
        self.at = {id(t): i for i, t in enumerate(parts.trainable[p])}
        self.has_grad: list[bool] = []

    def bind(self, wrt: list, tensors: list) -> tuple[dict, dict, list, dict, Any]:
        """The partition's state, attributes, model inputs, activations and targets, with the
        traced tensors in place of the examples."""
        flat = list(self.consts)
        for i, t in zip(self.tensor_at, tensors):
            flat[i] = t
        state, attrs, in_values, ints, target = tree_unflatten(flat, self.spec)
        state, attrs = dict(state), dict(attrs)
        for x in self.parts.params[self.p]:
            v = wrt[self.at[id(x.param)]]
            if x.local is None:
                attrs[x.name] = v
            else:
                state[x.local] = v
        env = dict(ints)
        env.update(zip(self.float_names, wrt[len(self.at):]))
        return state, attrs, in_values, env, target

    def __call__(self, wrt: list, tensors: list, grads_out: list) -> list:
        parts, p = self.parts, self.p
        st, last = parts.stages[p], p == parts.n - 1
        state, attrs, in_values, env, target = self.bind(wrt, tensors)

        def value(x: fx.Node) -> Any:
            if x.op == "placeholder":
                return in_values[parts.placeholders.index(x)]
            return attrs[str(x.target)] if x.op == "get_attr" else env[x.name]

        # a clone, so that an in-place first op (ReLU(inplace=True)) keeps the input intact
        args = [value(x).clone() if x.name in self.float_names and x.op not in (
            "placeholder", "get_attr") else value(x) for x in st.args]
        env.update(zip(st.produced, torch.func.functional_call(st.module, state, tuple(args))))
        if last:
            forward = [self.loss_fn(fx.node.map_arg(parts.output.args[0], value), target)
                       / parts.n]
            pairs = ([(forward[0], seed_for(forward[0], grads_out[0]))]
                     if forward[0].requires_grad else [])
        else:
            forward = [parts.sent(p, nm, env[nm]) for nm in st.sends]
            fl = [v for v in forward if v.is_floating_point()]
            pairs = [(v, g) for v, g in zip(fl, grads_out) if v.requires_grad]
        grads = (torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                     allow_unused=True) if pairs else [None] * len(wrt))
        n = len(self.at)
        self.has_grad[:] = [g is not None for g in grads[:n]]
        leaf_grads = [torch.zeros_like(w) if g is None else g
                      for w, g in zip(wrt[n:], grads[n:])]
        return [*forward, *leaf_grads, *[g for g in grads[:n] if g is not None]]


def capture_partition(parts: Partitions, p: int, values: dict[str, Any], inputs: tuple,
                      target: Any, loss_fn: Callable, rank: int) -> StageGraph:
    """Partition ``p``'s :class:`StageGraph` for micro-batches shaped like ``inputs``/
    ``target`` (``values``: every top-level value on the first one), captured for ``rank``.
    Raises ``TraceError`` naming the node at fault when the captured graph cannot run."""
    st, last = parts.stages[p], p == parts.n - 1
    names_in = parts.stages[p - 1].sends if p > 0 else ()
    # this partition's inputs on the first micro-batch (contiguous, as they are received)
    example = {nm: values[nm].detach().clone(memory_format=torch.contiguous_format)
               for nm in names_in}
    float_names = floats(example)
    paths, spec = tree_flatten_with_path(parts.constants(p, example, inputs, target))
    traced = _StageStep(parts, p, [v for _, v in paths], spec, float_names, loss_fn)
    wrt = parts.trainable[p] + [example[nm].requires_grad_(True) for nm in float_names]
    # the output gradients as they arrive: contiguous (a channels-last output's too); the
    # last partition's: its loss's (the backward's seed)
    grads_out = [loss_seed(None, device_of(wrt, inputs))] if last else [
        torch.zeros_like(values[nm], memory_format=torch.contiguous_format)
        for nm in st.sends if isinstance(values[nm], torch.Tensor)
        and values[nm].is_floating_point()]
    tensors = [traced.consts[i] for i in traced.tensor_at]
    gm = make_fx(traced, tracing_mode="fake")(wrt, tensors, grads_out)
    n_forward = 1 if last else len(st.sends)
    fnodes, bnodes = split_joint(gm, len(wrt) + len(tensors), n_forward)
    slots = [x.name for x in gm.graph.nodes if x.op == "placeholder"][len(wrt):]
    labels = {x: parts.label(paths[i][0]) for x, i in zip(slots, traced.tensor_at)}
    graph = StageGraph(gm, fnodes, bnodes, n_forward, len(float_names), len(grads_out),
                       tuple(traced.has_grad), (*[w.detach() for w in wrt], *tensors, *grads_out),
                       labels)
    try:  # lowering runs it once on the first micro-batch, on copies (nothing real changes)
        graph.captured(rank)
    except Exception as e:
        try:  # the graph's own code, on copies, for a traceback naming the node at fault
            with torch.no_grad():
                gm(*[[t.detach().clone() for t in ts] for ts in (wrt, tensors, grads_out)])
        except Exception as named:  # noqa: BLE001 - the diagnosis
            e = named
        raise TraceError(failure("its captured graph fails to run", e)) from e
    return graph


def capture_partitions(parts: Partitions, inputs: tuple, target: Any, loss_fn: Callable,
                       rank: int, first_layers: Sequence[str] = (),
                       values: Optional[dict[str, Any]] = None
                       ) -> tuple[list[Optional[StageGraph]], list[tuple[str, str]]]:
    """Every partition's :class:`StageGraph` for micro-batches shaped like ``inputs``/
    ``target``, captured for ``rank`` (None for a partition that runs eagerly), and (node that
    stopped the capture or '-', reason) per such partition (named by its first layer, from
    ``first_layers``, when given). ``values``: ``parts.micro_values(inputs)`` when the caller
    has it already."""
    values = parts.micro_values(inputs) if values is None else values
    stopped: list[tuple[str, str]] = []
    graphs: list[Optional[StageGraph]] = []
    for p in range(parts.n):
        try:
            graphs.append(capture_partition(parts, p, values, inputs, target, loss_fn, rank))
        except Exception as e:  # noqa: BLE001 - this partition runs eagerly, named
            graphs.append(None)
            why = str(e) if isinstance(e, TraceError) else failure("cannot capture it", e)
            line = graph_line(e)
            node = line.split(" = ", 1)[0] if " = " in line else "-"
            name = f"partition {p}" + (f" ({first_layers[p]})" if first_layers else "")
            stopped.append((node, f"{name} runs eagerly: {why}"))
    return graphs, stopped

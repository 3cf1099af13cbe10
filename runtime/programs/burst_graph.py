"""A burst-parallel rank's own graph: the layers its ranks do not run replaced by empty rows.

Every rank passes the same global batch and each layer runs on its ranks' sample ranges; a
rank outside a layer's set skips it. :func:`specialise` makes the rank's copy of the graph in
which each such layer is :func:`skipped_layer`, an empty (zero-row) tensor of the layer's
output shape, so code such as ``x.view(x.size(0), -1)`` never runs on zero rows. The empty
tensor requires grad exactly when the layer's output would (its module has trainable parameters
or an input requires grad), so every rank takes part in the same backward transfers.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir import cost
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()))
    >>> cost.annotate(gm, (torch.randn(4, 3),))     # output shapes on the nodes
    >>> local = specialise(gm, {"_0": (0,)}, rank=1)
    >>> tuple(local(torch.randn(4, 3)).shape)       # rank 1 runs neither row of layer _0
    (0, 2)
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
import torch.fx as fx

from tidal.ir import meta
from tidal.ir.param_owners import trainable
from tidal.runtime.programs.burst_transfers import Produced, expected_inputs, produced
from tidal.runtime.programs.piece_autocast import AutocastState

Ranks = tuple[int, ...]

_NO_GRAD = (torch.detach, torch.Tensor.detach)


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


def specialise(gm: fx.GraphModule, layer_ranks: Mapping[str, Ranks], rank: int,
               unit_members: Optional[Mapping[str, tuple[str, ...]]] = None,
               produced: Optional[Mapping[str, Produced]] = None) -> fx.GraphModule:
    """A copy of ``gm`` for ``rank`` in which every layer whose ranks exclude ``rank`` is
    replaced by :func:`skipped_layer` (sharing ``gm``'s modules and parameters). A layer may be
    a unit of several nodes (``unit_members``, by layer name; default: the layer node alone):
    each member whose value a node outside the unit reads is replaced, tied to the unit's
    inputs that come before it (an input after every such member feeds only members whose
    values nothing reads, on any rank), and the members nothing reads any more are dropped.
    A member whose output is not one tensor keeps running (on zero rows). The empty tensor has
    the dtype and trailing shape the member gives on the step's inputs under its autocast
    state (``produced``, by node name: ``burst_transfers.produced``; a bf16 ``Linear`` gives
    bfloat16), else those recorded on the node (``tidal.ir.meta.get_tensors``).

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
            kind = (produced or {}).get(m, Produced(tuple(tensors[0].shape[1:]),
                                                    tensors[0].dtype))
            before = [a for a in inputs if position(a) < position(node)]
            with graph.inserting_before(node):
                new = graph.call_function(skipped_layer, (kind.tail, kind.dtype) + _grad_args(
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
    """Node -> its position in ``graph`` (as it is now)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _grad_args(gm: fx.GraphModule, node: fx.Node, inside: set, inputs: list) -> tuple:
    """``(grad, *inputs)`` for :func:`skipped_layer`: a value that never requires grad (a
    ``detach``) gets none; otherwise the unit's trainable modules and inputs decide."""
    if len(inside) == 1 and (node.target in _NO_GRAD or
                             (node.op == "call_method" and node.target == "detach")):
        return (False,)
    grad = any(n.op == "call_module" and bool(trainable(gm.get_submodule(n.target)))
               for n in inside)
    return (grad,) + tuple(inputs)



class RankGraph(NamedTuple):
    """A rank's graph for the steps of one kind (input shapes and dtypes, autocast state): the
    graph :func:`specialise` made (``module``) and, per transfer node, the dtype and trailing
    shape its input must have on every rank (``expected``; ``burst_transfers``)."""

    module: fx.GraphModule
    expected: Mapping[str, Produced]


def rank_graph(gm: fx.GraphModule, layer_ranks: Mapping[str, Ranks], rank: int,
               unit_members: Optional[Mapping[str, tuple[str, ...]]], inputs: tuple,
               autocast: AutocastState) -> RankGraph:
    """``gm`` specialised for ``rank`` (:func:`specialise`) with each skipped layer of the kind
    it gives on ``inputs`` (the global batch) under ``autocast``, and what each transfer's input
    must be (``burst_transfers.produced``, the same on every rank).

    >>> from tidal.ir import cost
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()))
    >>> cost.annotate(gm, (torch.randn(4, 3),))
    >>> bf16 = (("cpu", True, "bfloat16"),)
    >>> local = rank_graph(gm, {"_0": (0,)}, 1, None, (torch.randn(4, 3),), bf16).module
    >>> local(torch.randn(4, 3)).dtype          # what the bf16 Linear gives on rank 0
    torch.bfloat16
    """
    facts = produced(gm, inputs, autocast)
    module = specialise(gm, layer_ranks, rank, unit_members, facts.nodes)
    return RankGraph(module, expected_inputs(module, facts, autocast))

"""Typed node-meta keys and their accessors.

This module is the only place where tidal's ``node.meta`` key strings are spelled. Every
pass, analysis and dump reads and writes node metadata through the functions below, so a key
can be renamed or its payload changed in one place.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir import meta
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> node = next(n for n in gm.graph.nodes if n.op == "call_module")
    >>> meta.set_layer(node, meta.LayerRef(path="0", kind="Linear", scope=""))
    >>> meta.get_layer(node).kind
    'Linear'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx

BATCH = sympy.Symbol("B", positive=True, integer=True)
"""The batch-size symbol every cost expression (:class:`NodeCost`) is written in; also
``tidal.ir.cost.BATCH``."""

_LAYER = "tidal.layer"
_COST = "tidal.cost"
_TENSORS = "tidal.tensors"
_ADDED_BY = "tidal.added_by"
_INPUT_NAME = "tidal.input_name"
_TRACE_NOTES = "tidal.trace_notes"
_BATCH_DIM = "tidal.batch_dim"
_DERIVED = "tidal.derived"  # gm.meta: graph modules derived from this one, by purpose
_FX_MODULE_STACK = "nn_module_stack"  # written by torch.fx's tracer


@dataclass(frozen=True)
class LayerRef:
    """Which layer a node belongs to.

    ``path`` is the qualified module path for a ``call_module`` node (``layer1.0.conv1``) and the
    node name otherwise; ``kind`` the module class name or the function name; ``scope`` the
    qualified path of the innermost enclosing module (``layer1.0`` for a residual add), used to
    cluster nodes in dumps.
    """

    path: str
    kind: str
    scope: str


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor a node produces (at the example batch)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of a dense tensor of this shape and dtype."""
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class NodeCost:
    """Cost of one node as sympy expressions of the batch symbol ``B``.

    ``fwd_flops``/``bwd_flops`` count the forward and backward FLOPs of the node alone;
    ``out_bytes`` the bytes of the tensors it outputs; ``param_bytes``/``buffer_bytes`` the
    parameters and buffers it owns (a ``call_module`` node's module or a ``get_attr`` tensor).
    """

    fwd_flops: sympy.Expr
    bwd_flops: sympy.Expr
    out_bytes: sympy.Expr
    param_bytes: int
    buffer_bytes: int

    def at(self, batch: int) -> dict[str, float]:
        """The costs evaluated at a concrete batch size, as plain numbers."""
        return {
            "fwd_flops": float(self.fwd_flops.subs(BATCH, batch)),
            "bwd_flops": float(self.bwd_flops.subs(BATCH, batch)),
            "out_bytes": float(self.out_bytes.subs(BATCH, batch)),
            "param_bytes": float(self.param_bytes),
            "buffer_bytes": float(self.buffer_bytes),
        }


def get_layer(node: fx.Node) -> Optional[LayerRef]:
    """The layer a node belongs to, or None before annotation."""
    return node.meta.get(_LAYER)


def set_layer(node: fx.Node, layer: LayerRef) -> None:
    """Record which layer a node belongs to."""
    node.meta[_LAYER] = layer


def get_cost(node: fx.Node) -> Optional[NodeCost]:
    """The node's cost, or None if it was not annotated (placeholders, outputs, added ops)."""
    return node.meta.get(_COST)


def set_cost(node: fx.Node, cost: NodeCost) -> None:
    """Record the node's cost."""
    node.meta[_COST] = cost


def get_tensors(node: fx.Node) -> tuple[TensorInfo, ...]:
    """The tensors the node outputs (flattened), empty for non-tensor outputs or before
    shape propagation."""
    return node.meta.get(_TENSORS, ())


def set_tensors(node: fx.Node, tensors: tuple[TensorInfo, ...]) -> None:
    """Record the tensors the node outputs."""
    node.meta[_TENSORS] = tuple(tensors)


def get_added_by(node: fx.Node) -> Optional[str]:
    """Name of the pass that inserted this node, or None for nodes of the traced model."""
    return node.meta.get(_ADDED_BY)


def set_added_by(node: fx.Node, pass_name: str) -> None:
    """Mark a node as inserted by a pass (the pass manager does this for every new node)."""
    node.meta[_ADDED_BY] = pass_name


def get_input_name(node: fx.Node) -> Optional[str]:
    """The model's forward parameter a placeholder stands for (``attention_mask``), or None when
    the trace did not record it (fx may rename a placeholder, e.g. ``b`` pinned to a default
    becomes ``b_1``)."""
    return node.meta.get(_INPUT_NAME)


def set_input_name(node: fx.Node, name: str) -> None:
    """Record the model's forward parameter name of a placeholder (set when tracing)."""
    node.meta[_INPUT_NAME] = name


def get_trace_notes(gm: fx.GraphModule) -> tuple[str, ...]:
    """What tracing had to do to capture the model (e.g. modules kept whole by a fallback)."""
    return tuple(gm.meta.get(_TRACE_NOTES, ()))


def set_trace_notes(gm: fx.GraphModule, notes: tuple[str, ...]) -> None:
    """Record what tracing had to do, for the compile report."""
    gm.meta[_TRACE_NOTES] = tuple(notes)


def get_derived(gm: fx.GraphModule, purpose: str, key: Any) -> Optional[Any]:
    """A value derived from ``gm`` for ``purpose`` (e.g. the ``embedding_cache`` plan's ids
    graph), if it was recorded with this ``key`` (what it was derived from)."""
    held = gm.meta.get(_DERIVED, {}).get(purpose)
    return held[1] if held is not None and held[0] == key else None


def set_derived(gm: fx.GraphModule, purpose: str, key: Any, value: Any) -> None:
    """Record ``value``, derived from ``gm`` for ``purpose`` from ``key``."""
    gm.meta.setdefault(_DERIVED, {})[purpose] = (key, value)


def get_batch_dim(node: fx.Node) -> Optional[Any]:
    """Where the node's output holds the samples (a ``tidal.ir.batch_dim.BatchDim``; a tuple of
    them, nested like the output, for tuple outputs: a ``tidal.ir.batch_dim.Fact``), or None
    before the analysis ran."""
    return node.meta.get(_BATCH_DIM)


def set_batch_dim(node: fx.Node, fact: Any) -> None:
    """Record the batch-dimension fact of the node's output (``tidal.ir.batch_dim.analyze``)."""
    node.meta[_BATCH_DIM] = fact


def module_scope(node: fx.Node) -> str:
    """Qualified path of the innermost module that was being traced when ``node`` was created
    ('' at the top level), from the stack torch.fx's tracer records."""
    stack = node.meta.get(_FX_MODULE_STACK) or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    if node.op == "call_module" and path == node.target:
        paths = [v[0] for v in stack.values()]
        return paths[-2] if len(paths) > 1 else ""
    return path


@dataclass(frozen=True)
class BurstPlacement:
    """What ``burst_parallel`` records on each node of a layer (``get_pass_meta(node,
    "burst_parallel")``): the layer (``unit``: its name in the plan, a layer of several nodes
    shares it), its GPU count, its ranks (the subgroup that all-reduces its parameters) and
    each rank's sample range. The runtime builds the executor from these."""

    unit: str
    gpus: int
    ranks: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]


_PASS_PREFIX = "tidal.pass."


def get_pass_meta(node: fx.Node, pass_name: str) -> Optional[object]:
    """What pass ``pass_name`` recorded on this node (a typed dataclass the pass's module
    defines), or None."""
    return node.meta.get(_PASS_PREFIX + pass_name)


def set_pass_meta(node: fx.Node, pass_name: str, value: object) -> None:
    """Record pass-specific metadata on a node, e.g. the process group that must all-reduce a
    layer's parameters. ``value`` should be a frozen dataclass defined next to the pass."""
    node.meta[_PASS_PREFIX + pass_name] = value

"""Which graph operations count no FLOPs (``FlopCounterMode`` counts none of their operators,
forward or backward): what ``tidal.ir.cost.annotate`` need not count.

:func:`flop_free_kind` reads a node: ``FREE`` for an op that counts no FLOPs (an activation, a
normalisation, dropout, a view, elementwise arithmetic, an embedding, pooling), and
``SHAPE_PRESERVING`` for such an op that is elementwise on its one tensor argument; None for a
node that must be counted (convolutions, matmuls, attention, anything not in the tables).

Example:
    >>> import torch.fx as fx
    >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    >>> [flop_free_kind(n, gm.get_submodule(n.target)) for n in gm.graph.nodes
    ...  if n.op == "call_module"]
    [None, 'shape-preserving']
"""
from __future__ import annotations

import builtins
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from tidal.ir.node_runner import op_name

_ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
                nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
                nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Softmax, nn.LogSoftmax)
_NORMS_AND_DROPOUTS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm,
                       nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
                       nn.InstanceNorm3d, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
                       nn.AlphaDropout, nn.Identity)

FLOP_FREE_MODULES: frozenset = frozenset(_ACTIVATIONS + _NORMS_AND_DROPOUTS + (
    nn.Flatten, nn.Unflatten, nn.Embedding, nn.EmbeddingBag, nn.MaxPool1d, nn.MaxPool2d,
    nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d, nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d))
"""``torch.nn`` classes (exactly these, not subclasses) whose forward and backward call no
operator ``FlopCounterMode`` counts (matmuls, convolutions, fused attention)."""

_SHAPE_PRESERVING_NAMES = frozenset({
    "relu", "relu_", "relu6", "gelu", "silu", "mish", "tanh", "sigmoid", "hardtanh",
    "hardswish", "hardsigmoid", "leaky_relu", "elu", "selu", "celu", "softplus", "neg", "abs",
    "exp", "log", "sqrt", "rsqrt", "sin", "cos", "erf", "clamp", "clamp_min", "clamp_max",
    "pow", "add", "sub", "mul", "div", "add_", "sub_", "mul_", "div_", "dropout", "softmax",
    "log_softmax", "_softmax", "_log_softmax", "clone", "contiguous", "float", "to", "type_as",
})
"""Ops that, applied to one tensor (every other argument a Python value), return a tensor of its
shape; ``SHAPE_PRESERVING`` checks the dtype and strides at the example batch."""

FLOP_FREE_METHODS: frozenset = _SHAPE_PRESERVING_NAMES | frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "expand",
    "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "chunk", "split", "narrow",
    "select", "size", "dim", "numel", "detach", "masked_fill", "masked_fill_", "index_select",
    "gather", "repeat", "repeat_interleave", "mean", "sum", "max", "min", "amax", "argmax",
    "cumsum", "topk", "sort", "eq", "ne", "lt", "le", "gt", "ge", "half", "bfloat16", "long",
    "int", "bool", "new_zeros", "new_ones", "new_full", "new_empty", "fill_", "zero_", "tril",
    "triu", "floor_divide",
})
"""``call_method`` targets (on a tensor) that call no counted operator, forward or backward."""

FLOP_FREE_ATEN: frozenset = FLOP_FREE_METHODS | frozenset({
    "_unsafe_view", "alias", "slice", "index", "index_put", "index_put_", "scatter",
    "scatter_add", "where", "__and__", "__or__", "logical_and", "logical_or", "logical_not",
    "bitwise_and", "bitwise_or", "minimum", "maximum", "remainder", "diff", "histc", "arange",
    "full", "full_like", "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like",
    "embedding", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit_no_training", "native_dropout",
    "cat", "stack", "split_with_sizes", "pad", "constant_pad_nd", "_to_copy", "sym_size",
    "lift_fresh_copy",
})
"""Names of ``aten`` operators (``torch.ops.aten.NAME.overload``, as ``torch.export`` graphs
call them) that call no counted operator, forward or backward."""

FLOP_FREE_FUNCTIONS: frozenset = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.neg, operator.pos, operator.pow, operator.getitem, operator.eq,
    operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_,
    operator.or_, operator.invert, builtins.getattr,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.exp, torch.log, torch.sqrt,
    torch.rsqrt, torch.tanh, torch.sigmoid, torch.relu, torch.abs, torch.pow, torch.clamp,
    torch.sin, torch.cos, torch.erf, torch.where, torch.cat, torch.stack, torch.flatten,
    torch.reshape, torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze, torch.chunk,
    torch.split, torch.narrow, torch.arange, torch.zeros, torch.ones, torch.full,
    torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like, torch.softmax,
    torch.log_softmax, torch.cumsum, torch.mean, torch.sum, torch.amax, torch.argmax,
    torch.topk, torch.sort, torch.gather, torch.index_select, torch.masked_fill, torch.tril,
    torch.triu,
    F.relu, F.relu6, F.gelu, F.silu, F.mish, F.tanh, F.sigmoid, F.hardtanh, F.hardswish,
    F.leaky_relu, F.elu, F.softplus, F.softmax, F.log_softmax, F.dropout, F.layer_norm,
    F.batch_norm, F.group_norm, F.embedding, F.pad, F.max_pool1d, F.max_pool2d, F.max_pool3d,
    F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
    F.adaptive_avg_pool3d,
})
"""``call_function`` targets that call no counted operator, forward or backward."""

_SHAPE_PRESERVING_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.exp, torch.log, torch.sqrt,
    torch.rsqrt, torch.tanh, torch.sigmoid, torch.relu, torch.abs, torch.pow, torch.clamp,
    torch.sin, torch.cos, torch.erf, torch.softmax, torch.log_softmax, F.relu, F.relu6,
    F.gelu, F.silu, F.mish, F.tanh, F.sigmoid, F.hardtanh, F.hardswish, F.leaky_relu, F.elu,
    F.softplus, F.softmax, F.log_softmax, F.dropout,
})

FREE, SHAPE_PRESERVING = "flop-free", "shape-preserving"
"""What :func:`flop_free_kind` says of a node (else None: the node is counted)."""


def _hashable_in(target: Any, table: frozenset) -> bool:
    try:
        return target in table
    except TypeError:  # an unhashable callable
        return False


def flop_free_kind(n: fx.Node, module: Optional[nn.Module] = None) -> Optional[str]:
    """``SHAPE_PRESERVING`` for a node whose op counts no FLOPs and, on one tensor, returns one of
    its shape; ``FREE`` for any other op that counts no FLOPs, forward or backward; None for a
    node that must be counted. ``module`` is the ``call_module`` node's module.

    >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Flatten()))
    >>> [flop_free_kind(n, gm.get_submodule(n.target)) for n in gm.graph.nodes
    ...  if n.op == "call_module"]
    [None, 'shape-preserving', 'flop-free']
    """
    if n.op == "call_module":
        kind = type(module)
        preserving = kind in _ACTIVATIONS or kind in _NORMS_AND_DROPOUTS
        return SHAPE_PRESERVING if preserving else FREE if kind in FLOP_FREE_MODULES else None
    if n.op == "call_method":
        name, free = n.target, n.target in FLOP_FREE_METHODS
    elif isinstance(n.target, torch._ops.OpOverload):
        name = op_name(n)
        free = n.target.namespace == "aten" and name in FLOP_FREE_ATEN
    else:
        free = _hashable_in(n.target, FLOP_FREE_FUNCTIONS)
        return (SHAPE_PRESERVING if _hashable_in(n.target, _SHAPE_PRESERVING_FUNCTIONS)
                else FREE) if free else None
    if not free:
        return None
    return SHAPE_PRESERVING if name in _SHAPE_PRESERVING_NAMES else FREE

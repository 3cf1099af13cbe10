"""Run one fx node by itself, forward then backward, on detached inputs.

Both the analytic cost model (meta device, FLOP counting) and the profiler (real device,
timing) need the same thing: execute a single node of an ``fx.Interpreter`` with its own
autograd graph, wrapping the forward and the backward each in a context manager of their choice.

Example:
    >>> import torch, torch.fx as fx
    >>> from torch.utils.flop_counter import FlopCounterMode
    >>> from tidal.ir.node_runner import run_isolated
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    >>> interp = fx.Interpreter(gm)
    >>> interp.env = {}
    >>> x, lin = list(gm.graph.nodes)[:2]
    >>> interp.env[x] = torch.randn(2, 4)
    >>> fwd, bwd = FlopCounterMode(display=False), FlopCounterMode(display=False)
    >>> _ = run_isolated(interp, lin, fwd, bwd)
    >>> fwd.get_total_flops(), bwd.get_total_flops()
    (64, 128)
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map_only

from tidal.ir.param_owners import trainable

COMPUTE_OPS = ("call_module", "call_function", "call_method")
"""fx node kinds that compute (as opposed to placeholder, get_attr, output)."""


def op_name(n: fx.Node) -> str:
    """The op's name: a module path, a method, a function's name, an aten operator's name
    without its overload (``aten.view.default``: ``view``)."""
    if n.op == "call_module":
        return str(n.target)
    if isinstance(n.target, str):
        return n.target
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target._opname
    return getattr(n.target, "__name__", str(n.target))


def fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    """The object a ``get_attr`` node's dotted ``target`` names on ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


VIEW_METHODS = frozenset({"view", "view_as", "detach", "expand", "expand_as", "t",
                          "transpose", "permute", "squeeze", "unsqueeze", "narrow", "select",
                          "unfold", "diagonal", "movedim", "reshape", "flatten", "contiguous"})
"""Tensor methods whose result may share its input's storage (an in-place write to the result
writes the input: ``self.buf.view(-1).add_(1)``)."""

UNDECLARED_WRITES = {name: ("running_mean", "running_var") for name in (
    "aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm",
    "aten::batch_norm", "aten::_batch_norm_impl_index")}
"""Aten ops that update running statistics in training without saying so in their schema."""


def is_inplace_method(name: Any) -> bool:
    """Whether a ``call_method`` target names an in-place tensor method (``add_``, not
    ``__add__``)."""
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def _schema_value(n: fx.Node, i: int, name: str) -> Any:
    return n.args[i] if i < len(n.args) else n.kwargs.get(name)


def alias_root(n: Any) -> Any:
    """The node whose storage ``n``'s value is, following in-place results (``mul_`` returns
    its input), views (``detach``, ``view``, ``x[0]``) and aten outputs their schema marks as
    an argument's alias; ``n`` itself when it owns its storage (or is not a node)."""
    while isinstance(n, fx.Node):
        source = _alias_source(n)
        if source is None:
            return n
        n = source
    return n


def _alias_source(n: fx.Node) -> Any:
    """The argument ``n``'s value aliases, if any (see :func:`alias_root`)."""
    first = n.args[0] if n.args else None
    schema = getattr(n.target, "_schema", None)
    if n.op == "call_function" and schema is not None:
        ret = schema.returns[0].alias_info if len(schema.returns) == 1 else None
        if ret is None:
            return None
        for i, arg in enumerate(schema.arguments):
            value = _schema_value(n, i, arg.name)
            if arg.alias_info is not None and isinstance(value, fx.Node) and \
                    set(arg.alias_info.before_set) & set(ret.before_set):
                return value
        return None
    if not isinstance(first, fx.Node):
        return None
    if n.op == "call_method" and (is_inplace_method(n.target) or n.target in VIEW_METHODS):
        return first
    if n.op == "call_function" and n.target is operator.getitem:
        return first
    return None


def _training(n: fx.Node, schema: Any) -> bool:
    names = [a.name for a in schema.arguments]
    if "training" not in names:
        return True
    i = names.index("training")
    return bool(n.args[i] if i < len(n.args) else n.kwargs.get("training", True))


def written_nodes(gm: fx.GraphModule, n: fx.Node) -> list[fx.Node]:
    """The nodes whose storage ``n`` writes in place: for an aten op the arguments its schema
    marks written (``add_``'s self, ``add.out``'s out, ``native_batch_norm``'s running
    statistics in training); the first argument of an in-place method (``mul_``), of an
    ``inplace=True`` module or function, or of ``operator.setitem``; an ``out=`` tensor. Each
    is followed to its :func:`alias_root`, so a write through a view or a chain
    (``self.ema.mul_(0.9).add_(x)``) names the buffer (a ``get_attr`` node) or graph input
    (a placeholder) it lands in.

    >>> class Ema(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("ema", torch.zeros(2))
    ...     def forward(self, x):
    ...         self.ema.mul_(0.9).add_(x)
    ...         return x * 2
    >>> tracer = fx.Tracer()
    >>> tracer.proxy_buffer_attributes = True
    >>> gm = fx.GraphModule(Ema(), tracer.trace(Ema()))
    >>> [(n.name, [w.target for w in written_nodes(gm, n)]) for n in gm.graph.nodes
    ...  if written_nodes(gm, n)]
    [('mul_', ['ema']), ('add_', ['ema'])]
    """
    if n.op not in COMPUTE_OPS:
        return []
    schema = getattr(n.target, "_schema", None)
    if n.op == "call_function" and schema is not None:
        hidden = UNDECLARED_WRITES.get(schema.name, ())
        found = []
        for i, arg in enumerate(schema.arguments):
            value = _schema_value(n, i, arg.name)
            written = arg.alias_info is not None and arg.alias_info.is_write
            if isinstance(value, fx.Node) and (
                    written or (arg.name in hidden and _training(n, schema))):
                found.append(alias_root(value))
        return found
    found = [alias_root(n.kwargs["out"])] if isinstance(n.kwargs.get("out"), fx.Node) else []
    first = n.args[0] if n.args else None
    if not isinstance(first, fx.Node):
        return found
    if n.op == "call_method":
        inplace = is_inplace_method(n.target)
    elif n.op == "call_module":
        inplace = bool(getattr(gm.get_submodule(n.target), "inplace", False))
    else:
        inplace = n.target is operator.setitem or bool(n.kwargs.get("inplace", False))
    return (found + [alias_root(first)]) if inplace else found


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor inside it, its containers rebuilt with their
    own types: a Hugging Face ``ModelOutput`` stays one (fx's ``map_aggregate`` turns it into a
    plain dict, and ``output[0]`` then fails). Objects pytree does not know (a cache) are kept
    as they are."""
    return tree_map_only(torch.Tensor, fn, value)


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside a nested output, in pytree order."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def run_isolated(
    interp: fx.Interpreter,
    n: fx.Node,
    fwd_ctx: Optional[ContextManager] = None,
    bwd_ctx: Optional[ContextManager] = None,
) -> Any:
    """Run compute node ``n`` with the values in ``interp.env``; return its (detached) output.

    Floating-point tensor arguments become fresh leaves requiring grad (cloned, so in-place
    modules work), the forward runs inside ``fwd_ctx`` and the backward of the node's
    differentiable outputs (against ones) inside ``bwd_ctx``, with respect to the leaves and the
    module's parameters. Without a ``bwd_ctx`` no backward is run; nor for a node autograd
    refuses to record (it then runs without grad).
    """
    args, kwargs = interp.fetch_args_kwargs_from_env(n)
    leaves: list[torch.Tensor] = []

    def make_leaf(v: torch.Tensor) -> torch.Tensor:
        if v.is_floating_point():
            leaf = v.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf.clone()
        return v

    plain = (args, kwargs)
    args = map_tensors(args, make_leaf)
    kwargs = map_tensors(kwargs, make_leaf)
    try:
        with fwd_ctx or nullcontext():
            out = getattr(interp, n.op)(n.target, args, kwargs)
    except RuntimeError:
        if not leaves:
            raise
        # an op autograd refuses on inputs that require grad (an integer ``cumsum`` of float
        # counts, as a mixture-of-experts router computes): forward only, without grad
        args, kwargs = map_tensors(plain, lambda v: v.clone() if v.is_floating_point() else v)
        with fwd_ctx or nullcontext(), torch.no_grad():
            out = getattr(interp, n.op)(n.target, args, kwargs)
        bwd_ctx = None
    if bwd_ctx is not None:
        params = []
        if n.op == "call_module":
            params = list(trainable(interp.fetch_attr(n.target)).values())
        diff_out = [t for t in flat_tensors(out) if t.requires_grad and t.grad_fn is not None]
        wrt = leaves + params
        with bwd_ctx:
            if diff_out and wrt:
                torch.autograd.grad(
                    diff_out, wrt, grad_outputs=[torch.ones_like(t) for t in diff_out],
                    allow_unused=True,
                )
    return map_tensors(out, torch.Tensor.detach)

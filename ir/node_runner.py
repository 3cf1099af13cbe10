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

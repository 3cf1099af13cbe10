"""Every torch API newer than the oldest torch tidal supports, each with its fallback.

``setup.cfg`` names the floor (``torch>=2.11``, what the GPU machines run); code anywhere in
tidal that wants an API newer than that calls it through this module, which picks the newer
API where the running torch has it and an equivalent older one where it does not. Each choice
is made at call time (nothing cached), so a test can remove the newer API and see the fallback.

- :func:`all_gather_into_tensor`: the single-tensor all-gather, ``dist.all_gather_single``
  (newer than 2.11, which deprecates the old name) else ``dist.all_gather_into_tensor``.
- :func:`split_module_tuple`: ``split_module(..., tuple_return=True)`` (newer than 2.11), else
  ``split_module`` with each single-output submodule rewritten to return a 1-tuple.
- :func:`no_buffer_sync`: DDP's keyword that turns off the per-forward buffer broadcast,
  ``forward_sync_buffers=False`` (newer than 2.11) else ``broadcast_buffers=False``.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir.compat import split_module_tuple, no_buffer_sync
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))
    >>> split = split_module_tuple(gm, gm, lambda n: 0 if n.name == "_0" else 1)
    >>> [type(split.get_submodule(f"submod_{i}")(torch.ones(1))).__name__ for i in (0, 1)]
    ['tuple', 'tuple']
    >>> torch.equal(split(torch.ones(2)), gm(torch.ones(2)))
    True
    >>> sorted(no_buffer_sync().values())
    [False]
"""
from __future__ import annotations

import inspect
import operator
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.fx.passes.split_module as _split_module

__all__ = ["all_gather_into_tensor", "split_module_tuple", "no_buffer_sync"]


def _accepts(fn: Callable[..., Any], keyword: str) -> bool:
    """Whether ``fn`` (a function or a class) names ``keyword`` among its parameters."""
    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: take the older API
        return False


def all_gather_into_tensor() -> Callable[..., Any]:
    """torch's single-tensor all-gather, ``(output, input, group=, async_op=)``:
    ``dist.all_gather_single`` where this torch has it (newer than 2.11, which deprecates the
    old name), else ``dist.all_gather_into_tensor`` (torch 2.11)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def split_module_tuple(m: fx.GraphModule, root_m: torch.nn.Module,
                       split_callback: Callable[[fx.Node], int], **kwargs: Any
                       ) -> fx.GraphModule:
    """``torch.fx.passes.split_module.split_module(m, root_m, split_callback, **kwargs,
    tuple_return=True)``: every submodule returns a tuple (a 1-tuple for one output), and the
    top graph reads each output with ``getitem``. Where ``split_module`` has no ``tuple_return``
    (torch 2.11), the same graph is made from its result: each submodule that returns one
    value returns it as a 1-tuple, and a ``getitem(call, 0)`` after its call takes the call's
    place (the top graph rebuilt in order, so the ``getitem`` nodes are named as torch names
    them)."""
    split_module = _split_module.split_module
    if _accepts(split_module, "tuple_return"):
        return split_module(m, root_m, split_callback, **kwargs, tuple_return=True)
    return _tuple_returns(split_module(m, root_m, split_callback, **kwargs))


def _tuple_returns(split: fx.GraphModule) -> fx.GraphModule:
    """``split`` (a ``split_module`` result) with every submodule returning a tuple, in place."""
    single: set[str] = set()
    for call in split.graph.nodes:
        if call.op != "call_module":
            continue
        sub = split.get_submodule(call.target)
        if not isinstance(sub, fx.GraphModule):
            continue
        out = next(n for n in sub.graph.nodes if n.op == "output")
        if isinstance(out.args[0], fx.Node):
            out.args = ((out.args[0],),)
            sub.recompile()
            single.add(call.target)
    if not single:
        return split
    graph = fx.Graph()
    graph.set_codegen(split.graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    for node in split.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            # named afresh in order, as split_module's own getitem nodes are
            new = graph.create_node(node.op, node.target, fx.node.map_arg(node.args, env.get),
                                    fx.node.map_arg(node.kwargs, env.get),
                                    type_expr=node.type)
            new.meta = dict(node.meta)
        else:
            new = graph.node_copy(node, env.get)
        env[node] = new
        if node.op == "call_module" and node.target in single:
            env[node] = graph.call_function(operator.getitem, (new, 0))
    split.graph = graph
    return split


def no_buffer_sync(ddp_class: type = torch.nn.parallel.DistributedDataParallel
                   ) -> dict[str, bool]:
    """DDP's keyword that turns off the buffer broadcast before every forward:
    ``forward_sync_buffers=False`` where ``ddp_class`` takes it (torch newer than 2.11, which
    deprecates the old one), else ``broadcast_buffers=False`` (torch 2.11). Where the models
    are built alike on every rank, the old keyword's skipped initial sync changes nothing."""
    if _accepts(ddp_class, "forward_sync_buffers"):
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}

"""A model call's inputs, bound to the traced graph's placeholders.

Users give example inputs as a tensor, a tuple of positional inputs, or a dict of keyword
inputs (the usual form for Hugging Face models). Inside tidal the traced graph is called with
its placeholders in order, so every entry point binds what the user gave to the placeholders
*by name*: a dict stays a keyword input (``attention_mask`` never lands in
``past_key_values``), whatever the dict's order. ``as_kwargs`` goes the other way, for code
that must call the original model (capturing a training step).

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir.inputs import bind_inputs
    >>> class M(torch.nn.Module):
    ...     def forward(self, a, b):
    ...         return a - b
    >>> gm = fx.symbolic_trace(M())
    >>> a, b = torch.ones(1), torch.zeros(1)
    >>> [t.item() for t in bind_inputs(gm, {"b": b, "a": a})]
    [1.0, 0.0]
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.fx as fx

from tidal.ir import meta
from tidal.ir.errors import TidalError


class InputError(TidalError, ValueError):
    """Inputs that do not fit the traced model's forward (an unknown or missing keyword)."""


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's placeholders, in call order."""
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def input_name(node: fx.Node) -> str:
    """The forward parameter name of a placeholder (as recorded when tracing, else its target)."""
    return meta.get_input_name(node) or str(node.target)


def input_names(gm: fx.GraphModule) -> tuple[str, ...]:
    """The forward parameter names of the graph's placeholders, in call order."""
    return tuple(input_name(n) for n in placeholders(gm))


def _default(node: fx.Node) -> tuple[bool, Any]:
    """(has a default, the default) of a placeholder."""
    return (True, node.args[0]) if node.args else (False, None)


def bind_inputs(gm: fx.GraphModule, inputs: Any, what: str = "inputs") -> tuple:
    """``inputs`` (a tensor, a tuple/list of positional inputs, or a dict of keyword inputs)
    as positional values in the order of ``gm``'s placeholders. Keywords are matched by the
    model's forward parameter names; placeholders not given take their traced default. Raises
    ``InputError`` naming an unknown keyword or a missing input."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if not isinstance(inputs, Mapping):
        return tuple(inputs)
    nodes = placeholders(gm)
    names = [input_name(n) for n in nodes]
    unknown = [k for k in inputs if k not in names]
    if unknown:
        raise InputError(f"{what}: {unknown[0]!r} is not an input of the traced model "
                         f"(its inputs: {', '.join(names)})")
    out = []
    for node, name in zip(nodes, names):
        if str(node.target).startswith("**"):  # **kwargs (HF's **loss_kwargs), always last:
            break                                # it takes nothing
        if name in inputs:
            out.append(inputs[name])
            continue
        has, value = _default(node)
        if not has:
            raise InputError(f"{what}: the model's input {name!r} is missing (given: "
                             f"{', '.join(inputs)})")
        out.append(value)
    return tuple(out)


def as_kwargs(gm: fx.GraphModule, positional: tuple) -> dict[str, Any]:
    """Positional values in ``gm``'s placeholder order as keyword inputs of the original model
    (the inverse of ``bind_inputs``)."""
    return dict(zip(input_names(gm), positional))

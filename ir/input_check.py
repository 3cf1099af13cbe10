"""Check example inputs against what the graph's first consumer of each input expects.

An integer tensor given to a float convolution otherwise fails deep inside torch with a
misleading "expected scalar type Long but found Float"; a float tensor given to an embedding
fails with "Expected tensor for argument #1 'indices'". This check names the input instead.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir.input_check import check_input_dtypes
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)))
    >>> check_input_dtypes(gm, (torch.zeros(1, 3, 8, 8, dtype=torch.long),))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tidal.ir.inputs.InputError: input 'input' is torch.int64, but its first consumer '0' ...
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from tidal.ir.inputs import InputError, input_name, placeholders

_INDEX_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def _float_dtype(module: torch.nn.Module) -> Optional[torch.dtype]:
    """The floating dtype a module computes in (its first floating parameter's), or None."""
    for p in module.parameters(recurse=False):
        if p.is_floating_point():
            return p.dtype
    return None


def _expectation(gm: fx.GraphModule, user: fx.Node) -> Optional[tuple[str, str, str]]:
    """(kind, module type, dtype) of what ``user`` needs as its first input: kind "index" for
    embeddings, "float" for modules with floating weights; None when not known."""
    if user.op != "call_module":
        return None
    module = gm.get_submodule(str(user.target))
    if isinstance(module, _INDEX_MODULES):
        return "index", type(module).__name__, "torch.long"
    dtype = _float_dtype(module)
    return ("float", type(module).__name__, str(dtype)) if dtype is not None else None


def _mismatch(name: str, value: torch.Tensor, user: fx.Node,
              expected: tuple[str, str, str]) -> Optional[str]:
    """The error message when ``value`` cannot be what ``user`` expects, else None."""
    kind, module_type, dtype = expected
    floating = value.is_floating_point() or value.is_complex()
    if kind == "float" and not floating:
        need = f"computes in {dtype}: give a floating-point tensor (e.g. {name}.float())"
    elif kind == "index" and floating:
        need = f"takes integer indices: give a torch.long tensor (e.g. {name}.long())"
    else:
        return None
    return (f"input {name!r} is {value.dtype}, but its first consumer '{user.target}' "
            f"({module_type}) {need}")


def check_input_dtypes(gm: fx.GraphModule, inputs: Sequence[Any]) -> None:
    """Raise ``InputError`` naming the input when a tensor input's dtype cannot be what the
    module that first consumes it (directly, as its first argument) expects: an integer
    tensor into a module with floating weights (Conv, Linear, norms), a floating tensor into an
    embedding."""
    for node, value in zip(placeholders(gm), inputs):
        if not isinstance(value, torch.Tensor):
            continue
        for user in node.users:
            if not user.args or user.args[0] is not node:
                continue
            expected = _expectation(gm, user)
            problem = expected and _mismatch(input_name(node), value, user, expected)
            if problem:
                raise InputError(problem)
            break

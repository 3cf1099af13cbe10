"""Copies of a module tree that share the original's parameters.

``structural_copy(mod)`` gives new module objects (attributes copied shallowly) holding the same
parameter and buffer tensors, so a submodule swapped, or a method replaced, in the copy leaves
``mod`` as it was. The ``clustered_attention`` pass uses it for torch transformer stacks it
rewrites; the CHAI generation runtime for the Hugging Face model whose attention it replaces.

Example:
    >>> import torch
    >>> from tidal.ir.module_copy import structural_copy
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> twin = structural_copy(model)
    >>> twin[1] = torch.nn.Identity()
    >>> type(model[1]).__name__, twin[0].weight is model[0].weight
    ('ReLU', True)
"""
from __future__ import annotations

import copy

import torch


def structural_copy(mod: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``mod``'s module tree: new module objects (attributes copied shallowly) sharing
    ``mod``'s parameters and buffers."""
    new = copy.copy(mod)
    new.__dict__["_modules"] = {name: None if sub is None else structural_copy(sub)
                                for name, sub in mod._modules.items()}
    new.__dict__["_parameters"] = dict(mod._parameters)
    new.__dict__["_buffers"] = dict(mod._buffers)
    return new

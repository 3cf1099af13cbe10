"""The optimizer's side of a program: gradients handed to parameters, and the user's optimizer
stepped on all of them, on a subset, or cloned for a replica.

A program computes gradients as values (a captured step's outputs, a sync's results) and its
``optimizer`` piece hands them to the parameters (:func:`set_grads`, :func:`accumulate_grad`)
and steps the user's optimizer: on every parameter, or on those one partition owns
(:func:`step_only`, the same optimizer object so its state and a scheduler on it stay), or on
a replica's parameters through a clone of it (:func:`clone_optimizer`). A rank that holds only
the parameters it owns takes the others out of the optimizer for good (:func:`remove_params`).

Example:
    >>> import torch
    >>> m = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(m.parameters(), lr=1.0)
    >>> set_grads(dict(m.named_parameters()), {"weight": torch.ones(2), "bias": torch.ones(1)})
    >>> with torch.no_grad():
    ...     before = m.bias.clone()
    >>> step_only(opt, [m.weight])
    >>> m.weight.grad.shape, torch.equal(m.bias, before), len(opt.param_groups[0]["params"])
    (torch.Size([1, 2]), True, 2)
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from tidal.runtime.backend import used_here


def set_grads(params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
              copy: bool = False) -> None:
    """``params[name].grad = grads[name]`` (reshaped to the parameter's shape where it
    differs; a copy with ``copy``: a value the next step overwrites, a CUDA graph's static
    output), for each name of ``grads``. The gradients may have been made on another stream: they are marked used on
    this one first."""
    used_here(*grads.values())
    for name, g in grads.items():
        p = params[name]
        if g.shape != p.shape:
            g = g.reshape(p.shape)
        p.grad = g.clone() if copy else g


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad`` as autograd accumulates (a copy first: graph outputs may alias).

    Example:
        >>> w = torch.zeros(2, requires_grad=True)
        >>> accumulate_grad(w, torch.ones(2)); accumulate_grad(w, torch.ones(2))
        >>> w.grad.tolist()
        [2.0, 2.0]
    """
    if param.grad is None:
        param.grad = grad.detach().clone()
    else:
        param.grad.add_(grad)


def step_only(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
    """Step ``optimizer`` on ``params`` alone: for this call its ``param_groups`` hold only
    their entries (each parameter is updated from its own gradient and state, as every
    ``torch.optim`` optimizer but L-BFGS does); the groups are restored after."""
    chosen = {id(p) for p in params}
    groups = optimizer.param_groups
    kept = [g["params"] for g in groups]
    try:
        for g in groups:
            g["params"] = [p for p in g["params"] if id(p) in chosen]
        optimizer.step()
    finally:
        for g, listed in zip(groups, kept):
            g["params"] = listed


def clone_optimizer(opt: torch.optim.Optimizer, mapping: dict[int, torch.Tensor]
                    ) -> torch.optim.Optimizer:
    """A fresh optimizer of ``opt``'s class and hyper-parameters over the tensors ``mapping``
    gives for its parameters (by ``id``); parameters not in ``mapping`` are left out. Raises
    ``ValueError`` when it holds none of them.

    Example:
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(a.parameters(), lr=0.5, momentum=0.9)
        >>> twin = clone_optimizer(opt, {id(p): q for p, q in zip(a.parameters(),
        ...                                                      b.parameters())})
        >>> twin.param_groups[0]["lr"], twin.param_groups[0]["params"][0] is b.weight
        (0.5, True)
    """
    groups = []
    for g in opt.param_groups:
        params = [mapping[id(p)] for p in g["params"] if id(p) in mapping]
        if params:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    if not groups:
        raise ValueError("the optimizer holds none of the model's parameters")
    return type(opt)(groups, **opt.defaults)


def remove_params(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                  names: Sequence[str]) -> None:
    """Take ``module``'s parameters ``names`` out of ``optimizer``'s param groups (the lists
    themselves, in place: the same optimizer object, so a learning-rate scheduler on it keeps
    working; a group left empty stays, so group indices do not change) and its state.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> remove_params(opt, model, ["0.weight", "0.bias"])
        >>> [len(g["params"]) for g in opt.param_groups]
        [2]
    """
    params = dict(module.named_parameters())
    drop = {id(params[n]) for n in names}
    for group in optimizer.param_groups:
        removed = [p for p in group["params"] if id(p) in drop]
        if removed:
            group["params"][:] = [p for p in group["params"] if id(p) not in drop]
            for p in removed:
                optimizer.state.pop(p, None)

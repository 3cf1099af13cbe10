"""The optimizer's side of a program: gradients handed to parameters, and the user's optimizer
stepped on all of them, on a subset, or cloned for a replica.

A program computes gradients as values (a captured step's outputs, a sync's results) and its
``optimizer`` piece hands them to the parameters (:func:`set_grads`, :func:`accumulate_grad`)
and steps the user's optimizer: on every parameter, or on those one partition owns
(:func:`step_only`, the same optimizer object so its state and a scheduler on it stay), or on
a replica's parameters through a clone of it (:func:`clone_optimizer`). A rank that holds only
the parameters it owns takes the others out of the optimizer for good (:func:`remove_params`).
In the open step (``Compiled.backward``) there is no optimizer piece: the ``grads`` piece adds
the synchronized gradients to ``.grad`` (:func:`add_grads`) and, inside ``no_sync``, the
``accumulate`` piece keeps them in the program (:class:`LocalGrads`) until the next sync.

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

from typing import Any, Iterable, Mapping, Sequence

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
        >>> adamw = torch.optim.AdamW([{"params": [a.weight], "weight_decay": 0.1},
        ...                            {"params": [a.bias], "weight_decay": 0.0}], lr=1e-3)
        >>> twin = clone_optimizer(adamw, {id(a.weight): b.weight, id(a.bias): b.bias})
        >>> type(twin).__name__, [g["weight_decay"] for g in twin.param_groups]
        ('AdamW', [0.1, 0.0])
    """
    groups = []
    for g in opt.param_groups:
        params = [mapping[id(p)] for p in g["params"] if id(p) in mapping]
        if params:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    if not groups:
        raise ValueError("the optimizer holds none of the model's parameters")
    # each group carries every hyper-parameter; the class's own defaults may hold keys its
    # constructor does not take (AdamW's ``decoupled_weight_decay``)
    clone = type(opt)(groups)
    clone.defaults.update(opt.defaults)
    return clone


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


GRADS, ACCUMULATE = "grads", "accumulate"
"""The last piece of an open step (``Compiled.backward``): ``grads`` adds the synchronized
gradients to the parameters' ``.grad``; ``accumulate`` (inside ``no_sync``) adds this call's
gradients to the program's :class:`LocalGrads` instead."""


def scaled(grad: torch.Tensor, scale: Any) -> torch.Tensor:
    """``grad * scale`` (``scale`` a number or a tensor: a ``GradScaler``'s), or ``grad`` itself
    when ``scale`` is None.

    Example:
        >>> scaled(torch.ones(2), 0.25).tolist(), scaled(torch.ones(1), None).tolist()
        ([0.25, 0.25], [1.0])
    """
    return grad if scale is None else grad * scale


def add_grads(params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor]) -> None:
    """``params[name].grad += grads[name]`` (set when None, reshaped to the parameter's shape),
    as ``loss.backward()`` adds to it, for each name of ``grads`` whose parameter still
    requires a gradient (a frozen one is left untouched). The gradients may have been made on
    another stream: they are marked used on this one first.

    Example:
        >>> m = torch.nn.Linear(2, 1)
        >>> _ = m.bias.requires_grad_(False)
        >>> add_grads(dict(m.named_parameters()), {"weight": torch.ones(2), "bias": torch.ones(1)})
        >>> add_grads(dict(m.named_parameters()), {"weight": torch.ones(2)})
        >>> m.weight.grad.tolist(), m.bias.grad
        ([[2.0, 2.0]], None)
    """
    used_here(*grads.values())
    for name, g in grads.items():
        p = params[name]
        if p.requires_grad:
            accumulate_grad(p, g.reshape(p.shape) if g.shape != p.shape else g)


class LocalGrads:
    """Gradients a program accumulates on this rank inside ``Compiled.no_sync()`` (DDP's
    ``no_sync``), by parameter, neither synchronized nor in ``.grad``: the next synchronized
    call adds its own gradient to each sum (:meth:`plus`) and synchronizes the total once.

    Example:
        >>> w = torch.zeros(2, requires_grad=True)
        >>> local = LocalGrads()
        >>> local.add("w", w, torch.ones(2)); local.add("w", w, torch.ones(2))
        >>> local.plus(w, torch.ones(2)).tolist(), len(local)
        ([3.0, 3.0], 0)
    """

    def __init__(self) -> None:
        self._sums: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._sums)

    def add(self, name: str, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` to ``param``'s sum (a copy of it first: graph outputs are reused)."""
        kept = self._sums.get(id(param))
        if kept is None:
            self._sums[id(param)] = (name, param, grad.detach().clone())
        else:
            kept[2].add_(grad)

    def plus(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``param``'s sum plus ``grad`` (the sum is handed over: taken out of here), or
        ``grad`` when nothing was accumulated for it."""
        kept = self._sums.pop(id(param), None)
        return grad if kept is None else kept[2].add_(grad)

    def drain(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, parameter, sum)`` of every sum left (taken out of here)."""
        left = list(self._sums.values())
        self._sums.clear()
        return left

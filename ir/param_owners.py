"""Who owns each trainable parameter: the pure rules every multi-rank plan applies.

A parameter's gradient is synchronized, and the parameter updated, by its *owner*: the rank
set, partition or wave that syncs it. :func:`trainable` lists what gets gradients,
:func:`first_owners` gives each parameter to the first of several users (round robin: the
lowest partition using it, whose backward runs last) and :func:`unowned` names the trainable
parameters nobody owns: left out of every sync, the ranks' copies would drift apart while the
loss still looks right, so a plan refuses them by name.

Example:
    >>> import torch
    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> owners = first_owners([[("w", a.weight), ("b", a.bias)], [("w", a.weight)]])
    >>> [[name for name, _ in part] for part in owners]
    [['w', 'b'], []]
    >>> unowned(a, {id(a.weight)})
    ['bias']
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence, TypeVar

import torch

T = TypeVar("T")


def trainable(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters of ``module`` that get gradients, by name, in registration order.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> _ = m.bias.requires_grad_(False)
        >>> list(trainable(m))
        ['weight']
    """
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def first_owners(users: Sequence[Sequence[tuple[str, T]]],
                 key: Callable[[Any], Hashable] = id) -> list[list[tuple[str, T]]]:
    """Per user (a partition, a rank set), the ``(name, value)`` pairs it owns: each value
    (told apart by ``key``, its identity by default) goes to the first user that lists it,
    once (a parameter may reach a partition by two names)."""
    seen: set = set()
    owned: list[list[tuple[str, T]]] = []
    for listed in users:
        owned.append([])
        for name, value in listed:
            if key(value) not in seen:
                seen.add(key(value))
                owned[-1].append((name, value))
    return owned


def unowned(root: torch.nn.Module, owned_ids: set[int]) -> list[str]:
    """The names of ``root``'s trainable parameters whose ids are not in ``owned_ids``."""
    return [k for k, p in trainable(root).items() if id(p) not in owned_ids]

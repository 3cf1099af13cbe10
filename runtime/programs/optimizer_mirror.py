"""A replica's optimizers that follow the user's: a clone stepped with each of them.

A program that trains a second replica of the model (``tick_tock``'s tock wave) steps it as
the user's optimizer says. :class:`MirroredOptimizer` is a clone of one user optimizer
(``optimizer_wiring.clone_optimizer``: its class, groups and hyper-parameters) over the
replica's parameters, taking the user's group hyper-parameters (a learning-rate schedule, a
changed weight decay) group by group before every step. :class:`StepMirrors` does it without
being handed the optimizers (the open step, ``Compiled.backward``, where the loop owns them):
a global ``torch.optim`` step post-hook (``register_optimizer_step_post_hook``) sees every
optimizer step in the process; after each step of an optimizer that holds some of the
model's parameters it steps that optimizer's clone (made on its first step, one per
optimizer) on the replica's gradients, then sets those gradients to None: the replica's
gradients are zeroed right after its step, whatever the loop's ``zero_grad`` does. An
optimizer step that is skipped (``GradScaler.step`` on an inf) runs no hook, so the replica
skips it too. The hook holds the mirrors weakly and is removed when they are collected.

Example:
    >>> import copy, torch
    >>> model = torch.nn.Linear(2, 1)
    >>> replica = copy.deepcopy(model)
    >>> mirrors = StepMirrors({id(p): q for p, q in zip(model.parameters(),
    ...                                                 replica.parameters())})
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.5)
    >>> for p, q in zip(model.parameters(), replica.parameters()):
    ...     p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    >>> opt.step()                                          # the replica steps too
    >>> torch.equal(model.weight, replica.weight), replica.weight.grad is None
    (True, True)
    >>> len(mirrors.optimizers())
    1
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Mapping, Optional, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from tidal.runtime.programs.optimizer_wiring import clone_optimizer


class MirroredOptimizer:
    """A clone of ``source`` over the tensors ``mapping`` gives for its parameters (by
    ``id``; see ``clone_optimizer``), following ``source``'s groups: ``clone``, the replica's
    ``params`` it steps, and ``group_of[i]``, which of ``source``'s groups clone group ``i``
    came from (a group with none of the mapped parameters has no clone).

    Example:
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(a.parameters(), lr=0.5)
        >>> twin = MirroredOptimizer(opt, {id(p): q for p, q in zip(a.parameters(),
        ...                                                        b.parameters())})
        >>> opt.param_groups[0]["lr"] = 0.25
        >>> twin.follow(opt); twin.clone.param_groups[0]["lr"]
        0.25
    """

    def __init__(self, source: torch.optim.Optimizer, mapping: Mapping[int, torch.Tensor]):
        self.clone = clone_optimizer(source, dict(mapping))
        self.group_of = tuple(i for i, g in enumerate(source.param_groups)
                              if any(id(p) in mapping for p in g["params"]))
        self.params = [p for g in self.clone.param_groups for p in g["params"]]

    def follow(self, source: torch.optim.Optimizer) -> None:
        """Take ``source``'s hyper-parameters group by group. Raises ``ValueError`` when
        ``source`` has fewer groups than when the clone was made."""
        groups = source.param_groups
        if len(groups) <= max(self.group_of, default=-1):
            raise ValueError(f"the optimizer's param groups changed after its first step (a "
                             f"{type(source).__name__} with {len(groups)} groups; the replica's "
                             f"clone follows them group by group): add param groups before "
                             f"the first step")
        for mine, i in zip(self.clone.param_groups, self.group_of):
            mine.update({k: v for k, v in groups[i].items() if k != "params"})

    def step(self, source: torch.optim.Optimizer) -> None:
        """Follow ``source``, then step the clone on the replica's gradients."""
        self.follow(source)
        self.clone.step()


def holds_any(optimizer: torch.optim.Optimizer, ids: Mapping[int, Any]) -> bool:
    """Whether any parameter of ``optimizer`` has its ``id`` in ``ids``.

    Example:
        >>> w = torch.zeros(1, requires_grad=True)
        >>> holds_any(torch.optim.SGD([w], lr=1.0), {id(w): None})
        True
    """
    return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])


class StepMirrors:
    """The replica's clones of whatever optimizers step the model's parameters (see the
    module docstring). ``mapping``: the model's parameters (by ``id``) to the replica's;
    ``who``: the name errors start with."""

    def __init__(self, mapping: Mapping[int, torch.Tensor], who: str = "tick_tock"):
        self._mapping = dict(mapping)
        self._who = who
        self._made: dict[int, tuple[weakref.ref, MirroredOptimizer]] = {}
        self._order: list[MirroredOptimizer] = []
        self._pending: list[Mapping[str, Any]] = []
        handle = register_optimizer_step_post_hook(
            functools.partial(_after_step, weakref.ref(self)))
        self._finalizer = weakref.finalize(self, handle.remove)

    def close(self) -> None:
        """Remove the hook now (it is removed when this object is collected, too)."""
        self._finalizer()

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The clones, in the order their optimizers first stepped."""
        return [m.clone for m in self._order]

    def mirror_of(self, optimizer: torch.optim.Optimizer) -> Optional[MirroredOptimizer]:
        """``optimizer``'s mirror (made on first use), or None when it holds none of the
        model's parameters (another model's, a clone's)."""
        kept = self._made.get(id(optimizer))
        if kept is not None and kept[0]() is optimizer:
            return kept[1]
        if not holds_any(optimizer, self._mapping):
            return None
        mirror = MirroredOptimizer(optimizer, self._mapping)
        if len(self._order) < len(self._pending):  # a checkpoint's state for this clone
            mirror.clone.load_state_dict(self._pending[len(self._order)])
        self._made[id(optimizer)] = (weakref.ref(optimizer), mirror)
        self._order.append(mirror)
        return mirror

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` stepped: step its mirror, then set the gradients it stepped on to
        None (nothing when ``optimizer`` holds none of the model's parameters)."""
        mirror = self.mirror_of(optimizer)
        if mirror is None:
            return
        try:
            mirror.step(optimizer)
        except Exception as e:
            e.add_note(f"{self._who}: stepping the replica's clone of "
                       f"{type(optimizer).__name__} after the loop's optimizer.step()")
            raise
        for p in mirror.params:
            p.grad = None

    def state_dict(self) -> list[dict[str, Any]]:
        """Each clone's state, in the order their optimizers first stepped (then the states
        loaded for clones not made yet)."""
        return [m.clone.state_dict() for m in self._order] + \
            [dict(s) for s in self._pending[len(self._order):]]

    def load_state_dict(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Restore :meth:`state_dict`'s result: the clones made load theirs now, the others
        when their optimizers first step (in the same order as when saved)."""
        self._pending = list(states)
        for mirror, state in zip(self._order, self._pending):
            mirror.clone.load_state_dict(state)


def _after_step(mirrors: "weakref.ref[StepMirrors]", optimizer: torch.optim.Optimizer,
                args: Any, kwargs: Any) -> None:
    """The global step post-hook: :meth:`StepMirrors.after_step` while they are alive."""
    alive = mirrors()
    if alive is not None:
        alive.after_step(optimizer)

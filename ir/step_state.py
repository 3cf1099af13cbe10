"""What a captured graph or training step depends on besides its inputs' shapes: the guard key.

A trace bakes the model's state into the graph it records (``torch.export`` records a dropout's
``train`` flag and a BatchNorm's statistics update as constants), and a captured training step
bakes in more (which parameters get a gradient, autocast's casts, grad mode). :func:`step_state`
reads that state from a model and the thread's autocast and grad modes; :func:`state_changes`
says, in words naming the modules and parameters, what differs between two states, so whoever
runs a capture can re-capture or raise instead of silently running the old one.

Example:
    >>> import torch
    >>> from tidal.ir.step_state import state_changes, step_state
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    >>> before = step_state(model, named=True)
    >>> model.eval(); model[0].bias.requires_grad_(False)   # doctest: +ELLIPSIS
    Sequential(...)
    Parameter containing:...
    >>> for line in state_changes(before, step_state(model)):
    ...     print(line)
    training mode True -> False (modules '', '0', '1')
    requires_grad True -> False (parameters '0.bias')
    >>> step_state(model) == before                       # compared by the flags alone
    False
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class StepState:
    """The state a capture depends on: each module's ``training`` flag (``model.modules()``
    order) and each module's own parameters' ``requires_grad`` (module by module; a parameter
    shared by two modules counted in each), autocast (enabled and dtype per device type) and
    grad mode of the calling thread. Compared by ``==`` on those flags alone: cheap enough
    for every step. ``module_names``/``param_names`` (aligned with the flags) are filled only
    when asked for (``step_state(model, named=True)``), to say what changed."""

    training: tuple[bool, ...]
    requires_grad: tuple[bool, ...]
    autocast: tuple[tuple[str, bool, str], ...]
    grad_enabled: bool
    module_names: tuple[str, ...] = field(default=(), compare=False)
    param_names: tuple[str, ...] = field(default=(), compare=False)

    @property
    def mode_key(self) -> tuple[bool, ...]:
        """The module training flags alone (what a trace of the forward depends on)."""
        return self.training


def autocast_state() -> tuple[tuple[str, bool, str], ...]:
    """(device type, enabled, dtype name) of autocast on this thread, per device type."""
    out = []
    for device in AUTOCAST_DEVICES:
        enabled = torch.is_autocast_enabled(device)
        dtype = str(torch.get_autocast_dtype(device)).replace("torch.", "") if enabled else ""
        out.append((device, enabled, dtype))
    return tuple(out)


def step_state(model: torch.nn.Module, named: bool = False) -> StepState:
    """The :class:`StepState` of ``model`` now, on this thread: its flags read in one walk of
    the modules (a guard calls it on every step); with ``named``, the names too."""
    modules = list(model.named_modules()) if named else [("", m) for m in model.modules()]
    own = [(prefix, m._parameters) for prefix, m in modules]  # each module's own parameters
    requires_grad = tuple(p.requires_grad for _, ps in own for p in ps.values() if p is not None)
    state = StepState(tuple(m.training for _, m in modules), requires_grad, autocast_state(),
                      torch.is_grad_enabled())
    if not named:
        return state
    params = tuple(f"{prefix}.{n}" if prefix else n for prefix, ps in own
                   for n, p in ps.items() if p is not None)
    return replace(state, module_names=tuple(n for n, _ in modules), param_names=params)


def _flips(names: Sequence[str], before: Sequence[bool], after: Sequence[bool], what: str,
           kind: str) -> list[str]:
    """One line per direction of flags that changed (the first few names quoted)."""
    lines = []
    for old in (True, False):
        changed = [n for n, a, b in zip(names, before, after) if a == old and b != old]
        if changed:
            shown = ", ".join(repr(n) for n in changed[:4])
            more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
            lines.append(f"{what} {old} -> {not old} ({kind} {shown}{more})")
    return lines


def state_changes(before: StepState, after: StepState) -> list[str]:
    """What differs from ``before`` to ``after``, one line each (empty: nothing); modules and
    parameters are named from whichever state is named (by position when neither is)."""
    if len(before.training) != len(after.training) or \
            len(before.requires_grad) != len(after.requires_grad):
        return ["the model's modules or parameters were replaced"]
    modules = before.module_names or after.module_names or \
        tuple(f"#{i}" for i in range(len(after.training)))
    params = before.param_names or after.param_names or \
        tuple(f"#{i}" for i in range(len(after.requires_grad)))
    lines = _flips(modules, before.training, after.training, "training mode", "modules")
    lines += _flips(params, before.requires_grad, after.requires_grad, "requires_grad",
                    "parameters")
    for (device, on0, dt0), (_, on1, dt1) in zip(before.autocast, after.autocast):
        if (on0, dt0) != (on1, dt1):
            lines.append(f"autocast({device}) {dt0 if on0 else 'off'} -> {dt1 if on1 else 'off'}")
    if before.grad_enabled != after.grad_enabled:
        lines.append(f"grad mode {'on' if before.grad_enabled else 'off'} -> "
                     f"{'on' if after.grad_enabled else 'off'}")
    return lines

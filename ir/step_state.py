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
    >>> before = step_state(model)
    >>> model.eval(); model[0].bias.requires_grad_(False)   # doctest: +ELLIPSIS
    Sequential(...)
    Parameter containing:...
    >>> for line in state_changes(before, step_state(model)):
    ...     print(line)
    training mode True -> False (modules '', '0', '1')
    requires_grad True -> False (parameters '0.bias')
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class StepState:
    """The state a capture depends on: each module's ``training`` flag and each parameter's
    ``requires_grad`` (in ``named_modules``/``named_parameters`` order, names alongside),
    autocast (enabled and dtype per device type) and grad mode of the calling thread."""

    module_names: tuple[str, ...]
    training: tuple[bool, ...]
    param_names: tuple[str, ...]
    requires_grad: tuple[bool, ...]
    autocast: tuple[tuple[str, bool, str], ...]
    grad_enabled: bool

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


def step_state(model: torch.nn.Module) -> StepState:
    """The :class:`StepState` of ``model`` now, on this thread."""
    modules = list(model.named_modules())
    params = list(model.named_parameters())
    return StepState(tuple(n for n, _ in modules), tuple(m.training for _, m in modules),
                     tuple(n for n, _ in params), tuple(p.requires_grad for _, p in params),
                     autocast_state(), torch.is_grad_enabled())


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
    """What differs from ``before`` to ``after``, one line each (empty: nothing)."""
    if before.module_names != after.module_names or before.param_names != after.param_names:
        return ["the model's modules or parameters were replaced"]
    lines = _flips(before.module_names, before.training, after.training, "training mode",
                   "modules")
    lines += _flips(before.param_names, before.requires_grad, after.requires_grad,
                    "requires_grad", "parameters")
    for (device, on0, dt0), (_, on1, dt1) in zip(before.autocast, after.autocast):
        if (on0, dt0) != (on1, dt1):
            lines.append(f"autocast({device}) {dt0 if on0 else 'off'} -> {dt1 if on1 else 'off'}")
    if before.grad_enabled != after.grad_enabled:
        lines.append(f"grad mode {'on' if before.grad_enabled else 'off'} -> "
                     f"{'on' if after.grad_enabled else 'off'}")
    return lines

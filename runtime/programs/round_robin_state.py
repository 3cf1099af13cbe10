"""What a round-robin program keeps from one step to the next, for a checkpoint and for a
re-capture (``Compiled.runtime_state_dict``, ``Compiled``'s re-capture after freezing).

Two things change the next steps' results: each partition's gradient sync (after the
``compression`` pass, a compressor of its own with its error feedback, PowerSGD's warm-started
Q, per-tensor step counters), and the gradients the open step accumulated inside ``no_sync``
on this rank (``LocalGrads``), not yet synced. :func:`saved_state` returns them by partition
index and parameter name (the split graph's names, ``submod_p.<local>`` or a ``get_attr``
target: the same in a program built again for another set of trainable parameters);
:func:`load_saved_state` puts them back. A program that holds neither (one process, where no
compressor runs; no compression pass; before the first step) saves ``{}``.

Example:
    >>> import torch
    >>> from tidal.runtime.programs.optimizer_wiring import LocalGrads
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> local = LocalGrads()
    >>> local.add("submod_0.w", w, torch.ones(2))
    >>> state = saved_state({}, local)
    >>> state
    {'local_grads': {'submod_0.w': tensor([1., 1.])}}
    >>> again = LocalGrads()
    >>> load_saved_state(state, lambda p: None, again, [[("submod_0.w", w)]])
    >>> again.plus(w, torch.ones(2)).tolist()
    [2.0, 2.0]
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from tidal.runtime.comm.grad_sync import GradSync
from tidal.runtime.programs.optimizer_wiring import LocalGrads

SYNCS, LOCAL_GRADS = "syncs", "local_grads"
"""The sections of the saved state: each partition's gradient sync, and the ``no_sync``
gradients not yet synced."""


def pending_grads(local: LocalGrads) -> dict[str, torch.Tensor]:
    """A copy of what ``local`` holds, by parameter name (``local`` keeps it all)."""
    held = local.drain()
    for name, param, grad in held:
        local.add(name, param, grad)
    return {name: grad.detach().clone() for name, _, grad in held}


def saved_state(syncs: Mapping[int, GradSync], local: LocalGrads) -> dict[str, Any]:
    """The state of the partitions' gradient syncs ``syncs`` (by partition index) and the
    ``no_sync`` gradients ``local`` holds (by parameter name), copies; each section only when
    it holds something (``{}`` when neither does)."""
    state: dict[str, Any] = {}
    if syncs:
        state[SYNCS] = {p: syncs[p].state_dict() for p in sorted(syncs)}
    pending = pending_grads(local)
    if pending:
        state[LOCAL_GRADS] = pending
    return state


def load_saved_state(state: Mapping[str, Any], sync_of: Callable[[int], Optional[GradSync]],
                     local: LocalGrads,
                     owned: Sequence[Sequence[tuple[str, torch.Tensor]]]) -> None:
    """Restore :func:`saved_state`'s ``state``: each partition's sync (``sync_of(p)``, made on
    first use; None when the program syncs with a plain all-reduce) loads its state, and the
    ``no_sync`` gradients go back into ``local`` for the parameters ``owned`` names (per
    partition, ``(name, parameter)``). Raises ``ValueError`` naming the partition or parameter
    the state does not fit (a compressor state for a program with no compressor, a partition
    or a trainable parameter this program does not have)."""
    for p, sync_state in state.get(SYNCS, {}).items():
        sync = sync_of(int(p)) if 0 <= int(p) < len(owned) else None
        if sync is None:
            raise ValueError(
                f"round_robin: the runtime state holds a gradient compressor's state for "
                f"partition {p}, but this program has {len(owned)} partitions synced by a "
                f"plain all-reduce there: compile with the same partitions and compression "
                f"pass as the run that saved it, or leave the runtime state out")
        sync.load_state_dict(sync_state)
    params = {name: param for part in owned for name, param in part}
    pending = state.get(LOCAL_GRADS, {})
    unknown = [name for name in pending if name not in params]
    if unknown:
        raise ValueError(
            f"round_robin: the runtime state holds gradients accumulated inside no_sync() for "
            f"{unknown[:3]}, which no partition of this program trains (frozen, or another "
            f"model): load it into the model it was saved from, trained the same way")
    for name, grad in pending.items():
        local.add(name, params[name], grad)

"""A burst-parallel rank's owner-only training state in its checkpoints: which of it the rank
holds is ``tidal.ir.burst_ownership``; this is what is saved and restored.

On its distributed steps the rank removes every parameter it does not own (and its state) from
the optimizer's param groups (``tidal.runtime.programs.optimizer_wiring.remove_params``). A
rank's checkpoint (:func:`rank_state_dict`) holds its share: its tensors by name, the
optimizer, the compressors' state; :func:`load_rank_state` restores it on the same rank of a job
of the same world, naming what does not fit. What the program holds beside the model and the
optimizer (``Compiled.runtime_state_dict``, a DCP checkpoint's runtime state) is
:func:`runtime_state`: the compressors and the ``no_sync`` gradients, by parameter name.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    >>> opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    >>> state = rank_state_dict(1, 2, dict(model[1].named_parameters()), opt, {})
    >>> sorted(state["model"]), state["rank"], state["world"]
    (['bias', 'weight'], 1, 2)
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx as fx

from tidal.ir.burst_sync import ranks_label
from tidal.runtime.comm.grad_sync import GradSync
from tidal.runtime.programs.optimizer_wiring import LocalGrads

Ranks = tuple[int, ...]
GRAD_SYNC, LOCAL_GRADS = "grad_sync", "local_grads"
"""The sections of the saved state: each set's compressor, the ``no_sync`` gradients."""


def saved_tensors(gm: fx.GraphModule, owned: Mapping[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of ``gm``: the entries of its ``state_dict`` (every name of a
    shared tensor; no non-persistent buffer) whose tensor is one of ``owned``.

    >>> gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    >>> list(saved_tensors(gm, {"bias": gm.bias}))
    ['bias']
    """
    mine = {id(t) for t in owned.values()}
    return {n: t for n, t in gm.state_dict(keep_vars=True).items() if id(t) in mine}


def rank_state_dict(rank: int, world: int, saved: Mapping[str, torch.Tensor],
                    optimizer: Optional[torch.optim.Optimizer],
                    syncs: Mapping[Ranks, GradSync]) -> dict[str, Any]:
    """A rank's checkpoint: its ``rank`` and ``world``, copies of the tensors it saves
    (``model``: :func:`saved_tensors`), ``optimizer``'s state and each gradient sync's
    compressor state by its ranks (``grad_sync``). Saved with ``torch.save``, it loads with
    ``weights_only=True``; the ranks' ``model`` entries together are the model's
    ``state_dict`` (the module example)."""
    return {"rank": rank, "world": world,
            "model": {n: t.detach().clone() for n, t in saved.items()},
            "optimizer": None if optimizer is None else optimizer.state_dict(),
            GRAD_SYNC: {ranks_label(r): s.state_dict() for r, s in sorted(syncs.items())}}


def load_rank_state(state: Mapping[str, Any], rank: int, world: int,
                    saved: Mapping[str, torch.Tensor],
                    optimizer: Optional[torch.optim.Optimizer],
                    own_optimizer: Optional[Callable[[torch.optim.Optimizer], Any]],
                    sync_of: Callable[[Ranks], Optional[GradSync]]) -> None:
    """Restore what :func:`rank_state_dict` returned on rank ``rank`` of ``world``: the
    tensors ``saved`` in place, ``optimizer`` (made owner-only first by ``own_optimizer``,
    when given) and each compressor (``sync_of(ranks)``). Raises ``ValueError`` naming the
    checkpoint's rank, world or tensor that does not fit.

    >>> import torch
    >>> layer = torch.nn.Linear(2, 2)
    >>> state = rank_state_dict(0, 1, dict(layer.named_parameters()), None, {})
    >>> load_rank_state(state, 1, 2, dict(layer.named_parameters()), None, None, lambda r: None)
    Traceback (most recent call last):
    ...
    ValueError: burst_parallel: the checkpoint is rank 0 of 1, but this is rank 1 of 2
    """
    if (state.get("rank"), state.get("world")) != (rank, world):
        raise ValueError(f"burst_parallel: the checkpoint is rank {state.get('rank')} of "
                         f"{state.get('world')}, but this is rank {rank} of {world}")
    _copy_tensors(state["model"], saved, rank)
    if optimizer is not None and state.get("optimizer") is not None:
        if own_optimizer is not None:
            own_optimizer(optimizer)
        optimizer.load_state_dict(state["optimizer"])
    load_syncs(state.get(GRAD_SYNC, {}), sync_of)


def load_syncs(states: Mapping[str, Any], sync_of: Callable[[Ranks], Optional[GradSync]]
               ) -> None:
    """Load each set's compressor state (``states``, by ranks label, as
    :func:`rank_state_dict` and :func:`runtime_state` save them) into ``sync_of(ranks)``.
    Raises ``ValueError`` naming a set this program syncs without a compressor."""
    for label, s in states.items():
        sync = sync_of(tuple(int(r) for r in label.split(",")))
        if sync is None:
            raise ValueError(f"burst_parallel: the checkpoint holds compressor state for "
                             f"ranks {label}, but this program syncs without one: compile with "
                             f"the same plan and compression pass as the run that saved it")
        sync.load_state_dict(s)


def runtime_state(syncs: Mapping[Ranks, GradSync], local: LocalGrads) -> dict[str, Any]:
    """What a rank program holds beside the model and the optimizer that changes the next
    steps (``Compiled.runtime_state_dict``): each set's compressor state by its ranks
    (``grad_sync``; error feedback, warm starts, keyed by parameter name inside) and the
    gradients the open step accumulated inside ``no_sync``, not yet synced, by parameter
    name (``local_grads``); copies, each section only when it holds something.

    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> local = LocalGrads()
    >>> local.add("w", w, torch.ones(2))
    >>> runtime_state({}, local)
    {'local_grads': {'w': tensor([1., 1.])}}
    >>> len(local)                     # kept
    1
    """
    state: dict[str, Any] = {}
    if syncs:
        state[GRAD_SYNC] = {ranks_label(r): s.state_dict() for r, s in sorted(syncs.items())}
    held = local.drain()
    for name, param, grad in held:
        local.add(name, param, grad)
    if held:
        state[LOCAL_GRADS] = {name: grad.detach().clone() for name, _, grad in held}
    return state


def load_runtime_state(state: Mapping[str, Any],
                       sync_of: Callable[[Ranks], Optional[GradSync]], local: LocalGrads,
                       params: Mapping[str, torch.Tensor]) -> None:
    """Restore :func:`runtime_state`'s ``state``: the compressors (:func:`load_syncs`) and the
    ``no_sync`` gradients into ``local`` for the trainable parameters ``params`` (by name, the
    ones this rank owns). Raises ``ValueError`` naming a gradient for a parameter this rank
    does not own or train.

    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> local = LocalGrads()
    >>> load_runtime_state({"local_grads": {"w": torch.ones(2)}}, lambda r: None, local,
    ...                    {"w": w})
    >>> local.plus(w, torch.ones(2)).tolist()
    [2.0, 2.0]
    """
    load_syncs(state.get(GRAD_SYNC, {}), sync_of)
    pending = state.get(LOCAL_GRADS, {})
    unknown = [n for n in pending if n not in params]
    if unknown:
        raise ValueError(f"burst_parallel: the runtime state holds gradients accumulated "
                         f"inside no_sync() for {unknown[:3]}, which this rank does not own "
                         f"or train: load it on the rank, plan and model it was saved from")
    for name, grad in pending.items():
        local.add(name, params[name], grad)


def _copy_tensors(given: Mapping[str, torch.Tensor], mine: Mapping[str, torch.Tensor],
                  rank: int) -> None:
    """Copy the checkpoint's tensors into the rank's, after checking their names and shapes."""
    if set(given) != set(mine):
        odd = sorted(set(given) ^ set(mine))
        raise ValueError(f"burst_parallel: checkpoint of rank {rank}: tensor {odd[0]!r} is "
                         f"{'not owned by' if odd[0] in given else 'missing for'} this rank")
    with torch.no_grad():
        for n, t in mine.items():
            if given[n].shape != t.shape:
                raise ValueError(f"burst_parallel: checkpoint tensor {n!r} has shape "
                                 f"{tuple(given[n].shape)}, the model {tuple(t.shape)}")
            t.copy_(given[n])

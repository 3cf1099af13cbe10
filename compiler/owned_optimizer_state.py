"""Optimizer state under a plan whose ranks own parameters (``burst_parallel``: each rank's
optimizer holds only what it owns, its param groups kept even when left empty), as a DCP
checkpoint holds it (``tidal.compiler.checkpoint``).

DCP keeps ONE rank's copy of a key several ranks save, and a group's ``params`` (names)
differ between ranks here: a rank that owns nothing saved ``[]``, and a checkpoint that kept
that copy restored groups with no hyperparameters. So every rank saves each group with the
names of every rank's parameters in it (:func:`every_ranks_groups`, a collective), and a rank
loads its own parameters' state and its groups' hyperparameters itself
(:func:`load_owned_state`: DCP's loader refuses an optimizer whose group is empty).

Example (one process: the loaded state goes back as it was):
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> saved = {"state": {"weight": opt.state_dict()["state"][0]},
    ...          "param_groups": [{**opt.param_groups[0], "params": ["weight", "bias"]}]}
    >>> load_owned_state(opt, model, saved)
    >>> sorted(opt.state_dict()["state"]), opt.param_groups[0]["momentum"]
    ([0], 0.9)
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

PARAMS, STATE, GROUPS = "params", "state", "param_groups"


def every_ranks_groups(optim_state: dict[str, Any], model: torch.nn.Module) -> None:
    """Set each group's ``params`` of ``optim_state`` (DCP's, keyed by name) to the names of
    every rank's parameters in that group, in the model's order, in place (a collective:
    every rank calls it; groups are matched by index, the same on every rank)."""
    groups = optim_state.get(GROUPS, [])
    mine = [list(g.get(PARAMS, [])) for g in groups]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    for index, group in enumerate(groups):
        names = {n for rank_groups in every for n in rank_groups[index]}
        group[PARAMS] = sorted(names, key=lambda n: order.get(n, len(order)))


def load_owned_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                     loaded: dict[str, Any]) -> None:
    """Load into ``optimizer`` (holding this rank's own parameters) the state of its
    parameters and the hyperparameters of its groups from ``loaded`` (DCP's, keyed by name,
    groups matched by index); a parameter without saved state starts fresh."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = loaded.get(GROUPS, [])
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"tidal.checkpoint.set_state_dict: the checkpoint's optimizer has "
                         f"{len(groups)} param groups, this one {len(optimizer.param_groups)}")
    state, out_groups, index = {}, [], 0
    for group, saved in zip(optimizer.param_groups, groups):
        ids = []
        for p in group[PARAMS]:
            name = names.get(id(p))
            if name in loaded.get(STATE, {}):
                state[index] = loaded[STATE][name]
            ids.append(index)
            index += 1
        out_groups.append({**{k: v for k, v in saved.items() if k != PARAMS}, PARAMS: ids})
    optimizer.load_state_dict({STATE: state, GROUPS: out_groups})

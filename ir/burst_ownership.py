"""Burst parallelism's owner-only state: which rank holds which parameter and buffer, and how
many bytes of training state that leaves each rank beside data parallelism.

A parameter or buffer belongs to the ranks of the one layer that uses it (:func:`param_ranks`),
or to every rank when nodes on several GPU sets, or nodes computed on every rank, use it. A rank
holds, updates and checkpoints only what it owns (:func:`owned_tensors`); the trainable
parameters it does not own (:func:`foreign_params`) get no gradient there and leave its
optimizer. :func:`state_bytes` counts what a rank holds against data parallelism, where every
rank holds everything (:func:`state_table` for the ranks' rows).

Example:
    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)))
    >>> owners = param_ranks(gm, 2, {"_0": "a", "_1": "b"}, {"a": (0,), "b": (0, 1)})
    >>> foreign_params(gm, owners, world=2, rank=1)
    ['0.weight', '0.bias']
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
import torch.fx as fx

from tidal.ir.node_runner import fetch_attr
from tidal.ir.param_owners import trainable, unowned
from tidal.ir.table import format_table

Ranks = tuple[int, ...]


def param_ranks(gm: fx.GraphModule, world: int, unit_of: Mapping[str, str],
                ranks_of: Mapping[str, Ranks]) -> dict[str, Ranks]:
    """Per parameter and buffer name (every name of a shared one), the ranks of the one layer
    whose nodes use it (``unit_of``: node name -> layer; ``ranks_of``: layer -> ranks), or
    every rank when nodes on several GPU sets, or nodes computed on every rank (a position
    embedding of replicated ids), use it.

    >>> import torch
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    >>> param_ranks(gm, 2, {"_0": "fc"}, {"fc": (1,)})
    {'0.weight': (1,), '0.bias': (1,)}
    """
    everyone = tuple(range(world))
    by_id: dict[int, Ranks] = {}

    def use(tensor: Any, ranks: Ranks) -> None:
        by_id[id(tensor)] = ranks if by_id.get(id(tensor), ranks) == ranks else everyone

    for node in gm.graph.nodes:
        if node.op == "call_module":
            ranks = ranks_of[unit_of[node.name]] if node.name in unit_of else everyone
            sub = gm.get_submodule(node.target)
            for t in list(sub.parameters()) + list(sub.buffers()):
                use(t, ranks)
        elif node.op == "get_attr":
            users = {unit_of.get(u.name) for u in node.users}
            one = next(iter(users)) if len(users) == 1 else None
            t = fetch_attr(gm, str(node.target))
            if isinstance(t, torch.Tensor):
                use(t, ranks_of[one] if one is not None else everyone)
    named = list(gm.named_parameters(remove_duplicate=False)) + \
        list(gm.named_buffers(remove_duplicate=False))
    return {name: by_id.get(id(t), everyone) for name, t in named}


def owned_tensors(gm: fx.GraphModule, owners: Mapping[str, Ranks], world: int,
                  rank: Optional[int]) -> dict[str, torch.Tensor]:
    """The parameters and buffers of ``gm`` that ``rank`` holds (``owners``: name -> ranks, as
    :func:`param_ranks` gives; every rank of ``world`` when missing), by name (a shared tensor
    under its first name); all of them when ``rank`` is None (one process).

    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    >>> sorted(owned_tensors(gm, {"0.weight": (0,)}, world=2, rank=1))
    ['0.bias']
    """
    everyone = tuple(range(world))
    named = list(gm.named_parameters()) + list(gm.named_buffers())
    return {n: t for n, t in named if rank is None or rank in owners.get(n, everyone)}


def foreign_params(gm: fx.GraphModule, owners: Mapping[str, Ranks], world: int,
                   rank: Optional[int]) -> list[str]:
    """The trainable parameters of ``gm`` that ``rank`` does not own, by name
    (``tidal.ir.param_owners.unowned`` of what :func:`owned_tensors` gives it): it neither
    receives their gradients nor updates them (the module example)."""
    return unowned(gm, {id(t) for t in owned_tensors(gm, owners, world, rank).values()})


def buffer_sets(gm: fx.GraphModule, owners: Mapping[str, Ranks], world: int
                ) -> dict[Ranks, list[str]]:
    """Buffer names of ``gm`` by the ranks of the layer that updates them (every rank of
    ``world`` when ``owners`` does not name it), sorted by ranks.

    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.BatchNorm1d(2)))
    >>> buffer_sets(gm, {"0.running_mean": (0,)}, world=2)
    {(0,): ['0.running_mean'], (0, 1): ['0.running_var', '0.num_batches_tracked']}
    """
    everyone = tuple(range(world))
    sets: dict[Ranks, list[str]] = {}
    for name, _ in gm.named_buffers():
        sets.setdefault(owners.get(name, everyone), []).append(name)
    return dict(sorted(sets.items()))


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of ``tensors`` together.

    >>> nbytes([torch.ones(3), torch.ones(2, dtype=torch.float64)])
    28
    """
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class StateBytes:
    """The training state one rank holds (bytes) under owner-only burst state, beside data
    parallelism, where every rank holds all of it: ``params`` (parameters and buffers),
    ``grads`` (one gradient per trainable parameter) and ``optimizer`` (its state tensors, as
    measured; zero before the first step). ``dp_optimizer`` is estimated: the rank's optimizer
    bytes per byte of the parameters they belong to, times every trainable parameter's
    bytes."""

    rank: int
    params: int
    grads: int
    optimizer: int
    dp_params: int
    dp_grads: int
    dp_optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def dp_total(self) -> int:
        return self.dp_params + self.dp_grads + self.dp_optimizer


def state_bytes(gm: fx.GraphModule, owners: Mapping[str, Ranks], world: int,
                rank: Optional[int], optimizer: Optional[torch.optim.Optimizer] = None
                ) -> StateBytes:
    """The bytes of training state ``rank`` holds (None: one process, everything), beside data
    parallelism (:class:`StateBytes`); ``optimizer``'s state as it is now.

    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    >>> state_bytes(gm, {"0.weight": (0,)}, world=2, rank=1)  # doctest: +NORMALIZE_WHITESPACE
    StateBytes(rank=1, params=8, grads=8, optimizer=0, dp_params=32, dp_grads=32,
               dp_optimizer=0)
    """
    everything = {id(t): t for t in list(gm.parameters()) + list(gm.buffers())}
    mine = {id(t): t for t in owned_tensors(gm, owners, world, rank).values()}
    learned = {id(p): p for p in trainable(gm).values()}
    held = [p for i, p in learned.items() if i in mine]
    state = optimizer.state if optimizer is not None else {}
    with_state = [p for p in held if state.get(p)]
    opt = sum(nbytes(t for t in state[p].values() if isinstance(t, torch.Tensor))
              for p in with_state)
    per_byte = opt / nbytes(with_state) if with_state else 0.0
    return StateBytes(
        rank=rank or 0, params=nbytes(mine.values()), grads=nbytes(held),
        optimizer=opt, dp_params=nbytes(everything.values()),
        dp_grads=nbytes(learned.values()),
        dp_optimizer=round(opt + per_byte * (nbytes(learned.values()) - nbytes(held))))


def state_table(rows: Sequence[StateBytes]) -> str:
    """The ranks' :class:`StateBytes` as a table (KiB, rounded), with each rank's share of
    data parallelism's bytes.

    >>> print(state_table([StateBytes(0, 4096, 2048, 4096, 8192, 4096, 8192)]))
    rank  params KiB  grads KiB  optimizer KiB  total KiB  data parallel KiB  share
    ----  ----------  ---------  -------------  ---------  -----------------  -----
       0           4          2              4         10                 20  0.500
    """
    def kib(n: int) -> int:
        return round(n / 1024)

    return format_table(
        ["rank", "params KiB", "grads KiB", "optimizer KiB", "total KiB", "data parallel KiB",
         "share"],
        [[r.rank, kib(r.params), kib(r.grads), kib(r.optimizer), kib(r.total), kib(r.dp_total),
          f"{r.total / r.dp_total if r.dp_total else 1.0:.3f}"] for r in rows])


def state_note(b: StateBytes) -> str:
    """One line on the training state a rank holds against data parallelism (what
    ``Compiled.report()`` shows after a distributed step).

    >>> state_note(StateBytes(1, 2**20, 2**20, 0, 2**21, 2**21, 0)).split(", ")[-1]
    "50% of data parallelism's 4.00 MiB"
    """
    share = b.total / b.dp_total if b.dp_total else 1.0
    return (f"burst_parallel: rank {b.rank} holds {b.total / 2**20:.2f} MiB of training "
            f"state (parameters {b.params / 2**20:.2f}, gradients {b.grads / 2**20:.2f}, "
            f"optimizer {b.optimizer / 2**20:.2f}), {share:.0%} of data parallelism's "
            f"{b.dp_total / 2**20:.2f} MiB")

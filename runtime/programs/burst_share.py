"""A burst-parallel rank's share of the model: what it holds, updates and counts (the rule, by
name: ``tidal.ir.burst_ownership``; its checkpoint: ``tidal.runtime.programs.burst_state``).

A parameter or buffer belongs to the ranks of the one layer that uses it, or to every rank. A
rank holds, updates and checkpoints only what it owns: on its distributed steps the program
removes every other parameter (and its state) from the optimizer (:meth:`RankShare.own_optimizer`,
``tidal.runtime.programs.optimizer_wiring.remove_params``), the rank never receives the
gradients of the others (their ``.grad`` stays ``None``), and buffers a layer updates in training
(BatchNorm's running statistics) are averaged over the layer's ranks only
(:meth:`RankShare.buffer_sets`). :meth:`RankShare.state_bytes` counts what the rank holds
against data parallelism (``tidal.ir.burst_ownership.state_table`` for the ranks' rows); in a
global gradient norm each parameter counts once, on its layer's first rank
(:meth:`RankShare.counted`).

Example:
    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2),
    ...                                            torch.nn.Linear(2, 2)))
    >>> share = RankShare(2, {"0.weight": (0,), "0.bias": (0,), "1.weight": (0, 1),
    ...                       "1.bias": (0, 1)})
    >>> share.foreign(gm, rank=1), sorted(share.owned(gm, rank=0))
    (['0.weight', '0.bias'], ['0.bias', '0.weight', '1.bias', '1.weight'])
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from tidal.ir.burst_ownership import (StateBytes, buffer_sets, foreign_params, owned_tensors,
                                      state_bytes)
from tidal.runtime.distributed import is_distributed
from tidal.runtime.programs.optimizer_wiring import remove_params

Ranks = tuple[int, ...]


class RankShare:
    """The share of the model each of ``world`` ranks owns: per parameter (and buffer) name
    of the graph module, the ranks of the layer that owns it (``param_ranks``; a name not in
    it is every rank's). A ``rank`` left out is this process's rank (in one process, which
    holds everything: every rank's)."""

    def __init__(self, world: int, param_ranks: Mapping[str, Ranks]):
        self.world = world
        self.param_ranks = dict(param_ranks)

    def this_rank(self, rank: Optional[int]) -> Optional[int]:
        """``rank``, else this process's rank when distributed (None: one process, which
        holds everything).

        >>> RankShare(2, {}).this_rank(1), RankShare(2, {}).this_rank(None)  # one process
        (1, None)
        """
        if rank is None and is_distributed():
            return dist.get_rank()
        return rank

    def owned(self, gm: fx.GraphModule, rank: Optional[int] = None) -> dict[str, torch.Tensor]:
        """The parameters and buffers of ``gm`` that ``rank`` (default: this rank; in one
        process, all of them) holds, by name (a shared tensor under its first name)."""
        return owned_tensors(gm, self.param_ranks, self.world, self.this_rank(rank))

    def foreign(self, gm: fx.GraphModule, rank: Optional[int] = None) -> list[str]:
        """The trainable parameters of ``gm`` that ``rank`` (default: this rank) does not own,
        by name: it neither receives their gradients nor updates them."""
        return foreign_params(gm, self.param_ranks, self.world, self.this_rank(rank))

    def own_optimizer(self, optimizer: torch.optim.Optimizer, gm: fx.GraphModule,
                      rank: Optional[int] = None) -> list[str]:
        """Remove from ``optimizer`` (in place: its param groups' lists and its state) every
        parameter of ``gm`` that ``rank`` (default: this rank) does not own; returns their
        names. A group left empty stays (a scheduler indexes groups); parameters the graph
        does not use stay. Idempotent: the program calls it on every distributed step.

        >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2),
        ...                                            torch.nn.Linear(2, 2)))
        >>> share = RankShare(2, (("0.weight", (0,)), ("0.bias", (0,)),
        ...                       ("1.weight", (0, 1)), ("1.bias", (0, 1))))
        >>> opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        >>> share.own_optimizer(opt, gm, rank=1), [len(g["params"]) for g in opt.param_groups]
        (['0.weight', '0.bias'], [2])
        >>> sorted(share.owned(gm, rank=1))
        ['1.bias', '1.weight']
        >>> share.state_bytes(gm, opt, rank=1)  # doctest: +NORMALIZE_WHITESPACE
        StateBytes(rank=1, params=24, grads=24, optimizer=0, dp_params=56, dp_grads=56,
                   dp_optimizer=0)
        """
        names = self.foreign(gm, rank)
        remove_params(optimizer, gm, names)
        return names

    def state_bytes(self, gm: fx.GraphModule, optimizer: Optional[torch.optim.Optimizer] = None,
                    rank: Optional[int] = None) -> StateBytes:
        """The bytes of training state ``rank`` (default: this rank) holds, beside data
        parallelism (:class:`~tidal.ir.burst_ownership.StateBytes`)."""
        return state_bytes(gm, self.param_ranks, self.world, self.this_rank(rank), optimizer)

    def buffer_sets(self, gm: fx.GraphModule, size: int) -> dict[Ranks, list[str]]:
        """Buffer names of ``gm`` by the ranks of the layer that updates them (sorted)."""
        return buffer_sets(gm, self.param_ranks, size)

    def counted(self, gm: fx.GraphModule, held: Sequence[torch.nn.Parameter],
                rank: int) -> list[torch.Tensor]:
        """The gradients of ``held`` that ``rank`` counts in a norm over every rank: each
        parameter of ``gm`` once, on its layer's first rank (one not in ``gm``: on rank 0).

        >>> gm = fx.symbolic_trace(torch.nn.Linear(2, 1))
        >>> for p in gm.parameters():
        ...     p.grad = torch.ones_like(p)
        >>> share = RankShare(2, {"weight": (1,), "bias": (0, 1)})
        >>> [tuple(g.shape) for g in share.counted(gm, list(gm.parameters()), rank=1)]
        [(1, 2)]
        """
        everyone = tuple(range(self.world))
        first = {id(t): min(self.param_ranks.get(n, everyone))
                 for n, t in gm.named_parameters()}
        return [p.grad for p in held if first.get(id(p), 0) == rank]

"""Burst parallelism's gradient buckets: which of a graph's gradients sync together, on which
ranks, and where backward has finalised them.

A layer of a burst-parallel graph runs on a set of ranks; its parameters' gradients are summed
over those ranks (a rank alone syncs nothing). In backward order the gradients of consecutive
layers on the same set go into buckets closed at ``bucket_bytes`` by the one gradient-bucket
rule (``tidal.ir.comm_cost.gradient_buckets``), the rule the planner's time model and the
simulator cut their buckets by too. The runtime's burst program (``tidal.runtime.programs.burst``)
issues each bucket's all-reduce as soon as backward has run back to its :attr:`Bucket.ready`
node.

Example:
    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    >>> [b.piece for b in sync_buckets(gm, {}, world=2)]   # every rank syncs every gradient
    ['all_reduce 0,1 0.bias..0.weight']
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.fx as fx

from tidal.ir.collectives import GATHER, SCATTER
from tidal.ir.comm_cost import DDP_BUCKET_BYTES, gradient_buckets
from tidal.ir.node_runner import fetch_attr
from tidal.ir.param_owners import trainable

Ranks = tuple[int, ...]

TRANSFERS = (SCATTER, GATHER)
"""The ops that move rows between GPU sets (``tidal::scatter``/``gather``): the pass puts one
wherever the GPU set changes."""


def ranks_label(ranks: Ranks) -> str:
    """How a set of ranks is written in piece names and checkpoints.

    >>> ranks_label((0, 2))
    '0,2'
    """
    return ",".join(map(str, ranks))


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: the ``ranks`` that sum it, its parameter ``names`` in backward
    order, and ``ready``, the position (in the graph module's node order) of the first node
    that reads one of them: the bucket's gradients are final once backward has run back to
    that node.

    >>> Bucket((0, 1), ("fc.bias", "fc.weight"), 3).piece
    'all_reduce 0,1 fc.bias..fc.weight'
    """

    ranks: Ranks
    names: tuple[str, ...]
    ready: int

    @property
    def piece(self) -> str:
        """The name of the bucket's comm piece (the same on each of its ranks)."""
        last = f"..{self.names[-1]}" if len(self.names) > 1 else ""
        return f"all_reduce {ranks_label(self.ranks)} {self.names[0]}{last}"


def is_transfer(node: fx.Node) -> bool:
    """Whether ``node`` is a ``tidal::scatter``/``gather`` (:data:`TRANSFERS`)."""
    return node.op == "call_function" and node.target in TRANSFERS


def transfer_positions(gm: fx.GraphModule) -> list[int]:
    """The positions (in node order) of ``gm``'s ``tidal::scatter``/``gather`` nodes.

    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    >>> transfer_positions(gm)
    []
    """
    return [i for i, n in enumerate(gm.graph.nodes) if is_transfer(n)]


def first_use(gm: fx.GraphModule) -> dict[int, int]:
    """``id(tensor)`` -> the position of the first node of ``gm`` that computes with it, for
    every parameter and buffer: a ``call_module`` of a module holding it, or the first node
    that reads a ``get_attr`` of it (where its gradient comes from).

    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    >>> first_use(gm)[id(gm.get_submodule("0").weight)]      # node 0 is the input
    1
    """
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    used: dict[int, int] = {}
    for node, i in position.items():
        tensors: list[Any] = []
        if node.op == "call_module":
            sub = gm.get_submodule(node.target)
            tensors = list(sub.parameters()) + list(sub.buffers())
        elif node.op == "get_attr":
            tensors = [fetch_attr(gm, str(node.target))]
            i = min((position[u] for u in node.users), default=i)
        for t in tensors:
            if isinstance(t, torch.Tensor):
                used[id(t)] = min(used.get(id(t), i), i)
    return used


def sync_buckets(gm: fx.GraphModule, param_ranks: Mapping[str, Ranks], world: int,
                 bucket_bytes: float = DDP_BUCKET_BYTES) -> tuple[Bucket, ...]:
    """The gradient buckets of ``gm``'s trainable parameters, in the order every rank issues
    them. The parameters (``param_ranks``: name -> the ranks that sync it; every rank when
    missing) are taken in backward order (latest first use first; within a node, the reverse
    of their registration order, as DDP), each keyed by its ranks and its GPU-set segment (how
    many ``tidal::scatter``/``gather`` nodes come before its first use); a parameter on one
    rank is not synced, but its layer still ends the run before it.
    ``tidal.ir.comm_cost.gradient_buckets`` cuts them: runs of equal keys (consecutive layers
    on the same ranks), each cut into buckets closed once they hold ``bucket_bytes`` or more
    (as DDP closes them). A bucket is ready where its earliest parameter
    is first read (an unused parameter: at the start), and the buckets are ordered by
    readiness, latest first.

    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)))
    >>> both = dict.fromkeys(["0.weight", "0.bias", "1.weight", "1.bias"], (0, 1))
    >>> [(b.names, b.ready) for b in sync_buckets(gm, both, 2)]
    [(('1.bias', '1.weight', '0.bias', '0.weight'), 1)]
    >>> [b.piece for b in sync_buckets(gm, both, 2, bucket_bytes=32)]
    ['all_reduce 0,1 1.bias..0.bias', 'all_reduce 0,1 0.weight']
    >>> [b.piece for b in sync_buckets(gm, {**both, "1.weight": (1,), "1.bias": (1,)}, 2)]
    ['all_reduce 0,1 0.bias..0.weight']
    >>> layers = [torch.nn.Linear(2, 2) for _ in range(3)]
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(*layers))
    >>> owners = {f"{i}.{k}": (1,) if i == 1 else (0, 1)
    ...           for i in range(3) for k in ("weight", "bias")}
    >>> [b.piece for b in sync_buckets(gm, owners, 2)]   # a layer on one rank ends the run
    ['all_reduce 0,1 2.bias..2.weight', 'all_reduce 0,1 0.bias..0.weight']
    """
    everyone = tuple(range(world))
    used = first_use(gm)
    moves = transfer_positions(gm)
    order = [(used.get(id(p), 0), i, name, p)
             for i, (name, p) in enumerate(trainable(gm).items())]
    items = []
    for ready, _, name, p in sorted(order, key=lambda o: (-o[0], -o[1])):
        ranks = tuple(param_ranks.get(name, everyone))
        segment = bisect.bisect_left(moves, ready)  # the GPU-set segment of its first use
        nbytes = p.numel() * p.element_size() if len(ranks) > 1 else 0
        items.append(((ranks, segment), (ready, name), nbytes))
    buckets = [Bucket(ranks, tuple(name for _, name in part), min(r for r, _ in part))
               for (ranks, _), part in gradient_buckets(items, bucket_bytes)]
    return tuple(sorted(buckets, key=lambda b: -b.ready))

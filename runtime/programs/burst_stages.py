"""Where a burst-parallel rank's step is cut into pieces: its forward between the
scatter/gather transfers (:func:`forward_parts`), and its backward in stages, each ending
where a gradient bucket is final (:func:`stages`).

Backward is cut right before the first node that uses one of a bucket's parameters, so the
bucket's all-reduce can start as soon as that stage has run, beside the rest of backward; and
around each transfer, so the backward of a transfer is a stage of its own (it waits for the
other ranks without occupying the device).

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir.burst_sync import sync_buckets
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(),
    ...                                            torch.nn.Linear(2, 2)))
    >>> both = dict.fromkeys(["0.weight", "0.bias", "2.weight", "2.bias"], (0, 1))
    >>> stages(gm, gm, sync_buckets(gm, both, 2)).cuts     # one bucket: ready at the first layer
    ()
    >>> forward_parts(gm)
    [('forward', 'compute', 0, 5)]
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch.fx as fx

from tidal.ir.burst_sync import Bucket, transfer_positions
from tidal.ir.collectives import SCATTER
from tidal.ir.program import COMPUTE, TRANSFER


@dataclass(frozen=True)
class Stages:
    """How one rank's backward is cut: ``cuts``, the names of the nodes of the rank's graph
    before which the forward is cut (segment 0 runs up to ``cuts[0]``, segment k starts at
    ``cuts[k - 1]``), and per bucket the rank syncs, the segment whose backward stage
    finalises it (``buckets``, in issue order)."""

    cuts: tuple[str, ...]
    buckets: tuple[tuple[Bucket, int], ...]


def stages(gm: fx.GraphModule, run: fx.GraphModule, buckets: Sequence[Bucket],
           overlap: bool = True) -> Stages:
    """Where a rank cuts its backward for ``buckets`` (those it syncs, in
    ``tidal.ir.burst_sync.sync_buckets``' order): the forward of ``run`` (the rank's graph:
    ``gm`` specialised, ``tidal.runtime.programs.burst_graph.specialise``) is cut before the
    first of its nodes at or after each bucket's ready position in ``gm``, and before and after
    each ``tidal::scatter``/``gather`` node (so the backward of a transfer is a stage of its
    own, which waits for the other ranks without occupying the device), unless only inputs
    come before. Every node on the rank that reads one of the bucket's parameters is at or
    after that position, so the bucket is final once the backward of that segment has run.
    ``overlap=False`` syncs every bucket after the last stage.

    >>> import torch
    >>> from tidal.ir.burst_sync import sync_buckets
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(),
    ...                                            torch.nn.Linear(2, 2)))
    >>> both = dict.fromkeys(["0.weight", "0.bias", "2.weight", "2.bias"], (0, 1))
    >>> cut = stages(gm, gm, sync_buckets(gm, both, 2, bucket_bytes=8))
    >>> cut.cuts, [(b.names, k) for b, k in cut.buckets]  # doctest: +NORMALIZE_WHITESPACE
    (('_2',), [(('2.bias',), 1), (('2.weight',), 1), (('0.bias',), 0), (('0.weight',), 0)])
    """
    nodes = list(run.graph.nodes)
    start = next((i for i, n in enumerate(nodes) if n.op != "placeholder"), len(nodes))
    moves = transfer_positions(run)
    at: dict[Bucket, int] = {}
    if overlap:
        position = {n.name: i for i, n in enumerate(gm.graph.nodes)}
        kept = [(position[n.name], i) for i, n in enumerate(nodes) if n.name in position]
        for b in buckets:
            k = bisect.bisect_left(kept, (b.ready, -1))
            index = kept[k][1] if k < len(kept) else len(nodes) - 1
            if index > start:
                at[b] = index
    cuts = sorted({i for i in list(at.values()) + moves + [m + 1 for m in moves]
                   if start < i < len(nodes)})
    return Stages(tuple(nodes[i].name for i in cuts),
                  tuple((b, bisect.bisect_right(cuts, at[b]) if b in at else 0)
                        for b in buckets))


def transfer_name(node: fx.Node) -> str:
    """The piece name of a transfer node's forward (``"gather _5"``), the same on every rank:
    the transfers are in every rank's graph, in the same order.

    >>> from tidal.ir.collectives import GATHER
    >>> graph = fx.Graph()
    >>> transfer_name(graph.call_function(GATHER, (graph.placeholder("x"),)))
    'gather gather_default'
    """
    return f"{'scatter' if node.target is SCATTER else 'gather'} {node.name}"


def forward_parts(run: fx.GraphModule) -> list[tuple[str, str, int, int]]:
    """``run``'s forward as consecutive pieces ``(name, stream, lo, hi)`` over its node
    positions ``[lo, hi)``: each ``tidal::scatter``/``gather`` node alone on the
    :data:`TRANSFER` stream (:func:`transfer_name`), the nodes between them on the compute
    stream (``"forward"``, or ``"forward k"`` when there are several), none empty.

    >>> import torch
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    >>> forward_parts(gm)
    [('forward', 'compute', 0, 3)]
    """
    nodes = list(run.graph.nodes)
    moves = transfer_positions(run)
    bounds = sorted({0, len(nodes)} | set(moves) | {m + 1 for m in moves})
    spans = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    compute = [s for s in spans if s[0] not in moves]
    parts = []
    for lo, hi in spans:
        if lo in moves:
            parts.append((transfer_name(nodes[lo]), TRANSFER, lo, hi))
        else:
            name = "forward" if len(compute) == 1 else f"forward {compute.index((lo, hi))}"
            parts.append((name, COMPUTE, lo, hi))
    return parts



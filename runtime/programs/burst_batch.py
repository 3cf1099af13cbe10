"""A burst-parallel step on another global batch than the plan's (a last, smaller batch of an
epoch): the plan's structure, each layer on the same ranks, with the new batch's samples split
among each layer's ranks as ``torch.tensor_split`` splits them (``tidal.ir.burst_rows``).

The pass records on every ``tidal::scatter``/``gather`` and ``rows_like`` stand-in it inserts
what it moves as parts of the batch (``tidal.ir.burst_rows.TransferRows``); :func:`batch_graph`
is a copy of the graph whose nodes move the rows of another batch. A rank whose part of a
layer is empty (fewer samples than the layer's ranks) skips the layer for that batch, as a rank
outside its set does (:func:`layer_ranks_at`; it still syncs the layer's gradients, zeros), so
no layer runs on zero rows — unless the layer updates floating-point buffers in training
(BatchNorm's running statistics: averaged over the layer's ranks, a skipping rank's would
count), which :func:`layer_ranks_at` refuses, naming the layer. Every rank computes the same
global loss on the gathered output, so each rank's gradient is already its rows' share of the
new batch's mean-loss gradient: nothing else changes.

Example:
    >>> import torch
    >>> from tidal.ir.burst_rows import ALL, TransferRows
    >>> from tidal.ir.collectives import SCATTER, layout
    >>> graph = fx.Graph()
    >>> x = graph.placeholder("x")
    >>> move = graph.call_function(SCATTER, (x, [0, 8, 0, 8], [0, 4, 4, 8]))
    >>> meta.set_pass_meta(move, "burst_parallel", TransferRows((ALL, ALL), ((0, 2), (1, 2))))
    >>> _ = graph.output(move)
    >>> gm = fx.GraphModule(torch.nn.Module(), graph)
    >>> [n.args[1:] for n in batch_graph(gm, 7).graph.nodes if n.op == "call_function"]
    [([0, 7, 0, 7], [0, 4, 4, 7])]
"""
from __future__ import annotations

from typing import Mapping

import torch.fx as fx

from tidal.ir import meta
from tidal.ir.burst_rows import TransferRows, placement_shares, share_rows
from tidal.ir.burst_sync import is_transfer
from tidal.ir.collectives import rows_like
from tidal.runtime.batch_data import BatchError
from tidal.runtime.programs.burst_layout import PASS_NAME

Ranks = tuple[int, ...]


def batch_graph(gm: fx.GraphModule, batch: int) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its modules and parameters) whose transfers and stand-ins
    move the rows of a global batch of ``batch`` samples. Raises ``BatchError`` naming a
    transfer that does not say what it moves for another batch (a graph rewritten before
    ``burst_parallel`` recorded it)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    for old, new in env.items():
        if not (is_transfer(old) or old.target is rows_like):
            continue
        rows = meta.get_pass_meta(old, PASS_NAME)
        if not isinstance(rows, TransferRows):
            raise BatchError(f"burst_parallel: transfer {old.name!r} does not record what it "
                             f"moves for another batch than the plan's: compile again (or "
                             f"drop the last, smaller batch: DataLoader(drop_last=True))")
        new.args = (new.args[0],) + rows.layouts(batch)
    return fx.GraphModule(gm, graph)


def layer_ranks_at(gm: fx.GraphModule, layer_ranks: Mapping[str, Ranks], world: int,
                   batch: int) -> dict[str, Ranks]:
    """Per layer, the ranks of ``layer_ranks`` whose part of a global batch of ``batch``
    samples holds rows (the placements ``burst_parallel`` recorded on ``gm``'s nodes: each
    rank keeps the plan's part). Raises ``BatchError`` naming a layer that would leave one of
    its ranks no rows while it updates floating-point buffers in training.

    >>> import torch
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    >>> layer = next(n for n in gm.graph.nodes if n.op == "call_module")
    >>> meta.set_pass_meta(layer, "burst_parallel",
    ...                    meta.BurstPlacement("_0", 2, (0, 1), ((0, 4), (4, 8))))
    >>> layer_ranks_at(gm, {"_0": (0, 1)}, 2, 7), layer_ranks_at(gm, {"_0": (0, 1)}, 2, 1)
    ({'_0': (0, 1)}, {'_0': (0,)})
    """
    out = dict(layer_ranks)
    for unit, placed in _placements(gm).items():
        shares = placement_shares(placed.ranks, placed.ranges, world)
        empty = [r for r in placed.ranks if _is_empty(share_rows(shares[r], batch))]
        if not empty:
            continue
        stateful = _buffers_in_training(gm, unit)
        if stateful:
            raise BatchError(f"burst_parallel: a global batch of {batch} rows leaves rank "
                             f"{empty[0]} no rows of layer {unit!r} (on ranks "
                             f"{list(placed.ranks)}), which updates buffer {stateful!r} in "
                             f"training (averaged over its ranks): pass at least "
                             f"{len(placed.ranks)} rows, or drop the last, smaller batch "
                             f"(DataLoader(drop_last=True))")
        out[unit] = tuple(r for r in layer_ranks.get(unit, placed.ranks) if r not in empty)
    return out


def _is_empty(rows: tuple[int, int]) -> bool:
    return rows[0] >= rows[1]


def _placements(gm: fx.GraphModule) -> dict[str, meta.BurstPlacement]:
    """Each layer's placement, by layer name (from its nodes' marks)."""
    out: dict[str, meta.BurstPlacement] = {}
    for n in gm.graph.nodes:
        placed = meta.get_pass_meta(n, PASS_NAME)
        if isinstance(placed, meta.BurstPlacement):
            out.setdefault(placed.unit, placed)
    return out


def _buffers_in_training(gm: fx.GraphModule, unit: str) -> str:
    """The first floating-point buffer of a module of layer ``unit`` that is in training mode
    ('' when none): its forward may update it."""
    for n in gm.graph.nodes:
        placed = meta.get_pass_meta(n, PASS_NAME)
        if not (isinstance(placed, meta.BurstPlacement) and placed.unit == unit
                and n.op == "call_module"):
            continue
        module = gm.get_submodule(n.target)
        if module.training:
            for name, b in module.named_buffers():
                if b.is_floating_point():
                    return f"{n.target}.{name}"
    return ""

"""A burst-parallel rank's step as a Program (DeepPool §4–§5), built from the graph, the plan's
placement and the rank alone: no process group, no tensors, no state.

The pieces of one rank (:func:`step_layout`, on ``size`` ranks; in one process: ``forward``,
``backward 0``, ``optimizer``):

* ``forward`` (compute): the rank's graph with autograd, and the loss on the gathered output;
  on several ranks the forward is cut at each ``tidal::scatter``/``gather``, each transfer a
  piece of its own on the ``transfer`` stream (``tidal.runtime.programs.burst_stages``);
* ``backward k`` (compute), from the last segment to the first: the forward is cut before the
  node where a bucket's parameters are first used; ``backward k`` runs autograd from segment
  k's outputs back to its inputs, so a bucket's gradients are final when its stage ends (the
  backward of a transfer is a ``transfer`` piece, ``"<transfer> backward"``);
* per bucket of the rank (``tidal.ir.burst_sync.sync_buckets``), after the stage that
  finalises it: ``all_reduce r0,r1 a..b`` (a collective on the bucket's ranks only);
* ``buffers all_reduce r0,r1`` (comm, after backward) per set of ranks with floating-point
  buffers;
* ``optimizer``, after the gradient syncs: it overlaps the buffer syncs.

The open step (``Compiled.backward``; ``finish``) ends in ``grads`` instead of ``optimizer``
(the synchronized gradients added to ``.grad``) or, inside ``no_sync``, in ``accumulate``, with
no bucket all-reduce before it (the gradients stay on the rank until the next synchronized
call); the buffer syncs stay (running statistics are averaged at every forward, as in the
closed step).

Every rank issues its buckets in the same order (which agrees with every rank's stage order), so
the collectives match. Beside the :class:`~tidal.ir.program.Program`, a :class:`StepLayout`
says what each piece does (``actions``), which the binding
(``tidal.runtime.programs.burst_step.BurstStep``) runs.

Example:
    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(),
    ...                                            torch.nn.Linear(2, 2)))
    >>> spec = BurstSpec(world=2, batch=4, param_ranks=dict.fromkeys(
    ...     ["0.weight", "0.bias", "2.weight", "2.bias"], (0, 1)), bucket_bytes=8)
    >>> program = step_layout(gm, spec, rank=0, size=2).program
    >>> [p.name for p in program.pieces]  # doctest: +NORMALIZE_WHITESPACE
    ['forward', 'backward 1', 'all_reduce 0,1 2.bias', 'all_reduce 0,1 2.weight', 'backward 0',
     'all_reduce 0,1 0.bias', 'all_reduce 0,1 0.weight', 'optimizer']
    >>> program.pieces[-1].deps       # the optimizer waits for backward and the syncs
    (2, 3, 4, 5, 6)
    >>> [p.name for p in step_layout(gm, spec, 0, 2, finish=ACCUMULATE).program.pieces]
    ['forward', 'backward 1', 'backward 0', 'accumulate']
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch.fx as fx

from tidal.ir import meta
from tidal.ir.burst_ownership import buffer_sets, foreign_params, param_ranks
from tidal.ir.burst_sync import is_transfer, ranks_label, sync_buckets
from tidal.ir.comm_cost import DDP_BUCKET_BYTES
from tidal.ir.program import COMM, COMPUTE, OPTIMIZER, TRANSFER, Piece, Program
from tidal.runtime.programs.burst_graph import specialise
from tidal.runtime.programs.burst_stages import Stages, forward_parts, stages
from tidal.runtime.programs.optimizer_wiring import ACCUMULATE, GRADS

FINISHES = ("optimizer", GRADS, ACCUMULATE)
"""How a step ends (:func:`step_layout`'s ``finish``): the closed step's ``optimizer`` piece, or
the open step's ``grads`` (synced) or ``accumulate`` (inside ``no_sync``)."""

PASS_NAME = "burst_parallel"
"""The pass whose node marks (``tidal.ir.meta.BurstPlacement``) a burst program reads."""

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class BurstSpec:
    """What a burst rank's program is built from: ``world`` ranks, the plan's global
    ``batch``, per parameter (and buffer) name the ranks of the layer that owns it
    (``param_ranks``; ``tidal.ir.burst_ownership.param_ranks``), per layer name its ranks
    (``layer_ranks``; ranks outside a layer's set skip it) and, for a layer of several nodes,
    their names (``unit_members``); gradient buckets closed at ``bucket_bytes``;
    ``overlap=False`` runs backward as one stage, every sync after it."""

    world: int
    batch: int
    param_ranks: Mapping[str, Ranks]
    layer_ranks: Mapping[str, Ranks] = field(default_factory=dict)
    unit_members: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    overlap: bool = True
    bucket_bytes: float = DDP_BUCKET_BYTES


def spec_from_plan(gm: fx.GraphModule, plan: Any, bucket_bytes: float = DDP_BUCKET_BYTES
                   ) -> BurstSpec:
    """The :class:`BurstSpec` of a ``burst_parallel`` plan (a ``BurstPlan``: ``world``,
    ``batch`` and per layer its ``layer`` name and ``ranks``) on the graph the pass rewrote,
    whose nodes carry their placement (``tidal.ir.meta.BurstPlacement``)."""
    members: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        placed = meta.get_pass_meta(n, PASS_NAME)
        if isinstance(placed, meta.BurstPlacement):
            members.setdefault(placed.unit, []).append(n.name)
    ranks_of = {l.layer: tuple(l.ranks) for l in plan.layers}
    unit_of = {m: unit for unit, ms in members.items() for m in ms}
    owners = param_ranks(gm, plan.world, unit_of, ranks_of)
    return BurstSpec(plan.world, plan.batch, dict(sorted(owners.items())), ranks_of,
                     {unit: tuple(ms) for unit, ms in members.items()},
                     bucket_bytes=bucket_bytes)


@dataclass(frozen=True)
class StepLayout:
    """One rank's step of a burst program: the ``program``, its backward ``stages`` (with the
    rank's gradient buckets), per piece what it does (``actions``: the step method and its
    argument), the buffer names by the ranks that sync them, the trainable parameters the
    rank does not own (``foreign``) and why the pieces run eagerly (``reason``)."""

    program: Program
    stages: Stages
    actions: tuple[tuple[str, Any], ...]
    buffer_sets: dict[Ranks, list[str]]
    foreign: tuple[str, ...]
    reason: str


class _Pieces:
    """A step's pieces as they are added, each with what it does."""

    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.actions: list[tuple[str, Any]] = []

    def add(self, piece: Piece, action: tuple[str, Any]) -> int:
        self.pieces.append(piece)
        self.actions.append(action)
        return len(self.pieces) - 1


def step_layout(gm: fx.GraphModule, spec: BurstSpec, rank: int, size: int,
                run: Optional[fx.GraphModule] = None, finish: str = "optimizer") -> StepLayout:
    """This rank's step on ``size`` ranks (one process: forward, backward, optimizer): its
    :class:`~tidal.ir.program.Program` and what each piece does (the module docstring).
    ``run`` is the graph the rank runs (default: ``gm`` specialised for ``rank``); ``finish``
    (one of :data:`FINISHES`) is its last piece: ``accumulate`` leaves out the bucket syncs."""
    if finish not in FINISHES:
        raise ValueError(f"burst_parallel: step_layout(finish={finish!r}): one of {FINISHES}")
    if size > 1:
        run = run if run is not None else specialise(gm, spec.layer_ranks, rank,
                                                     spec.unit_members)
        mine = [b for b in sync_buckets(gm, spec.param_ranks, size, spec.bucket_bytes)
                if rank in b.ranks]
        cut = stages(gm, run, mine, spec.overlap)
        parts = forward_parts(run)
    else:
        run, cut = gm, Stages((), ())
        parts = [("forward", COMPUTE, 0, len(gm.graph.nodes))]
    out = _Pieces()
    stage = -1
    for k, (name, stream, lo, hi) in enumerate(parts):
        stage = out.add(Piece(name, stream, (stage,) if k else ()),
                        ("forward", (hi, k == len(parts) - 1, len(parts) == 1)))
    stage, syncs = _backward_pieces(out, gm, run, cut, parts, stage, finish != ACCUMULATE)
    buffers = buffer_sets(gm, spec.param_ranks, size)
    if size > 1:
        _buffer_pieces(out, gm, buffers, rank, stage)
    last = tuple(sorted(syncs + [stage]))
    out.add(Piece(finish, COMPUTE, last, kind=OPTIMIZER if finish == "optimizer" else ""),
            (finish, None))
    foreign = foreign_params(gm, spec.param_ranks, spec.world, rank) if size > 1 else ()
    return StepLayout(Program(tuple(out.pieces), size), cut, tuple(out.actions), buffers,
                      tuple(foreign), eager_reason(gm))


def _backward_pieces(out: _Pieces, gm: fx.GraphModule, run: fx.GraphModule, cut: Stages,
                     parts: list[tuple[str, str, int, int]], stage: int, sync: bool = True
                     ) -> tuple[int, list[int]]:
    """Add the backward stages, last segment first, each followed by the all-reduces of the
    buckets it finalises (with ``sync``); a stage that holds only a transfer (and inputs) is
    the transfer's backward, on the ``transfer`` stream. Returns the last stage and the
    all-reduces."""
    names = [n.name for n in run.graph.nodes]
    bounds = [0] + [names.index(c) for c in cut.cuts] + [len(names)]
    moves = {lo: name for name, stream, lo, _ in parts if stream == TRANSFER}
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    syncs: list[int] = []
    for k in range(len(cut.cuts), -1, -1):
        lo, hi = bounds[k], bounds[k + 1]
        move = next((moves[i] for i in range(lo, hi) if i in moves), None)
        if move is not None and not any(names[i] not in placeholders for i in
                                        range(lo, hi) if i not in moves):
            stage = out.add(Piece(f"{move} backward", TRANSFER, (stage,)), ("backward", k))
        else:
            stage = out.add(Piece(f"backward {k}", COMPUTE, (stage,)), ("backward", k))
        for bucket in (b for b, s in cut.buckets if s == k and sync):
            syncs.append(out.add(Piece(bucket.piece, COMM, (stage,), ranks=bucket.ranks),
                                 ("all_reduce", bucket)))
    return stage, syncs


def _buffer_pieces(out: _Pieces, gm: fx.GraphModule, buffers: Mapping[Ranks, list[str]],
                   rank: int, stage: int) -> None:
    """Add, after backward, one average of the floating-point buffers per set of two or more
    ranks that holds ``rank``."""
    floats = {n for n, b in gm.named_buffers() if b.is_floating_point()}
    for ranks, names in buffers.items():
        if len(ranks) > 1 and rank in ranks and floats.intersection(names):
            out.add(Piece(f"buffers all_reduce {ranks_label(ranks)}", COMM, (stage,),
                          ranks=ranks), ("buffers_all_reduce", ranks))


def eager_reason(gm: fx.GraphModule) -> str:
    """Why a burst rank's compute pieces run eagerly (with autograd), not as captured
    segments: the scatter/gather collectives inside its graph (named), or the skipped layers
    of its specialised graph.

    >>> import torch
    >>> eager_reason(fx.symbolic_trace(torch.nn.Linear(2, 2))).split(": ")[-1]
    'each rank runs its specialised graph (skipped layers) with autograd'
    """
    node = next((n for n in gm.graph.nodes if is_transfer(n)), None)
    if node is None:
        return ("burst_parallel: eager forward and backward pieces: each rank runs its "
                "specialised graph (skipped layers) with autograd")
    return (f"burst_parallel: eager forward and backward pieces: node {node.name!r} "
            f"({node.target}) is a collective inside the graph, run with autograd")

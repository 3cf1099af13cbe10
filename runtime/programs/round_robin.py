"""Wavelet's round-robin model parallelism (§3.3) as a program of pieces on streams.

A ``RoundRobinPlan`` carries, per rank, the action list of Figure 10's schedule on a graph the
pass split into ``submod_0 .. submod_{N-1}``. :class:`RoundRobinProgram` turns each rank's list
into a :class:`~tidal.runtime.program.Program` that
:class:`~tidal.runtime.program.ProgramExecutor` runs:

- ``S p`` (stream ``load``) switches the rank to partition p: with a process group it loads
  p's weights, accumulated gradients and optimizer state and evicts every partition the rank
  no longer needs (``tidal.runtime.weights.residency``: the bytes go to a per-rank store, the
  tensors keep their identity and hold no bytes), so that a rank holds at most two partitions:
  the one it computes and the one it prefetches. A switch keeps the partition of the latest
  compute piece and the one waiting for its update, and waits only for the pieces that used a
  partition it evicts (``S p+1`` for ``F p−1`` and its transfer; in the backward ``S p−1`` for
  ``U p+1``), so it overlaps the compute of the partition it keeps. ``F``/``B`` of p wait for
  it. In one process it only counts the switch and the weight bytes it would load;
- ``F p,b`` (``compute``) runs partition p on micro-batch b (cut from the global batch as
  ``torch.tensor_split`` cuts: two shapes when it does not cut evenly, each captured for
  itself; no eager fallback for the odd one) with the activations received from the
  previous rank; ``B p,b`` (``compute``) runs its backward with the gradients received from the
  next rank. Both are segments of one captured joint graph of the partition (``make_fx`` of its
  forward, the loss on the last partition, and ``torch.autograd.grad`` with respect to its
  parameters and its input activations, the gradients of its outputs as inputs): ``F`` runs the
  nodes the outputs need (and the buffer updates), ``B`` the rest, on the values ``F`` left.
  The joint graph is lowered and captured (``tidal.runtime.program.CapturedProgram``: CUDA
  graphs on a GPU, the straight-line replay on the CPU), one copy per rank of this process,
  since the runs of a partition on different micro-batches are alive at once; a node that
  cannot be captured (an in-place buffer update, a host sync) runs uncaptured in its segment,
  and ``uncaptured()`` names it. A partition that cannot be captured at all (data-dependent
  code) runs eagerly with autograd, and ``fallback_reason`` says which and why;
- ``X`` (``comm``) moves activations to the next rank (forward) or their gradients to the
  previous rank (backward) with ``torch.distributed`` point-to-point ops, each receive sized
  for the micro-batch its sender ran (from a probe of that micro-batch's shape, the same on
  every rank) and each send checked against it first, so no rank posts a mismatched size;
- ``A p`` (``comm``) all-reduces partition p's gradients (the sum over the N batches: each
  micro-batch loss is divided by N, and weighted by its rows * N / B when the global batch of
  B rows does not cut into N equal micro-batches (:func:`micro_batches`), so the result is the
  global-batch mean gradient) and
  averages its floating-point buffers; after the ``compression`` pass each partition's
  gradients go through a compressor of their own instead (``use_grad_sync``), whose state
  :meth:`RoundRobinProgram.runtime_state` keeps for a checkpoint and a re-capture;
- ``loss`` (``comm``) all-reduces the step's loss as soon as the last forward ran;
- ``U`` steps the optimizer. With a process group each partition is updated on its own, ``U p``
  (on its own compute stream, ``update``) after ``A p`` and while p is still resident (its
  state tensors too), in the backward of partition p − 1 (Wavelet: "update the parameters of
  each model partition accordingly"), before the switch that evicts p; the step then ends with
  ``restore`` (``load``), which loads every partition back, so that between steps the model is
  whole (``state_dict()``, inference, the gradients); the next step's first switch evicts
  again, and ``stats`` reports the most this rank held during the step against the whole model,
  and what the switches, the updates and the restore cost (``step_notes()``). In one process,
  ``U`` (``compute``) steps the optimizer once, after every all-reduce.

Dependencies come from the schedule, so communication overlaps compute where the schedule lets
it: the all-reduce of partition p runs during the backward of partition p − 1 (its gradient
transfer goes first on the comm stream, so that backward waits only for the transfer), and the
loss all-reduce during the first backward. Every rank's comm pieces are in the same order, so
the point-to-point ops and collectives match across ranks; a piece that fails makes the rest of
the step fail at once (naming it), so a rank waits for a dead peer at most the group's timeout.

With a process group of N ranks each rank runs its own list; with none, all N ranks' lists run
in this process as one program (pieces named ``r<rank>:``, the transfers move tensors between
the ranks' states, the all-reduce is the shared ``.grad`` accumulation and no compressor runs),
so the schedule runs anywhere.

The open step (``Compiled.backward``, :meth:`RoundRobinProgram.bind_backward`) runs the same
schedule with no ``U`` piece: the gradient of ``scale *`` the global batch's mean loss (the last
partition's backward seeded with ``scale``, as eager ``(loss * scale).backward()`` seeds it, so
fp16 gradients are scaled before they can underflow) is added to every trainable parameter's
``.grad`` on every rank (after the ``restore``), or inside
``no_sync`` kept in the program until the next synchronized call
(``tidal.runtime.programs.round_robin_open``). Every rank then holds the whole synchronized
gradient, so ``Compiled.clip_grad_norm_`` is torch's over all the parameters.

The jobs live apart: the split graph's partitions and who owns what
(``tidal.runtime.programs.round_robin_stages``), a partition's captured joint graph
(``round_robin_capture``), the program's layout (``tidal.ir.round_robin_program``, pure), a
partition's ``F``/``B`` (``round_robin_compute``), a bound step (``round_robin_step``) and a
bound open step (``round_robin_open``) and what a program keeps across steps
(``round_robin_state``).

Example:
    >>> import torch, tidal
    >>> from tidal.passes.round_robin import RoundRobin
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> c = tidal.compile(model, (torch.randn(4, 4),), passes=[RoundRobin(partitions=2)],
    ...                   loss_fn=torch.nn.functional.cross_entropy,
    ...                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> _ = c.step((torch.randn(4, 4),), torch.tensor([0, 1, 1, 0]))
    >>> c.executor.stats["switches"], c.executor.fallback_reason, c.executor.uncaptured()
    (3, '', [])
    >>> [(p.name, p.stream) for p in c.executor.last_program.pieces][:6]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('r0:S0', 'load'), ('r1:S0', 'load'), ('r0:F0,0', 'compute'), ('r1:F0,1', 'compute'),
     ('r0:X0 fwd', 'comm'), ('r1:X0 fwd', 'comm')]
    >>> _ = c.step((torch.randn(5, 4),), torch.tensor([0, 1, 1, 0, 1]))  # micro-batches 3 + 2
    >>> sorted(shape[1][0][0][0] for shape in c.executor.graphs)        # rows of each capture
    [2, 3]
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from tidal.ir.step_state import autocast_state
from tidal.ir.cost import example_batch
from tidal.ir.program import Program
from tidal.ir.rng import fork_rng_of
from tidal.ir.round_robin_program import UPDATE, Slot, round_robin_program
from tidal.runtime.batch_data import BatchError
from tidal.runtime.comm.grad_sync import GradSync, GradSyncFactory
from tidal.runtime.distributed import rank_and_size
from tidal.runtime.programs.batch_shards import LocalShard, local_shard
from tidal.runtime.programs.optimizer_wiring import ACCUMULATE, GRADS, LocalGrads
from tidal.runtime.programs.round_robin_capture import StageGraph, capture_partitions
from tidal.runtime.programs.round_robin_open import RoundRobinBackward
from tidal.runtime.programs.round_robin_stages import Partitions, check_all_owned
from tidal.runtime.programs.round_robin_state import load_saved_state, saved_state
from tidal.runtime.programs.round_robin_step import MicroBatch, RoundRobinStep
from tidal.runtime.weights.residency import PartitionResidency

__all__ = ["PLAN_KIND", "UPDATE", "RoundRobinProgram", "check_all_owned", "from_plan",
           "micro_batches"]

PLAN_KIND = "RoundRobinPlan"


def from_plan(gm: fx.GraphModule, plan: Any) -> "RoundRobinProgram":
    """The rank program of a ``round_robin`` plan on the graph the pass split into
    partitions."""
    return RoundRobinProgram(gm, plan)


def micro_batches(inputs: Any, targets: Any, n: int, buffers: bool = False) -> list[LocalShard]:
    """The ``n`` micro-batches of the global batch ``inputs``/``targets``, cut as
    ``torch.tensor_split`` cuts (sizes differing by one row; ``local_shard`` of data
    parallelism, as if each were a rank's shard), each with the ``weight`` of its loss,
    rows * n / B (None when the batch cuts evenly: 1). The micro-batch losses are divided by
    ``n`` and weighted, so their sum is the global batch's mean loss and the accumulated
    gradient its gradient. A micro-batch with no rows (B < n) runs the batch's first row as a
    stand-in with weight 0; that is refused by a :class:`~tidal.runtime.batch_data.BatchError`
    when the partitions have floating-point buffers (``buffers``: BatchNorm statistics the
    stand-in would update), and a batch with no rows always. No collective: every rank
    raises alike.

    Example:
        >>> import torch
        >>> [(len(m.targets), m.weight) for m in micro_batches((torch.zeros(5, 3),),
        ...                                                    torch.arange(5), 2)]
        [(3, 1.2), (2, 0.8)]
        >>> try:
        ...     micro_batches((torch.zeros(1, 3),), torch.arange(1), 2, buffers=True)
        ... except BatchError as e:
        ...     print(str(e).split(":")[0])
        round_robin
    """
    batch = example_batch(inputs)
    if batch == 0:
        raise BatchError("round_robin: the global batch has no rows; pass at least one")
    if batch < n and buffers:
        raise BatchError(
            f"round_robin: the global batch has {batch} rows, fewer than the {n} partitions "
            f"(one micro-batch each per cycle), and the model has floating-point buffers "
            f"(BatchNorm running statistics): a micro-batch with no rows would run a stand-in "
            f"row that updates them; pass at least {n} rows or train this batch without "
            f"round_robin")
    return [local_shard(inputs, targets, b, n) for b in range(n)]


def _size(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _shape(batch: Any, target: Any) -> tuple:
    """A micro-batch's cache key: its structure, each leaf's shape and dtype (or value)."""
    flat, spec = tree_flatten((batch, target))
    return (str(spec), tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor)
                             else repr(v) for v in flat), autocast_state())


class RoundRobinProgram:
    """The rank program of a round-robin plan on the split graph ``split`` (see the module
    docstring). ``model``: the module whose trainable parameters must each be owned by one
    partition (the traced graph before the split, which shares the model's parameters; default
    ``split``). ``parts`` are the split graph's partitions (``owned``: the parameters each
    syncs). ``stats`` accumulates ``steps``, ``switches`` and ``switch_bytes`` (per rank:
    with a process group the bytes the switches moved in and out, in one process the weight
    bytes they would load) and, with a process group, holds the latest step's residency
    (``resident_peak_partitions``/``resident_peak_bytes``: the most partitions and bytes of
    parameters, gradients and optimizer state this rank held at once during the step, read
    from its tensors; ``whole_model_bytes``: what all partitions' take; ``switch_us`` and
    ``step_switch_bytes``: the switches' time and bytes; ``update_us``: the per-partition
    updates'; ``restore_us``/``restore_bytes``: the end-of-step restore's). ``syncs`` holds
    each partition's gradient sync once ``use_grad_sync`` set one and a step ran; ``graphs``
    each micro-batch shape's captured partitions (None: eager; an uneven global batch's two
    shapes are both captured); ``fallback_reason`` names the partitions of the latest step
    that run eagerly and why ('' when every partition runs as a captured graph)."""

    recaptures_autocast = True
    """A micro-batch in another autocast state is captured again (:func:`_shape` holds it)."""

    runtime_state_by_name = True
    """:meth:`runtime_state` keeps each partition's compressor state and the ``no_sync``
    gradients by parameter name: ``Compiled`` carries it to a program re-captured for another
    set of trainable parameters (freezing, unfreezing)."""

    def __init__(self, split: fx.GraphModule, plan: Any,
                 model: Optional[torch.nn.Module] = None):
        self.split = split
        self.plan = plan
        self.n = plan.partitions
        self.stats: dict[str, float] = {
            "steps": 0, "switches": 0, "switch_bytes": 0, "resident_peak_partitions": 0,
            "resident_peak_bytes": 0, "whole_model_bytes": 0, "switch_us": 0.0,
            "step_switch_bytes": 0, "update_us": 0.0, "restore_us": 0.0, "restore_bytes": 0}
        self.fallback_reason = ""
        self._sync_factory: Optional[GradSyncFactory] = None
        self.syncs: dict[int, GradSync] = {}
        self.parts = Partitions(split, self.n, model if model is not None else split)
        self._residency: Optional[PartitionResidency] = None  # the latest step's (a group)
        self._rank = 0
        self.graphs: dict[tuple, list[Optional[StageGraph]]] = {}
        self._stopped: dict[tuple, list[tuple[str, str]]] = {}  # eager partitions, named
        self._sizes: dict[tuple, dict[str, tuple[torch.Size, torch.dtype]]] = {}
        self._latest: tuple = ()  # the micro-batch shapes of the latest bound step, each once
        self._programs: dict[tuple, tuple[Program, tuple[Slot, ...]]] = {}
        self.local_grads = LocalGrads()
        """What the open step accumulated inside ``no_sync`` on this rank, not yet synced."""

    @property
    def owned(self) -> list[list[tuple[str, torch.nn.Parameter]]]:
        """Per partition, the ``(name, parameter)`` pairs it owns (syncs and updates)."""
        return self.parts.owned

    def use_grad_sync(self, factory: GradSyncFactory) -> None:
        """Sync each partition's gradients through its own ``factory(None)`` (a
        :class:`~tidal.runtime.comm.grad_sync.GradSync`, e.g. the ``compression`` pass's
        compressor, with its own error-feedback state) instead of a plain all-reduce."""
        if self.syncs:
            raise RuntimeError("round_robin: the gradient sync is fixed after the first step")
        self._sync_factory = factory

    def partition_sync(self, p: int) -> Optional[GradSync]:
        """Partition ``p``'s gradient sync (made on first use), None for the plain
        all-reduce."""
        if self._sync_factory is None:
            return None
        if p not in self.syncs:
            self.syncs[p] = self._sync_factory(None)
        return self.syncs[p]

    def runtime_state(self, gm: fx.GraphModule) -> dict[str, Any]:
        """What this program holds beside the model and the optimizer that changes the next
        steps, for a checkpoint (``Compiled.runtime_state_dict``) and a re-capture: each
        partition's gradient-sync state (the compression pass's compressor: error feedback,
        warm starts) and the gradients the open step keeps inside ``no_sync``
        (``tidal.runtime.programs.round_robin_state``); ``{}`` when it holds neither (in one
        process no compressor runs)."""
        return saved_state(self.syncs, self.local_grads)

    def load_runtime_state(self, gm: fx.GraphModule, optimizer: Any,
                           state: Mapping[str, Any]) -> None:
        """Restore what :meth:`runtime_state` returned (after the model and the optimizer):
        the next step continues the saved training bit for bit."""
        load_saved_state(state, self.partition_sync, self.local_grads, self.parts.owned)

    def uncaptured(self) -> list[tuple[str, str]]:
        """(node, reason) of the nodes of the latest bound step's program that run uncaptured:
        per partition, the joint-graph nodes its lowering left out of the captured segments
        (an in-place update of a buffer, a host sync...), and for a partition that runs eagerly
        the node that stopped its capture ('-' when unknown) with ``fallback_reason``'s part
        for it. Empty when every compute piece is captured (or before the first step)."""
        out: list[tuple[str, str]] = []
        for shape in self._latest:
            out += [x for x in self._stopped[shape] if x not in out]
            for p, graph in enumerate(self.graphs[shape]):
                if graph is not None:
                    out += [(node, f"partition {p}: {why}") for node, why in graph.uncaptured()
                            if (node, f"partition {p}: {why}") not in out]
        return out

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """Inference: the split graph in this process (every partition loaded first)."""
        self.materialize()
        return self.split(*args, **kwargs)

    def materialize(self) -> None:
        """Load every partition the latest step left evicted (none after a step that ended:
        its last piece restores them all; after a failed one, those it had evicted)."""
        if self._residency is not None:
            self._residency.load_all()

    def resident_partitions(self) -> list[int]:
        """The partitions whose parameters hold bytes on this rank now, read from the
        tensors (see ``tidal.runtime.weights.residency``); all of them between steps."""
        res = self._residency or PartitionResidency(self.parts.named, rank=self._rank)
        return res.resident_partitions()

    def step_notes(self) -> list[str]:
        """For ``Compiled.report()``, after a step on a process group: how much of the model
        this rank held at most, against holding all of it, and what the switches cost."""
        s = self.stats
        if not s["whole_model_bytes"]:
            return []
        share = s["resident_peak_bytes"] / s["whole_model_bytes"]
        return [f"round_robin: rank {self._rank} held at most {s['resident_peak_partitions']} "
                f"of {self.n} partitions resident: {_size(s['resident_peak_bytes'])} of "
                f"{_size(s['whole_model_bytes'])} ({share:.0%}) of parameters, gradients and "
                f"optimizer state; switches moved {_size(s['step_switch_bytes'])} in "
                f"{s['switch_us'] / 1e3:.1f} ms, per-partition updates took "
                f"{s['update_us'] / 1e3:.1f} ms, the end-of-step restore moved "
                f"{_size(s['restore_bytes'])} in {s['restore_us'] / 1e3:.1f} ms"]

    def bind(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> RoundRobinStep:
        """One training step of the global batch under the round-robin schedule: the program
        of this rank (all ranks without a process group), built once per set of micro-batch
        shapes. A batch that does not cut into N equal micro-batches is cut as
        ``torch.tensor_split`` cuts, each micro-batch's loss weighted by its rows
        (:func:`micro_batches`): the step equals one on the global batch's mean loss."""
        args = self._bound(inputs, targets, loss_fn, "")
        optimizer.zero_grad(set_to_none=True)
        return self._track(RoundRobinStep(self, *args, optimizer))

    def bind_backward(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple,
                      targets: Any, loss_fn: Callable, scale: Any, sync: bool
                      ) -> RoundRobinBackward:
        """The open step (``Compiled.backward``) of the global batch: the step's schedule with
        no update, the gradient of ``scale *`` the global batch's mean loss added to ``.grad``
        on every rank, or inside ``no_sync`` (``sync`` False) kept in ``local_grads`` until the
        next synchronized call (``tidal.runtime.programs.round_robin_open``). Its program is
        built once per set of micro-batch shapes and ``sync``, apart from the closed step's."""
        args = self._bound(inputs, targets, loss_fn, GRADS if sync else ACCUMULATE)
        return self._track(RoundRobinBackward(self, *args, scale=scale, sync=sync,
                                              local=self.local_grads))

    def _bound(self, inputs: tuple, targets: Any, loss_fn: Callable, finish: str) -> tuple:
        """What a step of the global batch binds: its program (the closed step's, or the open
        step's whose last piece is ``finish``) and slots, the ranks here, the world size, the
        :class:`~tidal.runtime.programs.round_robin_step.MicroBatch` es and ``loss_fn``.
        Micro-batches of two shapes (an uneven batch) each get their shape's captures."""
        shards = micro_batches(tuple(inputs), targets, self.n, any(self.parts.buffers))
        self.materialize()  # capture, zero_grad and a failed step's leftovers need them all
        rank, world = rank_and_size()
        if world > 1 and world != self.n:
            raise ValueError(f"round_robin: planned for {self.n} ranks but the world size is "
                             f"{world}; compile with partitions={world}")
        here = (rank,) if world > 1 else tuple(range(self.n))
        shapes = [_shape(m.inputs, m.targets) for m in shards]
        self._latest = tuple(dict.fromkeys(shapes))
        for shape in self._latest:
            m = shards[shapes.index(shape)]
            self._captured(shape, m.inputs, m.targets, loss_fn, here)
        self.fallback_reason = "; ".join(dict.fromkeys(
            why for shape in self._latest for _, why in self._stopped[shape]))
        micro = [MicroBatch(m.inputs, m.targets, m.weight, self.graphs[k], self._sizes[k])
                 for m, k in zip(shards, shapes)]
        key = (tuple(shapes), world, here, finish)
        if key not in self._programs:
            nodes = [([g.forward_nodes if g is not None else () for g in m.graphs],
                      [g.backward_nodes if g is not None else () for g in m.graphs])
                     for m in micro]
            self._programs[key] = round_robin_program(
                self.plan.schedule, self.n, here, world, *nodes[0], finish,
                finish != ACCUMULATE, batch_nodes=nodes)
        program, slots = self._programs[key]
        return program, slots, here, world, micro, loss_fn

    def _track(self, step: RoundRobinStep) -> RoundRobinStep:
        """``step``, whose residency is now the latest (:meth:`materialize`)."""
        self._residency, self._rank = step.residency, step.here[0]
        return step

    def _captured(self, shape: tuple, batch: tuple, target: Any, loss_fn: Callable,
                  here: tuple[int, ...]) -> list[Optional[StageGraph]]:
        """The partitions captured for micro-batches of ``shape`` (once per shape; ``_stopped``
        names those that run eagerly) and the sizes of what crosses each cut on such a
        micro-batch (``_sizes``), with a captured copy per rank ``here``: in one process
        their runs are alive at once. Capturing draws no random numbers: a step draws as it
        would eagerly."""
        with fork_rng_of(self.split, batch, target):
            if shape not in self.graphs:
                values = self.parts.micro_values(batch)
                self._sizes[shape] = {k: (v.shape, v.dtype) for k, v in values.items()
                                      if isinstance(v, torch.Tensor)}
                self.graphs[shape], self._stopped[shape] = capture_partitions(
                    self.parts, batch, target, loss_fn, here[0], self.plan.first_layers,
                    values)
            for g in self.graphs[shape]:
                for r in here:
                    if g is not None and r not in g.copies:
                        g.captured(r)
        return self.graphs[shape]

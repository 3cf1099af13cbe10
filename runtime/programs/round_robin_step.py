"""One step of a round-robin program bound to its tensors: what each piece does.

The program and its slots come from ``tidal.ir.round_robin_program``; :class:`RoundRobinStep`
binds them to one global batch cut into N :class:`MicroBatch` es: ``S`` switches partitions in
and out (``tidal.runtime.weights.residency``), ``F``/``B`` run a partition's segments
(``tidal.runtime.programs.round_robin_compute``), ``X`` moves activations or their gradients to
the next or previous rank (a forward transfer receives into buffers sized for the micro-batch
the sender ran, which differs from the receiver's own when the global batch does not cut into
equal micro-batches; the sender first checks that what it sends has those sizes, so that no rank
posts a mismatched size, which would abort gloo), ``A`` all-reduces a partition's gradients and
averages its buffers, ``loss`` all-reduces the loss, ``U`` steps the optimizer (on one
partition's parameters with a process group), ``restore`` loads every partition back. With no
process group every rank of the schedule runs here: a transfer moves tensors between the ranks'
states and the all-reduce is the shared ``.grad`` accumulation. A piece that fails makes the
rest of the step fail at once, naming it (``tidal.runtime.programs.step_failures``). An eager
``F``/``B`` (a partition with no captured graph) runs under the autocast state of the thread
that bound the step, on whichever thread runs it; every other piece (a captured partition holds
its casts) with autocast off (``tidal.runtime.programs.piece_autocast``).

Example:
    >>> recv_buffer(torch.ones(2, 3).t()).is_contiguous()
    True
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from tidal.ir.program import Piece, Program
from tidal.ir.round_robin_program import Slot
from tidal.ir.step_state import autocast_state
from tidal.runtime.batch_data import BatchCheck
from tidal.runtime.distributed import all_reduce_tensors
from tidal.runtime.programs.optimizer_wiring import step_only
from tidal.runtime.programs.piece_autocast import NO_AUTOCAST, under_autocast
from tidal.runtime.programs.replica_sync import average_buffers, reduce_loss
from tidal.runtime.programs.round_robin_capture import StageGraph
from tidal.runtime.programs.round_robin_compute import Run, backward, forward
from tidal.runtime.programs.round_robin_stages import floats
from tidal.runtime.programs.step_failures import FailFast
from tidal.runtime.weights.residency import PartitionResidency


def recv_buffer(like: torch.Tensor) -> torch.Tensor:
    """A contiguous buffer to receive a tensor shaped like ``like`` (point-to-point ops need
    contiguous buffers; ``empty_like`` keeps a transposed tensor's strides)."""
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def send_recv(send: list[torch.Tensor], recv: list[torch.Tensor], dest: int,
              src: int) -> list[torch.Tensor]:
    """Send ``send`` to rank ``dest`` and receive into ``recv`` from rank ``src``, batched;
    returns ``recv`` once every transfer ended."""
    ops = [dist.P2POp(dist.isend, t, dest) for t in send]
    ops += [dist.P2POp(dist.irecv, t, src) for t in recv]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return recv


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step: its ``inputs`` and ``targets``, the ``weight`` of its loss
    (rows * N / B; None: 1, an even split), each partition's captured ``graphs`` for its shape
    (None: eager) and ``sizes``, the shape and dtype of every tensor that crosses a cut
    between partitions on it (what a forward transfer of it receives)."""

    inputs: Any
    targets: Any
    weight: Optional[float]
    graphs: Sequence[Optional[StageGraph]]
    sizes: dict[str, tuple[torch.Size, torch.dtype]]


@dataclass
class RankState:
    """What one rank of a step holds between its pieces."""

    inbox: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # partition -> inputs
    runs: dict[tuple[int, int], Run] = field(default_factory=dict)
    grad_out: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    loss: float = 0.0


class RoundRobinStep:
    """One step of a ``RoundRobinProgram`` (``owner``) bound to its tensors (a ``StepWork``):
    the ``program`` of the ranks ``here`` on ``world`` ranks with its ``slots`` and the N
    :class:`MicroBatch` es ``micro``."""

    counts_step = True
    """The restore counts the step in the owner's ``stats['steps']`` (an optimizer step)."""
    scale: Any = None
    """What the loss's backward is seeded with (None: 1; the open step's loss scale)."""
    step_number: Optional[int] = None
    """This step's number (``ProgramExecutor.calls``), checked by the loss all-reduce."""
    batch_check: Optional[BatchCheck] = None
    """The step's global-batch check (given by the executor), carried by the loss all-reduce:
    ``BatchError`` on every rank before any update when the ranks' batches differ."""

    def __init__(self, owner: Any, program: Program, slots: tuple[Slot, ...],
                 here: tuple[int, ...], world: int, micro: Sequence[MicroBatch],
                 loss_fn: Callable, optimizer: Optional[torch.optim.Optimizer]):
        self.owner, self.parts = owner, owner.parts
        self.program, self.slots, self.micro = program, slots, micro
        self.here, self.world = here, world
        self.loss_fn, self.optimizer = loss_fn, optimizer
        # (rank, partition) -> the micro-batch its F runs: what a forward transfer brings it
        self.runs_batch = {(s.rank, s.partition): s.batch for s in slots if s.kind == "F"}
        self.states = {r: RankState() for r in here}
        self.guard = FailFast("round_robin")
        self._loss: Optional[torch.Tensor] = None
        # with a process group the rank holds only the partitions it needs (see _switch)
        self.residency = (PartitionResidency(self.parts.named, optimizer, here[0])
                          if world > 1 else None)
        self.timing = {"switch_us": 0.0, "switch_bytes": 0, "update_us": 0.0}
        self._autocast = autocast_state()  # the binding thread's: eager F/B run under it

    def work(self, index: int, piece: Piece) -> Callable[[], Any]:
        """What piece ``index`` does (after a piece of this step failed: fail at once, naming
        it, so that no rank waits on a peer that will not come)."""
        slot = self.slots[index]
        do = self.actions()[slot.kind]
        eager = slot.kind in "FB" and self.micro[slot.batch].graphs[slot.partition] is None
        return self.guard.wrap(piece.name, under_autocast(
            self._autocast if eager else NO_AUTOCAST, functools.partial(do, slot)))

    def actions(self) -> dict[str, Callable[[Slot], None]]:
        """What a piece of each slot kind does (``tidal.ir.round_robin_program.Slot``)."""
        return {"S": self._switch, "F": self._forward, "B": self._backward,
                "X": self._exchange, "A": self._all_reduce, "L": self._all_reduce_loss,
                "U": self._update, "R": self._restore}

    def loss(self) -> torch.Tensor:
        """The global batch's loss (the sum of the micro-batch losses / N, each weighted)."""
        if self._loss is not None:
            return self._loss
        return torch.tensor(sum(s.loss for s in self.states.values()))

    def _switch(self, slot: Slot) -> None:
        """Switch to partition p. With a process group: evict the partitions the rank no
        longer needs and load those of ``slot.keep`` it does not hold (weights, gradients,
        optimizer state), timed; in one process (the ranks share the parameters) count the
        switch and the weight bytes it would load."""
        stats = self.owner.stats
        if self.residency is None:
            if slot.rank == self.here[0]:  # per rank
                stats["switches"] += 1
                stats["switch_bytes"] += self.owner.plan.param_bytes[slot.partition]
            return
        t0 = time.perf_counter()
        moved = self.residency.switch(slot.keep)
        self.timing["switch_us"] += (time.perf_counter() - t0) * 1e6
        self.timing["switch_bytes"] += moved.total
        stats["switches"] += 1
        stats["switch_bytes"] += moved.total
        self.residency.observe()

    def _restore(self, slot: Slot) -> None:
        """The step's last piece (a process group): load every partition back, so that between
        steps the model is whole (``state_dict()``, inference, the gradients); the next step's
        first switch evicts again. Publishes the step's residency figures in ``stats``."""
        res, stats = self.residency, self.owner.stats
        res.observe()
        t0 = time.perf_counter()
        loaded = res.load_all()
        restore_us = (time.perf_counter() - t0) * 1e6
        stats.update(steps=stats["steps"] + self.counts_step, resident_peak_bytes=res.peak_bytes,
                     resident_peak_partitions=res.peak_partitions,
                     whole_model_bytes=res.resident_bytes(),
                     switch_us=self.timing["switch_us"],
                     step_switch_bytes=self.timing["switch_bytes"],
                     update_us=self.timing["update_us"], restore_bytes=loaded,
                     restore_us=restore_us)

    def _forward(self, slot: Slot) -> None:
        st, p, b = self.states[slot.rank], slot.partition, slot.batch
        names = self.parts.stages[p - 1].sends if p > 0 else ()
        received = st.inbox.pop(p, [])
        if len(received) != len(names):
            raise RuntimeError(f"round_robin: partition {p} batch {b} expected {len(names)} "
                               f"activations, received {len(received)}")
        if self.residency is not None:
            self.residency.require(p, f"F{p},{b}")
        micro = self.micro[b]
        run = forward(micro.graphs[p], self.parts, slot.rank, p, dict(zip(names, received)),
                      micro.inputs, micro.targets, self.loss_fn, micro.weight, self.scale)
        if run.loss is not None:
            st.loss += float(run.loss.detach())
        st.runs[(p, b)] = run

    def _backward(self, slot: Slot) -> None:
        st, p, b = self.states[slot.rank], slot.partition, slot.batch
        grads = [] if p == self.parts.n - 1 else st.grad_out.pop((p, b))
        if self.residency is not None:
            self.residency.require(p, f"B{p},{b}")
        backward(self.micro[b].graphs[p], self.parts, p, st.runs[(p, b)], grads)
        if self.residency is not None:  # the gradients it made are resident now
            self.residency.observe()

    def _exchange(self, slot: Slot) -> None:
        """Forward: send F p,b's activations to rank r+1 and receive partition p+1's input
        from r−1. Backward: send B p,b's input gradients to r−1 and receive the gradients of
        partition p−1's outputs (batch b's successor on this rank) from r+1."""
        n, r, p, b = self.parts.n, slot.rank, slot.partition, slot.batch
        st = self.states[r]
        run = st.runs[(p, b)]
        if not slot.backward:
            send = [t.detach().contiguous() for t in run.sent.values()]
            if self.world == 1:
                self.states[(r + 1) % n].inbox[p + 1] = send
                return
            self._check_sizes(p, b, run.sent)
            # the input of F p+1 here: the micro-batch rank r-1 ran p on, sized for it
            sizes = self.micro[self.runs_batch[(r, p + 1)]].sizes
            recv = [torch.empty(sizes[k][0], dtype=sizes[k][1], device=t.device)
                    for k, t in run.sent.items()]
            st.inbox[p + 1] = send_recv(send, recv, (r + 1) % n, (r - 1) % n)
        else:
            if self.world == 1:
                self.states[(r - 1) % n].grad_out[(p - 1, b)] = run.leaf_grads
                return
            mine = (p - 1, (r - p + 1) % n)
            prev = st.runs[mine]  # a captured run receives into its gradient inputs
            recv = (prev.grads_in if prev.captured is not None
                    else [recv_buffer(prev.sent[k]) for k in floats(prev.sent)])
            st.grad_out[mine] = send_recv(run.leaf_grads, recv, (r - 1) % n, (r + 1) % n)

    def _check_sizes(self, p: int, b: int, sent: dict[str, torch.Tensor]) -> None:
        """Raise naming the value unless what ``F p,b`` sends has the shape and dtype that the
        next rank sized its receive for (from micro-batch ``b``'s probe: the same on every
        rank, whose global batches agree): a mismatched size would abort gloo."""
        sizes = self.micro[b].sizes
        for k, t in sent.items():
            if (t.shape, t.dtype) != sizes[k]:
                raise RuntimeError(
                    f"round_robin: value {k!r} that partition {p} sends on micro-batch {b} is "
                    f"{tuple(t.shape)} {t.dtype} but the next rank expects "
                    f"{tuple(sizes[k][0])} {sizes[k][1]} (its shape on this micro-batch's "
                    f"probe): a shape that depends on the data, not only on the rows, cannot "
                    f"cross between ranks; keep it inside one partition")

    def _all_reduce(self, slot: Slot) -> None:
        """Sum partition ``p``'s gradients over the ranks and average its floating-point
        buffers (BatchNorm's running statistics: every rank ran ``p`` on its own batch)."""
        if self.world == 1:
            return
        p = slot.partition
        self.sync_partition(p, [(k, prm) for k, prm in self.parts.owned[p]
                                if prm.grad is not None])

    def sync_partition(self, p: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """Sum the ``.grad`` of partition ``p``'s parameters ``named`` over the ranks in place
        (through the partition's gradient sync when it has one) and average its buffers."""
        sync = self.owner.partition_sync(p) if named else None
        if sync is None:
            all_reduce_tensors([prm.grad for _, prm in named])
        else:
            synced = sync({k: prm.grad for k, prm in named})
            for k, prm in named:  # the sync averages; a round-robin step sums the N batches
                prm.grad.copy_(synced[k] * self.world)
        average_buffers(self.parts.buffers[p])

    def _all_reduce_loss(self, slot: Slot) -> None:
        self._loss = reduce_loss(torch.tensor(self.states[slot.rank].loss), mean=False,
                                 step=self.step_number, who="round_robin",
                                 batch=self.batch_check)

    def _update(self, slot: Slot) -> None:
        """Step the optimizer: on every parameter (one process), or (a process group) on the
        parameters partition p owns alone, while p is resident (``step_only``)."""
        if slot.partition < 0:
            self.optimizer.step()
            self.owner.stats["steps"] += 1
            return
        p = slot.partition
        self.residency.require(p, f"U{p}")
        t0 = time.perf_counter()
        step_only(self.optimizer, [prm for _, prm in self.parts.owned[p]])
        self.timing["update_us"] += (time.perf_counter() - t0) * 1e6
        self.residency.observe()  # its optimizer state may be new

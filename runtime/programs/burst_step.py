"""The binding of a burst-parallel rank's step to tensors (:class:`BurstStep`): what each
piece of its :class:`~tidal.runtime.programs.burst_layout.StepLayout` does.

The forward pieces run the rank's graph in consecutive ranges of nodes (``_CutRunner``),
detaching every value that lives across a backward cut; the last computes the loss on the
gathered output. ``backward k`` runs autograd from segment k's outputs (the loss, or the
gradients the later stage left on the detached values) back to its inputs. A bucket's
``all_reduce`` sums its gradients over its ranks (each rank's gradient is already its share of
the global-batch gradient), through a plain all-reduce on the bucket's process group or the
``GradSync`` the ``compression`` pass gave; ``buffers all_reduce`` averages running
statistics; ``optimizer`` steps, after checking that no gradient changed after its sync.

**Step agreement.** Every rank computes the same global loss, so the step has no loss
all-reduce of its own, and its collectives need not join every rank: a plan may give every layer
to rank 0 (the others then only receive the output: one point-to-point send per step), and the
buckets of a layer join only its ranks (none in a ``no_sync`` call). So nothing the step makes
could carry the ranks' step numbers both ways. Once its loss is computed, a step of a
distributed run (given its :attr:`BurstStep.step_number`) issues one tiny all-reduce on the
default group without waiting (``tidal.runtime.programs.replica_sync.reduce_loss_async``:
``[loss, s, s ** 2]`` in float64, as the other passes' loss all-reduce carries it), which runs
beside backward and the gradient syncs; its last piece (``optimizer``, ``grads`` or
``accumulate``) waits for it before it changes anything, so ranks a step apart (one raised inside
a step that its script caught, or skipped one) raise ``StepMismatchError`` naming every rank's
step, on every rank, before any of them updates. The default group is idle then: the transfers
that use it are done and the syncs run on groups of their own.

The open step (``Compiled.backward``: ``local`` given) has no optimizer piece. The first forward
piece sets the user's ``.grad`` aside, backward starts from ``scale * loss``, and the last piece
is ``grads`` (this call's gradients of the parameters the rank owns, synced among their ranks
together with what ``no_sync`` calls accumulated, *added* to the user's ``.grad``; parameters
the rank does not own get none) or, inside ``no_sync``, ``accumulate`` (this call's gradients
added to ``local``, unsynced). The forward and backward pieces run under the autocast state of
the thread that bound the step, on whichever thread runs them; the others (syncs, optimizer)
with autocast off (``tidal.runtime.programs.piece_autocast``). The open step's clipping is
``tidal.runtime.programs.grad_clip.clip_by_global_norm_``: the norm over every rank's
gradients, each counted by one rank (``burst_share.RankShare.counted``), one all-reduce.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.runtime.programs.burst import BurstProgram
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    >>> gm = fx.symbolic_trace(model)
    >>> program = BurstProgram(world=1, batch=4, param_ranks=(("0.weight", (0,)),
    ...                                                      ("0.bias", (0,))))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    >>> step = program.bind(gm, model, (x,), y, torch.nn.functional.cross_entropy, opt)
    >>> for i, piece in enumerate(step.program.pieces):   # in order, on one thread
    ...     step.work(i, piece)()
    >>> float(step.loss()) > 0
    True
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils import _pytree as pytree

from tidal.ir.burst_ownership import StateBytes
from tidal.ir.burst_sync import Bucket
from tidal.ir.node_runner import flat_tensors
from tidal.ir.program import Piece, Program
from tidal.ir.step_state import autocast_state
from tidal.runtime.batch_data import BatchCheck
from tidal.runtime.comm.grad_sync import GradSync
from tidal.runtime.distributed import all_reduce_tensors, is_distributed
from tidal.runtime.programs.burst_layout import StepLayout
from tidal.runtime.programs.burst_transfers import Produced, TransferChecker
from tidal.runtime.programs.optimizer_wiring import LocalGrads, add_grads, scaled, set_grads
from tidal.runtime.programs.piece_autocast import NO_AUTOCAST, AutocastState, under_autocast
from tidal.runtime.programs.replica_sync import average_buffers, reduce_loss_async
from tidal.runtime.programs.step_failures import FailFast, collective_errors

Ranks = tuple[int, ...]
WHO = "burst_parallel"
STEP_CHECK = "the all-reduce of the ranks' step numbers (with the loss)"


class StepOwner(Protocol):
    """What a :class:`BurstStep` needs of the rank program that bound it: the gradient sync
    and process group of a set of ranks, and where the state it holds after a step goes."""

    last_state: Optional[StateBytes]

    def sync_of(self, ranks: Ranks) -> Optional[GradSync]: ...

    def group_of(self, ranks: Ranks) -> Optional[dist.ProcessGroup]: ...

    def state_bytes(self, gm: fx.GraphModule, optimizer: Optional[torch.optim.Optimizer] = None,
                    rank: Optional[int] = None) -> StateBytes: ...


class _CutRunner(TransferChecker):
    """Runs a graph in consecutive ranges of nodes (:meth:`start`, then :meth:`advance`; the
    forward pieces), detaching every value that lives across a cut (before a node named in
    ``cuts``): each tensor that requires grad and is not a leaf becomes a new leaf (cloned, so
    later in-place ops keep working, unless it shares storage with another such value: then
    only detached, keeping the aliasing). ``pairs[k]``: (original, leaf) at cut k;
    ``result``: the graph's output once its output node ran. Each transfer's input is checked
    against ``expected`` first (``burst_transfers.TransferChecker``)."""

    def __init__(self, module: fx.GraphModule, cuts: tuple[str, ...],
                 expected: Optional[Mapping[str, Produced]] = None):
        super().__init__(module, expected or {}, dist.get_rank() if is_distributed() else None)
        self.cuts = set(cuts)
        order = {n: i for i, n in enumerate(module.graph.nodes)}
        missing = self.cuts - {n.name for n in order}
        if missing:
            raise ValueError(f"burst_parallel: the rank's graph has no node "
                             f"{sorted(missing)[0]!r} to cut backward before")
        self.nodes = list(order)
        self.order = order
        self.last_use = {n: max((order[u] for u in n.users), default=-1) for n in order}
        self.pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.result: Any = None
        self._next = 0

    def start(self, *args: Any) -> None:
        """Begin a run on ``args`` (the graph's inputs)."""
        self.env = {}
        self.args_iter = iter(self.graph.process_inputs(*args))
        self.pairs, self.result, self._next = [], None, 0

    def advance(self, stop: int) -> None:
        """Run the nodes from where the run stands up to position ``stop`` (excluded)."""
        if stop < self._next:
            raise RuntimeError(f"burst_parallel: forward pieces out of order (at node "
                               f"{self._next}, asked to run up to {stop})")
        for node in self.nodes[self._next:stop]:
            self.env[node] = self.run_node(node)
            if node.op == "output":
                self.result = self.graph.process_outputs(self.env[node])
            if self.garbage_collect_values:
                for dead in self.user_to_last_uses.get(node, []):
                    del self.env[dead]
        self._next = max(self._next, stop)

    def run_node(self, n: fx.Node) -> Any:
        if n.name in self.cuts:
            self._cut(self.order[n])
        return super().run_node(n)

    def _cut(self, here: int) -> None:
        live = [m for m in self.env if self.last_use[m] >= here]
        crossing = {id(t): t for m in live for t in flat_tensors(self.env[m])
                    if t.requires_grad and not t.is_leaf}
        storages: dict[int, int] = {}
        for t in crossing.values():
            if t.numel():
                key = t.untyped_storage().data_ptr()
                storages[key] = storages.get(key, 0) + 1
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        done: dict[int, torch.Tensor] = {}

        def cut(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or not t.requires_grad or t.is_leaf:
                return t
            if id(t) not in done:
                leaf = t.detach().requires_grad_()
                pairs.append((t, leaf))
                shared = t.numel() and storages[t.untyped_storage().data_ptr()] > 1
                done[id(t)] = leaf if shared else leaf.clone()
            return done[id(t)]

        for m in live:
            self.env[m] = pytree.tree_map(cut, self.env[m])
        self.pairs.append(pairs)



@dataclass
class BurstStep:
    """One step of a burst rank program (``owner``, a
    ``tidal.runtime.programs.burst.BurstProgram``) bound to tensors (a ``StepWork``):
    ``work(index, piece)`` gives what each piece of ``program`` does, ``loss()`` the global
    loss after (the module docstring). With ``local`` (the rank program's ``LocalGrads``) it is
    the open step: no ``optimizer``, backward of ``scale * loss``."""

    owner: StepOwner
    layout: StepLayout
    gm: fx.GraphModule
    run: fx.GraphModule
    inputs: tuple
    targets: Any
    loss_fn: Callable
    optimizer: Optional[torch.optim.Optimizer]
    scale: Any = None
    local: Optional[LocalGrads] = None
    expected: Mapping[str, Produced] = field(default_factory=dict)
    """Per transfer node, the dtype and trailing shape its input must have on every rank
    (``burst_graph.RankGraph.expected``), checked before it moves."""
    _kept: dict = field(default_factory=dict)
    _loss: Optional[torch.Tensor] = None
    _runner: Optional[_CutRunner] = None
    _pairs: list = field(default_factory=list)
    _synced: dict = field(default_factory=dict)
    _agreed: Optional[Callable[[], Any]] = None
    """Waits for the step check that the last forward piece issued (None: none issued)."""
    step_number: Optional[int] = None
    """This step's number (``ProgramExecutor.calls``; the executor sets it after binding),
    checked against every rank's once the loss is computed (the module docstring)."""
    batch_check: Optional[BatchCheck] = None
    """The step's global-batch check (given by the executor beside :attr:`step_number`): it
    rides on the same step check, ``BatchError`` on every rank before the last piece changes
    anything when the ranks' batches differ."""
    guard: FailFast = field(default_factory=lambda: FailFast(WHO))
    autocast: AutocastState = field(default_factory=autocast_state)
    """The binding thread's autocast state: the forward and backward pieces run under it."""

    @property
    def program(self) -> Program:
        return self.layout.program

    def work(self, index: int, piece: Piece) -> Callable[[], Any]:
        """What piece ``index`` does; once a piece failed, the later ones fail at once, naming
        it (``step_failures.FailFast``), so that no rank waits on a peer that will not come."""
        what, arg = self.layout.actions[index]
        method = getattr(self, f"_{what}")
        autocast = self.autocast if what in ("forward", "backward") else NO_AUTOCAST
        return self.guard.wrap(piece.name, under_autocast(
            autocast, method if arg is None else functools.partial(method, arg)))

    def loss(self) -> torch.Tensor:
        if self._loss is None:
            raise RuntimeError("burst_parallel: the step's loss is read before its forward ran")
        return self._loss.detach()

    def _forward(self, part: tuple[int, bool, bool]) -> None:
        """Run the rank's graph up to node position ``stop`` (a forward piece: the nodes
        after the previous piece's); the last piece computes the loss on the output."""
        stop, last, whole = part
        if whole and not self.layout.stages.cuts:  # one piece, no cut: the module itself
            self._begin()
            self._loss = self.loss_fn(self.run(*self.inputs), self.targets)
            self._issue_step_check()
            return
        if self._runner is None:
            self._begin()
            self._runner = _CutRunner(self.run, self.layout.stages.cuts, self.expected)
            self._runner.start(*self.inputs)
        self._runner.advance(stop)
        if last:
            self._pairs = self._runner.pairs
            self._loss = self.loss_fn(self._runner.result, self.targets)
            self._runner = None
            self._issue_step_check()

    def _issue_step_check(self) -> None:
        """On several ranks with a step number: the step check's all-reduce issued, not waited
        for (:meth:`_await_step_check` waits; the module docstring)."""
        if (self.step_number is None and self.batch_check is None) or not is_distributed():
            return
        with collective_errors(WHO, STEP_CHECK):
            self._agreed = reduce_loss_async(self._loss.detach(), None, step=self.step_number,
                                             who=WHO, batch=self.batch_check)

    def _await_step_check(self) -> None:
        """Before the last piece changes anything: wait for the step check, raising
        ``StepMismatchError`` on every rank when the ranks are on different steps."""
        agreed, self._agreed = self._agreed, None
        if agreed is not None:
            with collective_errors(WHO, STEP_CHECK):
                agreed()

    def _begin(self) -> None:
        """Before the first forward node: the closed step zeroes its optimizer's gradients;
        the open step sets the user's ``.grad`` aside (this call's gradients are made apart,
        then added to them by ``grads`` or kept by ``accumulate``)."""
        if self.local is None:
            self.optimizer.zero_grad(set_to_none=True)
            return
        for name, p in self.gm.named_parameters():
            self._kept[name] = p.grad
            p.grad = None

    def _backward(self, k: int) -> None:
        if k == len(self.layout.stages.cuts):
            scaled(self._loss, self.scale).backward()
            return
        pairs = [(o, l.grad) for o, l in self._pairs[k] if l.grad is not None]
        self._pairs[k] = []
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def _all_reduce(self, bucket: Bucket) -> None:
        """Sum the bucket's gradients over its ranks (this rank is one of them).

        Each rank's gradient is already its share of the global-batch gradient (the loss is
        scaled by its rows), so the sync is a sum; through a :class:`GradSync` (which averages)
        the result is scaled back by the number of ranks."""
        params = dict(self.gm.named_parameters())
        grads = {n: params[n].grad if params[n].grad is not None else torch.zeros_like(params[n])
                 for n in bucket.names}
        if self.local is not None:  # the open step: plus what no_sync calls accumulated
            grads = {n: self.local.plus(params[n], g) for n, g in grads.items()}
        sync = self.owner.sync_of(bucket.ranks)
        with collective_errors(WHO, bucket.piece):
            if sync is None:
                all_reduce_tensors(list(grads.values()), self.owner.group_of(bucket.ranks))
            else:
                grads = {n: g * len(bucket.ranks) for n, g in sync.bucket(grads).items()}
        set_grads(params, grads)
        for n in grads:
            self._synced[n] = (params[n].grad, params[n].grad._version)

    def _buffers_all_reduce(self, ranks: Ranks) -> None:
        """Average the set's floating-point buffers (running statistics) over its ranks."""
        names = set(self.layout.buffer_sets[ranks])
        with collective_errors(WHO, f"the buffer all-reduce of ranks {ranks}"):
            average_buffers((b for n, b in self.gm.named_buffers() if n in names),
                            self.owner.group_of(ranks))

    def _optimizer(self) -> None:
        self._await_step_check()
        params = dict(self.gm.named_parameters())
        for n in self.layout.foreign:  # a skipped unit's members that ran on zero rows
            params[n].grad = None
        self._check_synced(params)
        self.optimizer.step()
        if is_distributed():
            self.owner.last_state = self.owner.state_bytes(self.gm, self.optimizer)

    def _check_synced(self, params: dict[str, torch.Tensor]) -> None:
        for n, (grad, version) in self._synced.items():
            if params[n].grad is not grad or grad._version != version:
                raise RuntimeError(f"burst_parallel: the gradient of {n!r} changed after its "
                                   f"sync (a backward stage after the one that should "
                                   f"finalise it reached it)")

    def _take(self) -> dict[str, Optional[torch.Tensor]]:
        """This call's gradients of the parameters the rank owns, by name (None: none); the
        user's ``.grad`` that :meth:`_begin` set aside is put back on every parameter."""
        foreign = set(self.layout.foreign)  # a skipped unit's members that ran on zero rows
        fresh = {}
        for name, p in self.gm.named_parameters():
            if name not in foreign:
                fresh[name] = p.grad
            p.grad = self._kept.pop(name, None)
        return fresh

    def _grads(self) -> None:
        """The open step's last piece (synced): this call's gradients of the parameters the
        rank owns (a bucket's synced with what ``no_sync`` accumulated; a parameter of this
        rank alone, its own plus that sum) added to the user's ``.grad``."""
        self._await_step_check()
        params = dict(self.gm.named_parameters())
        self._check_synced(params)
        totals = {}
        for n, g in self._take().items():
            if n in self._synced:
                totals[n] = g
            elif g is not None:
                totals[n] = self.local.plus(params[n], g)
        for n, p, total in self.local.drain():  # accumulated, no gradient in this call
            if not p.requires_grad:
                raise ValueError(f"burst_parallel: the gradient of {n!r} was accumulated "
                                 f"inside no_sync() but this synchronized Compiled.backward "
                                 f"does not train it (frozen in between?): keep "
                                 f"requires_grad the same over an accumulation")
            totals[n] = total
        add_grads(params, totals)

    def _accumulate(self) -> None:
        """The open step's last piece inside ``no_sync``: this call's gradients of the
        parameters the rank owns added to ``local``, unsynced; ``.grad`` as the user left it."""
        self._await_step_check()
        params = dict(self.gm.named_parameters())
        for n, g in self._take().items():
            if g is not None:
                self.local.add(n, params[n], g)

"""The ``tick_tock`` plan as a program: two data-parallel waves on two compute streams.

One step of the global batch runs one tick iteration and one tock iteration: the global batch
is cut into 2N shards (N ranks); rank i's tick wave trains on shard i with the model's own
parameters, its tock wave on shard N + i with a second replica (made from the model at the
first step, with a clone of the optimizer:
``tidal.runtime.programs.optimizer_wiring.clone_optimizer``). The program
(:func:`tick_tock`) follows the first iteration of each lane of the plan's schedule:

- ``F`` forward and ``B`` backward (to the wave's raw local gradient ``g_m``) on the wave's own
  compute stream, ``tick`` or ``tock`` (two high-priority streams, so one wave's backward
  overlaps the other's forward); the tock's forward waits for the tick's forward to end (the
  paper's ``F_end`` signal). Each is a segment of the joint forward+backward graph
  (``tidal.ir.capture.capture_train_step``, cut at the loss), lowered and captured once per
  input shape and wave (``tidal.runtime.programs.step_capture``: CUDA graphs on a GPU, the
  straight-line replay on the CPU): the two waves run at the same time and a
  captured step's buffers are static. Nodes that cannot run captured (an in-place update of a
  buffer, a host sync) run uncaptured in their segment, and :meth:`TickTockProgram.uncaptured`
  names them; a step that cannot be captured or whose captured graph fails to run runs
  ``F``/``B`` eagerly with autograd, and ``fallback_reason`` says why, naming the node.
- ``A`` on the ``comm`` stream: the cross-wave average of Eq. 1, ``(g_m + g_{m-1}) / 2`` with
  the other wave's latest raw gradient (the tock's ``A`` waits for the tick's ``B``; the tick's
  uses the tock gradient of the previous step), then the wave's own gradient sync (a process
  group per wave with the world's timeout, and a :class:`~tidal.runtime.comm.grad_sync.GradSync` per
  wave: a plain averaging all-reduce, or a compressor when the ``compression`` pass wraps it,
  :meth:`TickTockProgram.use_grad_sync`), then the average of the wave's floating-point buffers
  (BatchNorm's running statistics) over its ranks. The two waves' syncs share the one ``comm``
  stream, in the schedule's order on every rank.
- ``U`` the wave's optimizer step on its own replica, on its compute stream after its ``A``.
- ``loss`` on ``comm``: the step's loss, the mean of the two waves' over all ranks.

By Lemma 1 the gradient a wave applies is the mean over the 2N shards of iterations m−1 and m.
Once one piece failed, the later ones fail at once, naming it (no collective waits for a peer
in vain: ``tidal.runtime.programs.step_failures``). Under ``torch.autocast`` the step is captured
with its casts, once per autocast state (``step_capture.shape_key``); eager ``F``/``B`` run
under the autocast state of the thread that bound the step, every other piece with autocast
off (``tidal.runtime.programs.piece_autocast``).

Example:
    >>> import torch, tidal
    >>> from tidal.passes.tick_tock import TickTock
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> c = tidal.compile(model, (torch.randn(4, 4),), passes=[TickTock()],
    ...                   loss_fn=torch.nn.functional.cross_entropy,
    ...                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> _ = c.step((torch.randn(4, 4),), torch.tensor([0, 1, 1, 0]))
    >>> sorted(c.executor.last_applied), c.executor.fallback_reason, c.executor.uncaptured()
    (['K', 'T'], '', [])
    >>> [(t.name, t.stream) for t in c.executor.last_trace][:4]
    [('tick F', 'tick'), ('tick B', 'tick'), ('tock F', 'tock'), ('tock B', 'tock')]
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx as fx

from tidal.ir.capture import step_inputs
from tidal.ir.collectives import new_group
from tidal.ir.cost import example_batch
from tidal.ir.joint_segments import forward_backward
from tidal.ir.node_runner import flat_tensors
from tidal.ir.param_owners import trainable
from tidal.ir.program import Piece
from tidal.ir.schedule import split_batch
from tidal.ir.step_state import autocast_state
from tidal.ir.tick_tock_program import (LOSS, STREAMS, WAVES, first_iteration,  # noqa: F401
                                        tick_tock, wave_stream)
from tidal.runtime.backend import backend_for
from tidal.runtime.batch_data import BatchError
from tidal.runtime.comm.grad_sync import GradSync, GradSyncFactory, plain_sync
from tidal.runtime.distributed import rank_and_size
from tidal.runtime.program import CapturedRun
from tidal.runtime.programs.optimizer_wiring import clone_optimizer, set_grads
from tidal.runtime.programs.piece_autocast import NO_AUTOCAST, under_autocast
from tidal.runtime.programs.replica_sync import average_buffers, reduce_loss
from tidal.runtime.programs.step_capture import (Fallback, StepCapture, capture_step,
                                                 lower_step, shape_key)
from tidal.runtime.programs.step_failures import FailFast, collective_errors

PLAN_KIND = "TickTockPlan"

WHO = "tick_tock"


def check_wave_batch(inputs: Any, world: int) -> None:
    """Raise :class:`~tidal.runtime.batch_data.BatchError` naming tick_tock, the batch and what
    it needs unless the global batch ``inputs`` cuts into 2 x ``world`` equal shards: Eq. 1
    averages a tick and a tock gradient of consecutive steps with equal weights, the mean over
    2N shards (Lemma 1) only when the shards are equal. No collective: every rank raises alike.

    Example:
        >>> import torch
        >>> check_wave_batch((torch.zeros(8, 3),), world=2)
        >>> try:
        ...     check_wave_batch((torch.zeros(7, 3),), world=2)
        ... except BatchError as e:
        ...     print(str(e).split(":")[1].strip())
        the global batch size 7 is not divisible by 2 x ranks = 4
    """
    batch, shards = example_batch(inputs), 2 * world
    if batch % shards:
        raise BatchError(
            f"tick_tock: the global batch size {batch} is not divisible by 2 x ranks = "
            f"{shards}: a step cuts it into one shard per rank and wave, and Eq. 1 averages "
            f"the tick and tock waves' gradients (of consecutive steps) with equal weights, "
            f"which is the gradient of the batches' mean loss only over equal shards; pass a "
            f"multiple of {shards} rows: drop the last, smaller batch "
            f"(DataLoader(drop_last=True)) or pad it, or train it without tick_tock")


@dataclass
class _Wave:
    """One wave of a bound step: its replica, optimizer, shard, group and sync, and what its
    pieces leave (the loss, the raw gradients, the gradients it applied)."""

    name: str
    gm: torch.nn.Module
    optimizer: torch.optim.Optimizer
    inputs: tuple
    targets: Any
    group: Any = None
    sync: Optional[GradSync] = None
    loss: Optional[torch.Tensor] = None
    raw: Optional[list[torch.Tensor]] = None
    applied: dict = field(default_factory=dict)

    def __post_init__(self) -> None:  # no zero_grad: the sync sets every gradient it applies
        self.params = trainable(self.gm)

    @property
    def stream(self) -> str:
        return wave_stream(self.name)


class TickTockProgram:
    """This rank's side of a tick-tock plan (see the module docstring), run by
    ``tidal.runtime.program.ProgramExecutor``. ``tock`` is the tock replica (after the first
    step); ``last_applied[wave][name]`` the gradient each wave applied in the last step;
    ``syncs[wave]`` the wave's gradient sync (after the first step); ``fallback_reason`` why
    the waves run ``F``/``B`` eagerly ('' when they run captured segments); :meth:`uncaptured`
    what the latest step ran uncaptured."""

    pipelined = True
    """Steps may overlap (``ProgramExecutor.job``): step m + 1 is bound and its pieces queued
    while step m runs; each wave's stream runs its pieces in order, so the tick's forward of
    step m + 1 overlaps the tock's backward of step m (persistent waves, Wavelet Fig. 9)."""

    recaptures_autocast = True
    """A step in another autocast state than the last is captured again (the capture key
    holds it), its eager pieces run under it: ``compiler.guards`` lets autocast change."""

    def __init__(self, plan: Any):
        self.plan = plan
        self.tock: Optional[torch.nn.Module] = None
        self._tock_opt: Optional[torch.optim.Optimizer] = None
        self._group_of: tuple[int, ...] = ()
        self._prev_tock: Optional[list[torch.Tensor]] = None  # what the next tick averages with
        self._groups: tuple[Any, Any] = (None, None)
        self._sync_factory: GradSyncFactory = plain_sync
        self._captured: dict[tuple, StepCapture] = {}
        self.syncs: dict[str, GradSync] = {}
        self.last_applied: dict[str, dict[str, torch.Tensor]] = {}
        self.fallback_reason = ""
        self._fallback: Optional[Fallback] = None
        self._latest: Optional[StepCapture] = None

    def use_grad_sync(self, factory: GradSyncFactory) -> None:
        """Sync each wave's gradients with ``factory(group)`` (e.g. a compressor's) instead of
        the plain all-reduce; set before the first step."""
        if self.syncs:
            raise RuntimeError("tick_tock: the gradient sync is fixed after the first step")
        self._sync_factory = factory

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """Inference runs the tick replica (the model's own parameters)."""
        return gm(*args, **kwargs)

    def _start(self, gm: fx.GraphModule, optimizer: torch.optim.Optimizer, world: int) -> None:
        """The first step: the tock replica, its optimizer, the waves' groups and syncs."""
        self.tock = copy.deepcopy(gm)
        tock_params = dict(self.tock.named_parameters())
        mapping = {id(p): tock_params[k] for k, p in gm.named_parameters()}
        self._tock_opt = clone_optimizer(optimizer, mapping)
        # which of the user's groups each of the clone's came from (a group with none of the
        # graph's parameters has no clone)
        self._group_of = tuple(i for i, g in enumerate(optimizer.param_groups)
                               if any(id(p) in mapping for p in g["params"]))
        if world > 1:  # every rank, in the same order; the world's timeout
            self._groups = (new_group(backend="gloo"), new_group(backend="gloo"))
        self.syncs = {w: self._sync_factory(g) for w, g in zip(WAVES, self._groups)}

    def runtime_state(self, gm: fx.GraphModule) -> dict[str, Any]:
        """What this program holds beside the model and the user's optimizer, for a checkpoint
        (``Compiled.runtime_state_dict``): the tock replica, its optimizer's state, the tock
        gradient the next tick averages with (Eq. 1) and the waves' compressor states; empty
        before the first step."""
        if self.tock is None:
            return {}
        prev = self._prev_tock
        return {"tock": {k: v.detach().clone() for k, v in self.tock.state_dict().items()},
                "tock_optimizer": self._tock_opt.state_dict(),
                "prev_tock": None if prev is None else [g.detach().clone() for g in prev],
                "syncs": {w: s.state_dict() for w, s in self.syncs.items()}}

    def load_runtime_state(self, gm: fx.GraphModule, optimizer: torch.optim.Optimizer,
                           state: Mapping[str, Any]) -> None:
        """Restore what :meth:`runtime_state` returned (after the model and ``optimizer``,
        the user's, were restored): the next step continues the saved training bit for
        bit."""
        if not state:
            return
        if self.tock is None:
            self._start(gm, optimizer, rank_and_size()[1])
        self.tock.load_state_dict(state["tock"])
        self._tock_opt.load_state_dict(state["tock_optimizer"])
        prev = state["prev_tock"]
        self._prev_tock = None if prev is None else [g.clone() for g in prev]
        for w, sync_state in state["syncs"].items():
            self.syncs[w].load_state_dict(sync_state)

    def _follow(self, optimizer: torch.optim.Optimizer) -> None:
        """The tock's optimizer takes the user's hyper-parameters (a learning-rate schedule,
        a changed weight decay) group by group, at every step: the second wave trains as the
        user's optimizer says, not as it said at the first step."""
        groups = optimizer.param_groups
        if len(groups) <= max(self._group_of, default=-1):
            raise ValueError("tick_tock: the optimizer's param groups changed after the first "
                             "step (the tock wave's optimizer follows them group by group): "
                             "add param groups before the first step")
        for mine, i in zip(self._tock_opt.param_groups, self._group_of):
            mine.update({k: v for k, v in groups[i].items() if k != "params"})

    def uncaptured(self) -> list[tuple[str, str]]:
        """(node, reason) of what the latest step ran uncaptured: the nodes of the lowered
        joint graph that run outside a captured segment (both waves run the same graph), or
        ``(node or "-", fallback_reason)`` when the waves ran ``F``/``B`` eagerly."""
        return list(self._latest.uncaptured) if self._latest is not None else []

    def _capture(self, waves: dict[str, _Wave], loss_fn: Callable, world: int) -> StepCapture:
        """The captured step and program for these shard shapes (once per shape; the waves'
        shards have the same shapes): each wave's segments lowered and captured on its own
        tensors, or the eager program (``fallback_reason`` says why)."""
        tick = waves[WAVES[0]]
        key = (world,) + shape_key(tick.inputs, tick.targets)
        if key not in self._captured:
            try:
                if self._fallback is not None:  # a step that failed to capture stays eager
                    raise self._fallback
                step = capture_step(tick.gm, tick.inputs, tick.targets, loss_fn)
                program = tick_tock(self.plan.schedule, world, *forward_backward(step),
                                    len(step.param_names))
                flats = {w.name: step_inputs(step, w.gm, w.inputs, w.targets)
                         for w in waves.values()}
                device = flat_tensors(flats[tick.name])[0].device
                self._captured[key] = lower_step(step, program, flats, backend_for(device))
            except Fallback as e:
                self._fallback, self.fallback_reason = e, e.reason
                eager = tick_tock(self.plan.schedule, world, grads=len(tick.params))
                self._captured[key] = StepCapture.eager(eager, e)
        return self._captured[key]

    def bind(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> "_TickTockStep":
        """One tick iteration and one tock iteration on the global batch (2N shards; a
        batch that does not cut into 2N equal shards is refused: :func:`check_wave_batch`)."""
        rank, world = rank_and_size()
        check_wave_batch(inputs, world)
        xs = split_batch(tuple(inputs), 2 * world, "tick_tock global batch")
        ys = split_batch(targets, 2 * world, "tick_tock targets")
        if self.tock is None:
            self._start(gm, optimizer, world)
        self._follow(optimizer)
        waves = {"T": _Wave("T", gm, optimizer, xs[rank], ys[rank], self._groups[0],
                            self.syncs["T"]),
                 "K": _Wave("K", self.tock, self._tock_opt, xs[world + rank], ys[world + rank],
                            self._groups[1], self.syncs["K"])}
        self._latest = captured = self._capture(waves, loss_fn, world)
        return _TickTockStep(self, captured, waves, loss_fn, world)


class _TickTockStep:
    """One step of :class:`TickTockProgram` bound to its tensors (a ``StepWork``)."""

    def __init__(self, owner: TickTockProgram, captured: StepCapture, waves: dict[str, _Wave],
                 loss_fn: Callable, world: int):
        self.owner, self.captured, self.waves = owner, captured, waves
        self.program = captured.program
        self.loss_fn, self.world = loss_fn, world
        self.guard = FailFast(WHO)
        self._loss: Optional[torch.Tensor] = None
        self._nodes = captured.nodes() if captured.captured else None
        self._autocast = autocast_state()  # the binding thread's: eager F/B run under it
        # each wave's run of its captured segments, begun by its F: this step may be bound
        # while the previous one still runs (persistent waves), whose runs own the buffers
        self.runs: dict[str, CapturedRun] = {}

    def work(self, index: int, piece: Piece) -> Callable[[], None]:
        """What piece ``index`` does; once a piece failed, the later ones fail at once."""
        if piece.name == LOSS:
            return self.guard.wrap(piece.name, under_autocast(NO_AUTOCAST, self._average_loss))
        stream, kind = piece.name.split()
        wave = self.waves[WAVES[STREAMS.index(stream)]]
        autocast = NO_AUTOCAST  # a captured segment holds its casts
        if kind == "U":
            action: Callable[[], Any] = wave.optimizer.step
        elif kind in "FB" and self.captured.captured:  # a captured segment
            action = functools.partial(self._segment, wave, index, kind)
        else:
            action = functools.partial({"F": self._forward, "B": self._backward,
                                        "A": self._sync}[kind], wave)
            autocast = self._autocast if kind in "FB" else NO_AUTOCAST
        return self.guard.wrap(piece.name, under_autocast(autocast, action))

    def _segment(self, w: _Wave, index: int, kind: str) -> None:
        """Piece ``index``'s lowered steps in wave ``w``'s run (the ``F`` begins the run),
        then the loss (``F``) or the raw gradients (``B``) it computed."""
        if w.name not in self.runs:
            self.runs[w.name] = self.captured.lowered[w.name].run(
                step_inputs(self.captured.step, w.gm, w.inputs, w.targets))
        run = self.runs[w.name]
        run.segment(index)()  # after B, the activations are freed after their last use
        loss, grads = self._nodes
        if kind == "F":
            w.loss = run.value(loss)
        else:
            w.raw = [run.value(g) for g in grads]

    def _forward(self, w: _Wave) -> None:
        w.loss = self.loss_fn(w.gm(*w.inputs), w.targets)

    def _backward(self, w: _Wave) -> None:
        params = list(w.params.values())
        grads = torch.autograd.grad(w.loss, params, allow_unused=True)
        w.raw = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    def _sync(self, w: _Wave) -> None:
        # the tick averages with the previous step's tock gradient: the comm stream runs the
        # tock's sync of step m before the tick's of step m + 1, which reads what it kept
        other = self.waves["T"].raw if w.name == "K" else self.owner._prev_tock
        if other is None:
            avg = list(w.raw)  # the very first tick iteration has no predecessor
        else:
            avg = [(g + h) / 2 for g, h in zip(w.raw, other)]  # Eq. 1
        with collective_errors(WHO, f"the {w.stream} wave's gradient sync"):
            synced = w.sync(dict(zip(w.params, avg)))  # the wave's all-reduce (or compressor)
            # running statistics (BatchNorm): the same on every rank of the wave
            average_buffers(w.gm.buffers(), w.group)
        set_grads(w.params, synced, copy=True)
        # the optimizer reads a gradient, never writes it: no second copy
        w.applied = {k: p.grad for k, p in w.params.items()}
        if w.name == "K":  # a captured gradient is a static output buffer (CUDA): the next
            # replay of the tock's segments overwrites it before the next tick average reads it
            self.owner._prev_tock = [g.clone() for g in w.raw] if self.runs else w.raw

    def _average_loss(self) -> None:
        loss = (self.waves["T"].loss.detach() + self.waves["K"].loss.detach()) / 2
        with collective_errors(WHO, "the loss all-reduce"):
            self._loss = reduce_loss(loss)

    def loss(self) -> torch.Tensor:
        """The step's loss (both waves, all ranks); keeps the gradients the waves applied."""
        self.owner.last_applied = {w.name: w.applied for w in self.waves.values()}
        return self._loss


def from_plan(gm: fx.GraphModule, plan: Any) -> TickTockProgram:
    """The rank program of a ``tick_tock`` plan (its waves, ranks and schedule)."""
    return TickTockProgram(plan)

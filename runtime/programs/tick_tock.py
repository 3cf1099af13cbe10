"""The ``tick_tock`` plan as a program: two data-parallel waves on two compute streams.

One step of the global batch runs one tick iteration and one tock iteration: the global batch
is cut into 2N shards (N ranks); rank i's tick wave trains on shard i with the model's own
parameters, its tock wave on shard N + i with a second replica (made from the model at the
first step, with a clone of the optimizer that takes its groups' hyper-parameters at every
step: ``tidal.runtime.programs.optimizer_mirror.MirroredOptimizer``). The program
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
Freezing or unfreezing between steps re-captures the program (``compiler.guards``), which
takes this one's :meth:`TickTockProgram.runtime_state`: the tock replica's parameters require
grad as the model's at every bind (a frozen parameter keeps its value in both replicas), and
the kept tock gradient is by parameter name, so a parameter trained again takes its own
gradient alone at its first tick, as on the very first one.
Once one piece failed, the later ones fail at once, naming it (no collective waits for a peer
in vain: ``tidal.runtime.programs.step_failures``). Under ``torch.autocast`` the step is captured
with its casts, once per autocast state (``step_capture.shape_key``); eager ``F``/``B`` run
under the autocast state of the thread that bound the step, every other piece with autocast
off (``tidal.runtime.programs.piece_autocast``). The pieces' work is in
``tidal.runtime.programs.tick_tock_step``.

The open step (``Compiled.backward``, :meth:`TickTockProgram.bind_backward`, as DDP's) runs
``F``, ``B`` and ``A`` with no ``U``: each wave's synchronized Eq. 1 gradient of ``scale *
loss`` (the backward seeded with ``scale``, as eager ``(loss * scale).backward()``) is added
to its replica's ``.grad`` (inside ``no_sync``: accumulated, the sums averaged at the next
synchronized call; ``tick_tock_step`` says how that equals Eq. 1 on the micro-batches'
union); the loop clips (:meth:`TickTockProgram.clip_grad_norm_`: each wave by its own norm)
and steps its optimizers, and after each of their steps the tock replica steps a clone of
that optimizer (``optimizer_mirror.StepMirrors``, through a global ``torch.optim`` step hook),
its groups following the user's. One compiled model trains one way, closed or open; a
``GradScaler`` (a tensor ``scale``) is refused in the open step, naming why.

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
from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx as fx

from tidal.ir.capture import step_inputs
from tidal.ir.collectives import new_group
from tidal.ir.joint_segments import forward_backward
from tidal.ir.node_runner import flat_tensors
from tidal.ir.program import Program
from tidal.ir.schedule import split_batch
from tidal.ir.tick_tock_program import WAVES, open_step, tick_tock
from tidal.runtime.backend import backend_for
from tidal.runtime.comm.grad_sync import GradSync, GradSyncFactory, plain_sync
from tidal.runtime.distributed import rank_and_size
from tidal.runtime.program import OpenStepError
from tidal.runtime.programs.optimizer_mirror import MirroredOptimizer, StepMirrors
from tidal.runtime.programs.optimizer_wiring import ACCUMULATE, GRADS, LocalGrads
from tidal.runtime.programs.step_capture import (Fallback, StepCapture, capture_step,
                                                 lower_step, shape_key)
from tidal.runtime.programs.tick_tock_checks import check_wave_batch, named_prev_tock
from tidal.runtime.programs.tick_tock_step import WHO, TickTockBackward, TickTockStep, Wave

PLAN_KIND = "TickTockPlan"


CLOSED, OPEN = "Compiled.step", "Compiled.backward"
"""How a program trains (:attr:`TickTockProgram.mode`): the closed step, whose tock wave steps a
clone of ``Compiled.optimizer``, or the open one, whose tock wave steps clones of the loop's
optimizers (``tidal.runtime.programs.optimizer_mirror.StepMirrors``)."""


class TickTockProgram:
    """This rank's side of a tick-tock plan (see the module docstring), run by
    ``tidal.runtime.program.ProgramExecutor``. ``tock`` is the tock replica (after the first
    step, whose parameters require grad as the model's do: :meth:`follow_freezing`);
    ``prev_tock`` the tock gradient the next tick averages with (Eq. 1), by parameter name;
    ``last_applied[wave][name]`` the gradient each wave applied in the last step;
    ``syncs[wave]`` the wave's gradient sync (after the first step); ``fallback_reason`` why
    the waves run ``F``/``B`` eagerly ('' when they run captured segments); :meth:`uncaptured`
    what the latest step ran uncaptured; ``mode`` :data:`CLOSED` or :data:`OPEN` once it
    trained ('' before: one compiled model trains one way)."""

    pipelined = True
    """Steps may overlap (``ProgramExecutor.job``): step m + 1 is bound and its pieces queued
    while step m runs; each wave's stream runs its pieces in order, so the tick's forward of
    step m + 1 overlaps the tock's backward of step m (persistent waves, Wavelet Fig. 9)."""

    recaptures_autocast = True
    """A step in another autocast state than the last is captured again (the capture key
    holds it), its eager pieces run under it: ``compiler.guards`` lets autocast change."""

    runtime_state_by_name = True
    """:meth:`runtime_state` keeps what it holds per parameter by name (the tock replica,
    its optimizers' states by the user's groups, ``prev_tock``): ``Compiled`` carries it to a
    program re-captured for another set of trainable parameters (freezing, unfreezing)."""

    def __init__(self, plan: Any):
        self.plan = plan
        self.tock: Optional[torch.nn.Module] = None
        self.prev_tock: Optional[dict[str, torch.Tensor]] = None
        self.mode = ""
        self._mirror: Optional[MirroredOptimizer] = None   # closed: Compiled.optimizer's clone
        self._mirrors: Optional[StepMirrors] = None        # open: the loop's optimizers' clones
        self._groups: tuple[Any, Any] = (None, None)
        self._sync_factory: GradSyncFactory = plain_sync
        self._captured: dict[tuple, StepCapture] = {}
        self._opened: dict[tuple[int, bool], tuple[Program, tuple[int, ...]]] = {}
        self.local_grads = {w: LocalGrads() for w in WAVES}
        """Each wave's sum accumulated inside ``no_sync`` on this rank, not yet synced."""
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

    def tock_optimizers(self) -> list[torch.optim.Optimizer]:
        """The tock replica's optimizers: the clone of ``Compiled.optimizer`` (closed step),
        or one clone per loop optimizer that stepped (open step, in the order they first
        stepped)."""
        if self._mirror is not None:
            return [self._mirror.clone]
        return self._mirrors.optimizers() if self._mirrors is not None else []

    def follow_freezing(self, gm: fx.GraphModule) -> None:
        """Make the tock replica's parameters require grad as ``gm``'s do (each bind): a
        frozen tick parameter's replica copy is frozen too, so the tock wave computes no
        gradient for it and its optimizer clone skips it (as torch optimizers skip a parameter
        whose ``.grad`` is None). In the closed step, which owns zeroing the gradients, a frozen
        copy's ``.grad`` is dropped, as ``Compiled`` drops the model's; in the open step the
        loop owns them (the clones set the replica's to None after each step)."""
        tock = dict(self.tock.named_parameters())
        for name, p in gm.named_parameters():
            replica = tock[name]
            if replica.requires_grad != p.requires_grad:
                replica.requires_grad_(p.requires_grad)
            if self.mode == CLOSED and not p.requires_grad:
                replica.grad = None

    def _enter(self, mode: str, gm: fx.GraphModule, world: int,
               optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Train the ``mode`` way (refused after the other): at the first step, the tock
        replica, the waves' groups and syncs; the tock's optimizer clone (closed, of
        ``optimizer``) or the loop's optimizers' mirrors (open)."""
        if self.mode and self.mode != mode:
            raise OpenStepError(
                f"tick_tock: {mode} after {self.mode} on one compiled model: the open step's "
                f"tock replica steps with clones of the loop's optimizers, the closed step's "
                f"with a clone of Compiled.optimizer, and the two cannot take turns (the kept "
                f"tock gradient of Eq. 1 and the clones' state would mix); train with one of "
                f"them, or compile the model again")
        if self.tock is None:
            self.tock = copy.deepcopy(gm)
            if world > 1:  # every rank, in the same order; the world's timeout
                self._groups = (new_group(backend="gloo"), new_group(backend="gloo"))
            self.syncs = {w: self._sync_factory(g) for w, g in zip(WAVES, self._groups)}
        self.mode = mode
        self.follow_freezing(gm)
        tock_params = dict(self.tock.named_parameters())
        mapping = {id(p): tock_params[k] for k, p in gm.named_parameters()}
        if mode == CLOSED and self._mirror is None:
            if optimizer is None:
                raise ValueError("tick_tock: this checkpoint's runtime state is of Compiled.step "
                                 "training, whose tock wave clones Compiled.optimizer: compile "
                                 "with optimizer=... to load it")
            self._mirror = MirroredOptimizer(optimizer, mapping)
        if mode == OPEN and self._mirrors is None:
            self._mirrors = StepMirrors(mapping, WHO)

    def runtime_state(self, gm: fx.GraphModule) -> dict[str, Any]:
        """What this program holds beside the model and the user's optimizers, for a
        checkpoint (``Compiled.runtime_state_dict``): how it trains, the tock replica, its
        optimizers' states (:meth:`tock_optimizers`), the tock gradient the next tick averages
        with (Eq. 1) and the waves' compressor states; empty before the first step."""
        if self.tock is None:
            return {}
        prev = self.prev_tock
        states = [o.state_dict() for o in self.tock_optimizers()] if self._mirror is not None \
            else self._mirrors.state_dict()
        return {"mode": self.mode,
                "tock": {k: v.detach().clone() for k, v in self.tock.state_dict().items()},
                "tock_optimizers": states,
                "prev_tock": None if prev is None else {n: g.detach().clone()
                                                        for n, g in prev.items()},
                "syncs": {w: s.state_dict() for w, s in self.syncs.items()}}

    def load_runtime_state(self, gm: fx.GraphModule,
                           optimizer: Optional[torch.optim.Optimizer],
                           state: Mapping[str, Any]) -> None:
        """Restore what :meth:`runtime_state` returned (after the model and the user's
        optimizers were restored; ``optimizer``: ``Compiled.optimizer``, for the closed
        step's): the next step continues the saved training bit for bit. In the open step the
        loop's optimizers' clones take their states when those first step, in the order they
        first stepped when saved."""
        if not state:
            return
        self._enter(state.get("mode", CLOSED), gm, rank_and_size()[1], optimizer)
        self.tock.load_state_dict(state["tock"])
        states = state.get("tock_optimizers") or [state["tock_optimizer"]]
        if self._mirror is not None:
            self._mirror.clone.load_state_dict(states[0])
        else:
            self._mirrors.load_state_dict(states)
        self.prev_tock = named_prev_tock(gm, state["prev_tock"])
        for w, sync_state in state["syncs"].items():
            self.syncs[w].load_state_dict(sync_state)

    def uncaptured(self) -> list[tuple[str, str]]:
        """(node, reason) of what the latest step ran uncaptured: the nodes of the lowered
        joint graph that run outside a captured segment (both waves run the same graph), or
        ``(node or "-", fallback_reason)`` when the waves ran ``F``/``B`` eagerly."""
        return list(self._latest.uncaptured) if self._latest is not None else []

    def _capture(self, waves: dict[str, Wave], loss_fn: Callable, world: int) -> StepCapture:
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
        self._latest = self._captured[key]
        return self._latest

    def _waves(self, mode: str, gm: fx.GraphModule, inputs: tuple, targets: Any,
               optimizer: Optional[torch.optim.Optimizer]) -> tuple[dict[str, Wave], int]:
        """The two waves of a step on the global batch (2N shards; a batch that does not cut
        into 2N equal shards is refused: ``tick_tock_checks.check_wave_batch``) and the world size."""
        rank, world = rank_and_size()
        check_wave_batch(inputs, world)
        xs = split_batch(tuple(inputs), 2 * world, "tick_tock global batch")
        ys = split_batch(targets, 2 * world, "tick_tock targets")
        self._enter(mode, gm, world, optimizer)
        tock_opt = self._mirror.clone if mode == CLOSED else None
        return {"T": Wave("T", gm, optimizer, xs[rank], ys[rank], self._groups[0],
                          self.syncs["T"]),
                "K": Wave("K", self.tock, tock_opt, xs[world + rank], ys[world + rank],
                          self._groups[1], self.syncs["K"])}, world

    def bind(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> TickTockStep:
        """One tick iteration and one tock iteration on the global batch, each wave's ``U``
        its optimizer's step (the tock's clone takes ``optimizer``'s groups first)."""
        waves, world = self._waves(CLOSED, gm, inputs, targets, optimizer)
        self._mirror.follow(optimizer)
        return TickTockStep(self, self._capture(waves, loss_fn, world), waves, loss_fn, world)

    def bind_backward(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple,
                      targets: Any, loss_fn: Callable, scale: Any, sync: bool
                      ) -> TickTockBackward:
        """The open step (``Compiled.backward``; ``tidal.runtime.programs.tick_tock_step``):
        both waves' ``F``/``B``/``A`` with no ``U``, each wave's synchronized Eq. 1 gradient
        of ``scale * loss`` (``scale`` the backward's seed) added to its replica's ``.grad``
        (``sync``) or kept in :attr:`local_grads`. ``scale`` is a number: a tensor (a
        ``GradScaler``'s) is refused, since ``GradScaler.unscale_(optimizer)`` unscales only
        the optimizer's parameters' gradients, the tick wave's, and the tock replica would
        step on scaled ones."""
        if isinstance(scale, torch.Tensor):
            raise OpenStepError(
                f"tick_tock: Compiled.backward(scale=<a tensor or a GradScaler>) is not "
                f"available under {PLAN_KIND}: GradScaler.unscale_(optimizer) unscales only "
                f"the gradients of the optimizer's "
                f"parameters (the tick wave's), and the tock wave's replica would step on "
                f"scaled gradients; pass a number (scale=1/k for accumulation), and train "
                f"without loss scaling (bf16 autocast needs none) or without tick_tock")
        waves, world = self._waves(OPEN, gm, inputs, targets, None)
        captured = self._capture(waves, loss_fn, world)
        key = (id(captured), sync)
        if key not in self._opened:
            self._opened[key] = open_step(captured.program, GRADS if sync else ACCUMULATE,
                                          sync)
        return TickTockBackward(self, captured, waves, loss_fn, world, self._opened[key],
                                scale, self.local_grads)

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip each wave's gradients by the wave's own global norm (each wave is a
        data-parallel model of its own in Eq. 1's reference; every rank of a wave holds its
        synchronized gradients): the model's (the tick wave's) and the tock replica's.
        Returns the tick wave's norm before clipping."""
        if self.mode == CLOSED:
            raise OpenStepError("tick_tock: Compiled.clip_grad_norm_ after Compiled.step: the "
                                "closed step applied its gradients already; clip in the open "
                                "step (Compiled.backward, then clip, then optimizer.step())")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        if self.tock is not None:
            torch.nn.utils.clip_grad_norm_(self.tock.parameters(), max_norm, norm_type)
        return norm


def from_plan(gm: fx.GraphModule, plan: Any) -> TickTockProgram:
    """The rank program of a ``tick_tock`` plan (its waves, ranks and schedule)."""
    return TickTockProgram(plan)

"""The bound steps of ``tick_tock`` (``tidal.runtime.programs.tick_tock``): what each piece of a
rank's step does, in the closed step (``Compiled.step``: :class:`TickTockStep`, each wave's
``U`` its optimizer's step) and the open one (``Compiled.backward``: :class:`TickTockBackward`).

The open step runs the waves' ``F``, ``B`` and ``A`` with no ``U``, each wave's ``B`` on
``scale * loss`` (the captured step takes ``scale`` as its backward's seed,
``tidal.ir.capture.loss_seed``; eagerly the loss is multiplied before backward: as eager
``(loss * scale).backward()``, never the gradients after): each wave's Eq. 1 average of those
gradients, synchronized over the wave's ranks, is *added* to its replica's ``.grad`` (the
tick wave's: the model's; the tock wave's: the tock replica's) by the wave's ``grads`` piece;
the loop steps its optimizers, and the tock replica's clones follow them
(``tidal.runtime.programs.optimizer_mirror``). Inside ``no_sync`` the ``A`` pieces are left
out and each wave's ``accumulate`` piece adds its raw gradient (of ``scale * loss``) to the
wave's local sum (``LocalGrads``); the next synchronized call adds its own, and Eq. 1 averages the
sums: the tick's with the tock's sum of the previous synchronized call (Eq. 1's "other
wave's latest gradient" is the other wave's whole latest step), the tock's with the tick's
sum of this one. So accumulating k micro-batches with ``scale = 1/k`` each equals one step
of the Eq. 1 reference in which the tick wave's shard is the union of the micro-batches'
tick shards and the tock wave's the union of their tock shards (with the same scale at
every step; the kept tock sum is scaled as its micro-batches were).

Example:
    >>> import torch, tidal
    >>> from tidal.passes.tick_tock import TickTock
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> c = tidal.compile(model, (torch.randn(4, 4),), passes=[TickTock()],
    ...                   loss_fn=torch.nn.functional.cross_entropy)
    >>> opt = torch.optim.SGD(c.parameters(), lr=0.1)
    >>> loss = c.backward(torch.randn(4, 4), torch.tensor([0, 1, 1, 0]))
    >>> [p.name for p in c.executor.last_program.pieces]  # doctest: +NORMALIZE_WHITESPACE
    ['tick F', 'tick B', 'tock F', 'tock B', 'tick A', 'tick grads', 'tock A', 'tock grads',
     'loss']
    >>> opt.step(); opt.zero_grad()                        # the tock replica steps with it
    >>> [p.grad for p in c.executor.tock.parameters()]    # zeroed after its step
    [None, None, None, None]
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from tidal.ir.capture import step_inputs
from tidal.ir.param_owners import trainable
from tidal.ir.program import Piece, Program
from tidal.ir.step_state import autocast_state
from tidal.ir.tick_tock_program import LOSS, STREAMS, WAVES, wave_stream
from tidal.runtime.batch_data import BatchCheck
from tidal.runtime.comm.grad_sync import GradSync
from tidal.runtime.program import CapturedRun
from tidal.runtime.programs.optimizer_wiring import (ACCUMULATE, GRADS, LocalGrads, add_grads,
                                                     scaled, set_grads)
from tidal.runtime.programs.piece_autocast import NO_AUTOCAST, AutocastState, under_autocast
from tidal.runtime.programs.replica_sync import average_buffers, reduce_loss
from tidal.runtime.programs.step_capture import StepCapture
from tidal.runtime.programs.step_failures import FailFast, collective_errors

WHO = "tick_tock"


@dataclass
class Wave:
    """One wave of a bound step: its replica, optimizer (None in the open step), shard, group
    and sync, and what its pieces leave (the loss, the raw gradients, the gradients it
    applied or, in the open step, the sum Eq. 1 averaged: ``total``)."""

    name: str
    gm: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    inputs: tuple
    targets: Any
    group: Any = None
    sync: Optional[GradSync] = None
    loss: Optional[torch.Tensor] = None
    raw: Optional[list[torch.Tensor]] = None
    applied: dict = field(default_factory=dict)
    total: Optional[list[torch.Tensor]] = None

    def __post_init__(self) -> None:  # no zero_grad: the sync sets every gradient it applies
        self.params = trainable(self.gm)

    @property
    def stream(self) -> str:
        return wave_stream(self.name)

    def named(self, grads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``grads`` (one per trainable parameter of this wave, in order) by parameter name."""
        return dict(zip(self.params, grads))


class TickTockStep:
    """One closed step of ``TickTockProgram`` bound to its tensors (a ``StepWork``). ``owner``
    is the program: its ``prev_tock`` (the tock gradient the next tick averages with, by
    parameter name) is read by the tick's ``A`` and written by the tock's."""

    step_number: Optional[int] = None
    """This step's number (``ProgramExecutor.calls``), checked by the loss all-reduce."""

    batch_check: Optional[BatchCheck] = None
    """The ranks' global batches to compare (``compile(batch="global")``), on the same loss
    all-reduce, no round of its own. That piece runs after the waves' ``U`` pieces, so a
    mismatch (of steps or batches) stops training naming the ranks once this step's update
    is made; the other passes check before theirs."""

    def __init__(self, owner: Any, captured: StepCapture, waves: dict[str, Wave],
                 loss_fn: Callable, world: int):
        self.owner, self.captured, self.waves = owner, captured, waves
        self.program: Program = captured.program
        self.loss_fn, self.world = loss_fn, world
        self.guard = FailFast(WHO)
        self._loss: Optional[torch.Tensor] = None
        self._nodes = captured.nodes() if captured.captured else None
        self._autocast = autocast_state()  # the binding thread's: eager F/B run under it
        # each wave's run of its captured segments, begun by its F: this step may be bound
        # while the previous one still runs (persistent waves), whose runs own the buffers
        self.runs: dict[str, CapturedRun] = {}
        self.scale: Any = None
        """What the loss is multiplied by before backward (None: 1; the open step's scale)."""

    def work(self, index: int, piece: Piece) -> Callable[[], None]:
        """What piece ``index`` does; once a piece failed, the later ones fail at once."""
        if piece.name == LOSS:
            return self.guard.wrap(piece.name, under_autocast(NO_AUTOCAST, self._average_loss))
        stream, kind = piece.name.split()
        wave = self.waves[WAVES[STREAMS.index(stream)]]
        autocast, action = self.action(wave, index, kind)
        return self.guard.wrap(piece.name, under_autocast(autocast, action))

    def action(self, wave: Wave, index: int, kind: str
               ) -> tuple[AutocastState, Callable[[], Any]]:
        """The autocast state and the function of wave ``wave``'s piece ``index`` of ``kind``
        (``F``, ``B``, ``A`` or ``U``); ``index`` is the piece's in the captured program."""
        if kind == "U":
            return NO_AUTOCAST, wave.optimizer.step
        if kind in "FB" and self.captured.captured:  # a captured segment holds its casts
            return NO_AUTOCAST, functools.partial(self._segment, wave, index, kind)
        action = functools.partial({"F": self._forward, "B": self._backward,
                                    "A": self._sync}[kind], wave)
        return (self._autocast if kind in "FB" else NO_AUTOCAST), action

    def _segment(self, w: Wave, index: int, kind: str) -> None:
        """Piece ``index``'s lowered steps in wave ``w``'s run (the ``F`` begins the run),
        then the loss (``F``) or the raw gradients (``B``) it computed."""
        if w.name not in self.runs:
            self.runs[w.name] = self.captured.lowered[w.name].run(
                step_inputs(self.captured.step, w.gm, w.inputs, w.targets, self.scale))
        run = self.runs[w.name]
        run.segment(index)()  # after B, the activations are freed after their last use
        loss, grads = self._nodes
        if kind == "F":
            w.loss = run.value(loss)
        else:
            w.raw = [run.value(g) for g in grads]

    def _forward(self, w: Wave) -> None:
        w.loss = self.loss_fn(w.gm(*w.inputs), w.targets)

    def _backward(self, w: Wave) -> None:
        params = list(w.params.values())
        grads = torch.autograd.grad(scaled(w.loss, self.scale), params, allow_unused=True)
        w.raw = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    def eq1(self, w: Wave, own: list[torch.Tensor], other: Optional[Mapping[str, torch.Tensor]]
            ) -> dict[str, torch.Tensor]:
        """Eq. 1, ``(own + other) / 2`` parameter by parameter (``own`` alone where ``other``
        has none: the very first tick iteration, or a parameter trained again since the other
        wave's gradient was kept), synchronized over wave ``w``'s ranks (its all-reduce or
        compressor), and the wave's floating-point buffers (BatchNorm's running statistics)
        averaged over them: the gradients by parameter name. ``other``: the other wave's
        gradients by parameter name (a frozen parameter has none and gets none)."""
        other = other or {}
        avg = [(g + other[n].reshape(g.shape)) / 2 if n in other else g
               for n, g in zip(w.params, own)]
        with collective_errors(WHO, f"the {w.stream} wave's gradient sync"):
            synced = w.sync(dict(zip(w.params, avg)))
            average_buffers(w.gm.buffers(), w.group)
        return synced

    def keep_tock(self, w: Wave, grads: list[torch.Tensor]) -> None:
        """Keep the tock wave ``w``'s ``grads`` by parameter name for the next tick's Eq. 1 (by
        name: the next tick may train another set of parameters, after freezing or
        unfreezing): a captured gradient is a static output buffer (CUDA), which the next
        replay of the tock's segments overwrites before the next tick average reads it."""
        self.owner.prev_tock = {n: g.clone() if self.runs else g
                                for n, g in zip(w.params, grads)}

    def _sync(self, w: Wave) -> None:
        # the tick averages with the previous step's tock gradient: the comm stream runs the
        # tock's sync of step m before the tick's of step m + 1, which reads what it kept
        other = self.waves["T"].named(self.waves["T"].raw) if w.name == "K" else \
            self.owner.prev_tock
        set_grads(w.params, self.eq1(w, w.raw, other), copy=True)
        # the optimizer reads a gradient, never writes it: no second copy
        w.applied = {k: p.grad for k, p in w.params.items()}
        if w.name == "K":
            self.keep_tock(w, w.raw)

    def _average_loss(self) -> None:
        loss = (self.waves["T"].loss.detach() + self.waves["K"].loss.detach()) / 2
        with collective_errors(WHO, "the loss all-reduce"):
            self._loss = reduce_loss(loss, step=self.step_number, who=WHO,
                                     batch=self.batch_check)

    def loss(self) -> torch.Tensor:
        """The step's loss (both waves, all ranks); keeps the gradients the waves applied."""
        self.owner.last_applied = {w.name: w.applied for w in self.waves.values()}
        return self._loss


class TickTockBackward(TickTockStep):
    """One open step of ``TickTockProgram`` (see the module docstring): ``program`` is the
    open program (``tidal.ir.tick_tock_program.open_step``), ``origin[i]`` the index of its
    piece ``i`` in the captured program; ``scale`` multiplies the loss before backward (so the
    raw gradients); ``local`` holds each wave's sum accumulated inside ``no_sync``."""

    def __init__(self, owner: Any, captured: StepCapture, waves: dict[str, Wave],
                 loss_fn: Callable, world: int, opened: tuple[Program, tuple[int, ...]],
                 scale: Optional[float], local: dict[str, LocalGrads]):
        super().__init__(owner, captured, waves, loss_fn, world)
        self.program, self._origin = opened
        self.scale, self._local = scale, local

    def work(self, index: int, piece: Piece) -> Callable[[], None]:
        return super().work(self._origin[index], piece)

    def action(self, wave: Wave, index: int, kind: str
               ) -> tuple[AutocastState, Callable[[], Any]]:
        if kind in (GRADS, ACCUMULATE):
            return NO_AUTOCAST, functools.partial(
                self._add if kind == GRADS else self._accumulate, wave)
        return super().action(wave, index, kind)

    def _total(self, w: Wave) -> list[torch.Tensor]:
        """Wave ``w``'s gradient of this synchronized call: its raw gradient (of ``scale *
        loss``) plus what ``no_sync`` calls accumulated (taken out of ``local``), once."""
        if w.total is None:
            local = self._local[w.name]
            w.total = [local.plus(p, g) for p, g in zip(w.params.values(), w.raw)]
            left = local.drain()
            if left:
                raise ValueError(f"{WHO}: gradients of {[n for n, _, _ in left][:3]} were "
                                 f"accumulated inside no_sync() but this synchronized "
                                 f"Compiled.backward does not train them: keep requires_grad "
                                 f"the same over an accumulation")
        return w.total

    def _sync(self, w: Wave) -> None:
        # Eq. 1 on the waves' sums: the tick's with the tock's of the previous synchronized
        # call, the tock's with the tick's of this one (the comm stream runs the tick's A first)
        own, tick = self._total(w), self.waves["T"]
        other = tick.named(self._total(tick)) if w.name == "K" else self.owner.prev_tock
        w.applied = self.eq1(w, own, other)
        if w.name == "K":
            self.keep_tock(w, own)

    def _add(self, w: Wave) -> None:
        """The wave's ``grads`` piece: its synchronized Eq. 1 gradient added to ``.grad``."""
        add_grads(w.params, w.applied)

    def _accumulate(self, w: Wave) -> None:
        """The wave's ``accumulate`` piece (inside ``no_sync``): its raw gradient (of ``scale *
        loss``) added to the wave's local sum."""
        local = self._local[w.name]
        for (name, p), g in zip(w.params.items(), w.raw):
            local.add(name, p, g)

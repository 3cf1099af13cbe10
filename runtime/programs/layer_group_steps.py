"""A layer-grouped program bound to one run's tensors: what its load, segment and tail pieces do.

:class:`BoundGroups` binds a :class:`~tidal.ir.layer_group_program.Pipelined` program: its load
pieces go to the run's :class:`~tidal.runtime.programs.layer_group_loads.GroupLoads`, a group's
segment first checks that its weights are in, the tail pieces run the functions named for them.
:class:`InterpretedSegments` runs segments node by node through one ``fx.Interpreter`` (with
autograd when training: the cold-start forward and the eager step, :func:`bind_training`);
:class:`ReplayedSegments` runs them as the lowered, captured segments of a captured step
(:func:`bind_captured`). The open step (``Compiled.backward``) has a ``grads`` piece in place of
the ``optimizer`` piece: the gradient of ``scale * loss`` added to each trainable parameter's
``.grad`` (:func:`bind_open_training`, :func:`bind_open_captured`; one process, so ``no_sync``
changes nothing). Interpreted segments and the eager ``backward`` piece run under the autocast
state of the thread that bound the run, on whichever thread runs them; the captured segments
(whose casts are in their graph), the loads, ``optimizer`` and ``grads`` with autocast off
(``tidal.runtime.programs.piece_autocast``).

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir.layer_group_program import pipelined
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> names = tuple(n.name for n in gm.graph.nodes)
    >>> x = torch.randn(1, 2)
    >>> bound = InterpretedSegments(pipelined([names], loads=False), graph_interpreter(gm, x), None)
    >>> bound.work(0, bound.program.pieces[0])()
    >>> torch.equal(bound.output(), gm(x))
    True
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx as fx

from tidal.ir.capture import step_inputs
from tidal.ir.layer_group_program import BACKWARD_PIECE, OPTIMIZER_PIECE, Pipelined
from tidal.ir.param_owners import trainable
from tidal.ir.program import LOAD, Piece
from tidal.ir.step_state import autocast_state
from tidal.runtime.program import CapturedRun
from tidal.runtime.programs.layer_group_loads import GroupLoads
from tidal.runtime.programs.optimizer_wiring import GRADS, add_grads, scaled, set_grads
from tidal.runtime.programs.piece_autocast import NO_AUTOCAST, AutocastState, under_autocast
from tidal.runtime.programs.step_capture import StepCapture


def graph_interpreter(gm: fx.GraphModule, *args: Any) -> fx.Interpreter:
    """An interpreter of ``gm`` whose placeholders take ``args`` (flattened as ``gm`` does)."""
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    interp.args_iter = iter(gm.graph.process_inputs(*args))
    return interp


class BoundGroups:
    """A pipelined program bound to one run's tensors (a ``StepWork``): load pieces go to
    ``loads``, the pieces named in ``calls`` run those functions and every other piece is a
    segment (``compute``, after ``loads.ready`` for a group's piece); ``loss()`` gives the
    step's loss once every piece ran. The segments and the ``backward`` call run under
    ``autocast`` (an autocast state), every other piece with autocast off."""

    def __init__(self, run: Pipelined, loads: Optional[GroupLoads],
                 calls: Optional[Mapping[str, Callable[[], Any]]] = None,
                 loss: Optional[Callable[[], torch.Tensor]] = None,
                 autocast: AutocastState = NO_AUTOCAST):
        self.program, self.groups = run.program, run.groups
        self.loads = loads
        self.calls = dict(calls or {})
        self.autocast = autocast
        self._loss = loss

    def work(self, index: int, piece: Piece) -> Callable[[], Any]:
        group = self.groups[index]
        if piece.stream == LOAD:
            if self.loads is None:
                raise ValueError(f"piece {piece.name!r}: this run loads no weights")
            return functools.partial(self.loads.load, group)
        if piece.name in self.calls:
            eager = piece.name == BACKWARD_PIECE
            return under_autocast(self.autocast if eager else NO_AUTOCAST, self.calls[piece.name])
        return under_autocast(self.autocast, functools.partial(self._segment, group, index, piece))

    def _segment(self, group: Optional[int], index: int, piece: Piece) -> None:
        if group is not None and self.loads is not None:
            self.loads.ready(group)
        self.compute(index, piece)

    def compute(self, index: int, piece: Piece) -> None:
        """Run the segment of ``piece`` (piece ``index`` of the program)."""
        raise NotImplementedError

    def loss(self) -> torch.Tensor:
        if self._loss is None:
            raise ValueError("a forward run has no loss")
        return self._loss()


class InterpretedSegments(BoundGroups):
    """Segments run node by node through one interpreter (with autograd when ``grad``): the
    cold-start forward and the eager fallback of a step, under the autocast state of the
    thread that made it (as the eager model would run there)."""

    def __init__(self, run: Pipelined, interp: fx.Interpreter, loads: Optional[GroupLoads],
                 grad: bool = False, calls: Optional[Mapping[str, Callable[[], Any]]] = None,
                 loss: Optional[Callable[[], torch.Tensor]] = None):
        super().__init__(run, loads, calls, loss, autocast_state())
        self.interp, self.grad = interp, grad
        self.nodes = {n.name: n for n in interp.graph.nodes}

    def compute(self, index: int, piece: Piece) -> None:
        with torch.set_grad_enabled(self.grad):
            for name in piece.nodes:
                node = self.nodes[name]
                try:
                    self.interp.env[node] = self.interp.run_node(node)
                except Exception as e:  # noqa: BLE001 - re-raised, naming the node
                    raise RuntimeError(f"layer groups: node {name!r} ({node.target}): "
                                       f"{type(e).__name__}: {e}") from e

    def output(self) -> Any:
        """The graph's output (after the run)."""
        node = next(n for n in reversed(self.interp.graph.nodes) if n.op == "output")
        return self.interp.graph.process_outputs(self.interp.env[node])


class ReplayedSegments(BoundGroups):
    """Segments of a captured step: piece ``index`` runs its lowered, captured steps in the
    run ``replay`` (with autocast off: a capture made under autocast has its casts)."""

    def __init__(self, run: Pipelined, replay: CapturedRun,
                 calls: Mapping[str, Callable[[], Any]], loss: Callable[[], torch.Tensor]):
        super().__init__(run, None, calls, loss)
        self.replay = replay

    def compute(self, index: int, piece: Piece) -> None:
        self.replay.segment(index)()


def _replayed(capture: StepCapture, gm: fx.GraphModule, inputs: tuple, targets: Any,
              seed: Any = None) -> tuple[CapturedRun, Callable[[], torch.Tensor],
                                         Callable[[], dict[str, torch.Tensor]]]:
    """A run of ``capture``'s lowered segments on these tensors (``seed``: the backward's, a
    loss scale: ``tidal.ir.capture.step_inputs``), and what reads its loss (a detached copy)
    and its gradients by parameter name once it ran."""
    replay = capture.lowered[0].run(step_inputs(capture.step, gm, inputs, targets, seed))
    loss, grads = capture.nodes()

    def values() -> dict[str, torch.Tensor]:
        return {name: replay.value(g) for name, g in zip(capture.step.param_names, grads)}

    return replay, lambda: replay.value(loss).detach().clone(), values


def bind_captured(run: Pipelined, capture: StepCapture, gm: fx.GraphModule, inputs: tuple,
                  targets: Any, optimizer: torch.optim.Optimizer) -> ReplayedSegments:
    """A step of the captured joint graph (``run`` is ``capture``'s program): its segments
    (lowered, captured) compute the loss and the gradients, the ``optimizer`` piece applies
    them. What outlives the step is copied out of a CUDA graph's static outputs, which the
    next step's replay overwrites."""
    params = trainable(gm)
    replay, loss, grads = _replayed(capture, gm, inputs, targets)

    def apply() -> None:
        optimizer.zero_grad(set_to_none=True)
        values = grads()
        set_grads(params, values, copy=any(g.device.type != "cpu" for g in values.values()))
        optimizer.step()

    return ReplayedSegments(run, replay, calls={OPTIMIZER_PIECE: apply}, loss=loss)


def bind_open_captured(run: Pipelined, capture: StepCapture, gm: fx.GraphModule,
                       inputs: tuple, targets: Any, scale: Any) -> ReplayedSegments:
    """The open step of the captured joint graph (``run``: ``capture``'s segments, then a
    ``grads`` piece): the gradients of the loss times ``scale`` (None, a number or a tensor:
    the backward's seed, so fp16 gradients scale as eager's do) are added to the trainable
    parameters' ``.grad`` (copies: a CUDA graph's static outputs are overwritten by the next
    replay)."""
    params = trainable(gm)
    replay, loss, grads = _replayed(capture, gm, inputs, targets, scale)

    def add() -> None:
        add_grads(params, grads())

    return ReplayedSegments(run, replay, calls={GRADS: add}, loss=loss)


def bind_training(run: Pipelined, gm: fx.GraphModule, inputs: tuple, targets: Any,
                  loss_fn: Callable, optimizer: torch.optim.Optimizer,
                  loads: Optional[GroupLoads]) -> InterpretedSegments:
    """A step whose groups run ``gm``'s segments with autograd, then an eager ``backward``."""
    done: dict[str, torch.Tensor] = {}

    def backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(bound.output(), targets)
        loss.backward()
        done["loss"] = loss.detach()

    bound = InterpretedSegments(run, graph_interpreter(gm, *inputs), loads, grad=True,
                                calls={BACKWARD_PIECE: backward, OPTIMIZER_PIECE: optimizer.step},
                                loss=lambda: done["loss"])
    return bound


def bind_open_training(run: Pipelined, gm: fx.GraphModule, inputs: tuple, targets: Any,
                       loss_fn: Callable, scale: Any, loads: Optional[GroupLoads]
                       ) -> InterpretedSegments:
    """The open step whose groups run ``gm``'s segments with autograd (``run``: the groups,
    ``backward``, ``grads``): ``backward`` takes the gradients of ``scale * loss`` (``scale``
    None, a number or a tensor), ``grads`` adds them to the trainable parameters' ``.grad``."""
    params = trainable(gm)
    done: dict[str, Any] = {}

    def backward() -> None:
        loss = loss_fn(bound.output(), targets)
        done["loss"] = loss.detach()
        if params:
            grads = torch.autograd.grad(scaled(loss, scale), list(params.values()),
                                        allow_unused=True)
            done["grads"] = {n: g for n, g in zip(params, grads) if g is not None}

    bound = InterpretedSegments(run, graph_interpreter(gm, *inputs), loads, grad=True,
                                calls={BACKWARD_PIECE: backward,
                                       GRADS: lambda: add_grads(params, done.get("grads", {}))},
                                loss=lambda: done["loss"])
    return bound

"""A layer-grouped program bound to one run's tensors: what its load, segment and tail pieces do.

:class:`BoundGroups` binds a :class:`~tidal.ir.layer_group_program.Pipelined` program: its load
pieces go to the run's :class:`~tidal.runtime.programs.layer_group_loads.GroupLoads`, a group's
segment first checks that its weights are in, the tail pieces run the functions named for them.
:class:`InterpretedSegments` runs segments node by node through one ``fx.Interpreter`` (with
autograd when training: the cold-start forward and the eager step, :func:`bind_training`);
:class:`ReplayedSegments` runs them as the lowered, captured segments of a captured step
(:func:`bind_captured`).

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
from tidal.ir.layer_group_program import OPTIMIZER_PIECE, Pipelined
from tidal.ir.param_owners import trainable
from tidal.ir.program import LOAD, Piece
from tidal.runtime.program import CapturedRun
from tidal.runtime.programs.layer_group_loads import GroupLoads
from tidal.runtime.programs.optimizer_wiring import set_grads
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
    step's loss once every piece ran."""

    def __init__(self, run: Pipelined, loads: Optional[GroupLoads],
                 calls: Optional[Mapping[str, Callable[[], Any]]] = None,
                 loss: Optional[Callable[[], torch.Tensor]] = None):
        self.program, self.groups = run.program, run.groups
        self.loads = loads
        self.calls = dict(calls or {})
        self._loss = loss

    def work(self, index: int, piece: Piece) -> Callable[[], Any]:
        group = self.groups[index]
        if piece.stream == LOAD:
            if self.loads is None:
                raise ValueError(f"piece {piece.name!r}: this run loads no weights")
            return functools.partial(self.loads.load, group)
        if piece.name in self.calls:
            return self.calls[piece.name]
        return functools.partial(self._segment, group, index, piece)

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
    cold-start forward and the eager fallback of a step."""

    def __init__(self, run: Pipelined, interp: fx.Interpreter, loads: Optional[GroupLoads],
                 grad: bool = False, calls: Optional[Mapping[str, Callable[[], Any]]] = None,
                 loss: Optional[Callable[[], torch.Tensor]] = None):
        super().__init__(run, loads, calls, loss)
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
    run ``replay``."""

    def __init__(self, run: Pipelined, replay: CapturedRun,
                 calls: Mapping[str, Callable[[], Any]], loss: Callable[[], torch.Tensor]):
        super().__init__(run, None, calls, loss)
        self.replay = replay

    def compute(self, index: int, piece: Piece) -> None:
        self.replay.segment(index)()


def bind_captured(run: Pipelined, capture: StepCapture, gm: fx.GraphModule, inputs: tuple,
                  targets: Any, optimizer: torch.optim.Optimizer) -> ReplayedSegments:
    """A step of the captured joint graph (``run`` is ``capture``'s program): its segments
    (lowered, captured) compute the loss and the gradients, the ``optimizer`` piece applies
    them. What outlives the step is copied out of a CUDA graph's static outputs, which the
    next step's replay overwrites."""
    params = trainable(gm)
    replay = capture.lowered[0].run(step_inputs(capture.step, gm, inputs, targets))
    loss, grads = capture.nodes()

    def apply() -> None:
        optimizer.zero_grad(set_to_none=True)
        values = {name: replay.value(g) for name, g in zip(capture.step.param_names, grads)}
        set_grads(params, values, copy=any(g.device.type != "cpu" for g in values.values()))
        optimizer.step()

    return ReplayedSegments(run, replay, calls={OPTIMIZER_PIECE: apply},
                            loss=lambda: replay.value(loss).detach().clone())


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
                                calls={"backward": backward, OPTIMIZER_PIECE: optimizer.step},
                                loss=lambda: done["loss"])
    return bound

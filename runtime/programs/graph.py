"""The rank program of a compile with no plan to run differently: the graph as it is.

When no builder gives a program (no parallelism or compression plan, a CHAI plan, a
layer-group plan without a weight store), ``Compiled`` still runs every call and every step
through the one :class:`~tidal.runtime.program.ProgramExecutor`: its rank program is a
:class:`GraphProgram`. Inference runs the graph (``compile(lower="graphs")``: the lowered form,
captured segments, ``tidal.runtime.lower``); a training step is two pieces on the compute
stream, ``forward`` (the loss) and ``backward`` (autograd, then the optimizer's step), so the
step has a trace and a scheduler can fit the pieces into another job's idle spans. The pieces
read the model's state only when they run, so the next step's pieces may be bound before this
one ends (``pipelined``: the stream runs them in order). The open step (``Compiled.backward``,
:meth:`GraphProgram.bind_backward`) is ``forward``, ``backward`` (autograd of ``scale * loss``)
and ``grads`` (added to the parameters' ``.grad``) or, inside ``no_sync``, ``accumulate`` (kept
in the program until the next call outside it): one process, nothing to synchronize. The
``forward`` and ``backward`` pieces run under the autocast state of the thread that bound the
step, on whichever thread runs them (``tidal.runtime.programs.piece_autocast``).

Example:
    >>> import torch
    >>> from tidal.runtime.program import ProgramExecutor
    >>> from tidal.runtime.programs.graph import GraphProgram
    >>> model = torch.nn.Linear(4, 2)
    >>> gm = torch.fx.symbolic_trace(model)
    >>> ex = ProgramExecutor(GraphProgram())
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> loss = ex.step(gm, model, (torch.randn(3, 4),), torch.tensor([0, 1, 1]),
    ...                torch.nn.functional.cross_entropy, opt)
    >>> [(p.name, p.stream) for p in ex.last_program.pieces]
    [('forward', 'compute'), ('backward', 'compute')]
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from tidal.ir.inputs import bind_inputs
from tidal.ir.param_owners import trainable
from tidal.ir.program import COMPUTE, Piece, Program
from tidal.ir.step_state import autocast_state
from tidal.runtime.programs.optimizer_wiring import (ACCUMULATE, GRADS, LocalGrads, add_grads,
                                                     accumulate_grad)
from tidal.runtime.programs.piece_autocast import NO_AUTOCAST, under_autocast

FORWARD, BACKWARD = "forward", "backward"

STEP_PROGRAM = Program((Piece(FORWARD, COMPUTE), Piece(BACKWARD, COMPUTE, (0,))))
"""One eager training step: the forward with the loss, then backward with the optimizer."""

OPEN_PROGRAMS = {sync: Program((Piece(FORWARD, COMPUTE), Piece(BACKWARD, COMPUTE, (0,)),
                                Piece(GRADS if sync else ACCUMULATE, COMPUTE, (1,))))
                 for sync in (True, False)}
"""The open step's program, with ``sync`` (``grads``: added to ``.grad``) or without
(``accumulate``: kept in the program)."""


class GraphProgram:
    """The rank program that runs the graph as it is (see the module docstring). ``lowered``:
    the graph's lowered form (``tidal.runtime.lower.LoweredModule``) that inference and the
    steps' forward run instead of the graph, or None."""

    pipelined = True

    def __init__(self, lowered: Optional[torch.nn.Module] = None,
                 source: Optional[fx.GraphModule] = None):
        self.lowered = lowered
        self.source = source   # the graph ``lowered`` was lowered from (None: any)
        self.local_grads = LocalGrads()
        """What the open step accumulated inside ``no_sync``, not yet in ``.grad``."""

    def _run(self, gm: fx.GraphModule) -> Any:
        """What runs ``gm``'s forward: its lowered form when ``gm`` is the graph that was
        lowered, else ``gm`` itself (another graph: the model traced again in another mode, or
        the uncaptured graph a guard asks for under another autocast)."""
        if self.lowered is not None and (self.source is None or gm is self.source):
            return self.lowered
        return gm

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """The graph's forward (its lowered form when there is one)."""
        return self._run(gm)(*args, **kwargs)

    def bind(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> "GraphStep":
        """One training step as :data:`STEP_PROGRAM`'s two pieces."""
        return GraphStep(self._run(gm), inputs, targets, loss_fn, optimizer)

    def bind_backward(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple,
                      targets: Any, loss_fn: Callable, scale: Any, sync: bool
                      ) -> "GraphBackward":
        """The open step as :data:`OPEN_PROGRAMS`' three pieces (see the module docstring)."""
        return GraphBackward(self._run(gm), trainable(gm), inputs, targets, loss_fn,
                             scale, sync, self.local_grads)

    def uncaptured(self) -> list[tuple[str, str]]:
        """(node, reason) of each step of the lowered forward that runs uncaptured."""
        report = getattr(self.lowered, "report", None)
        return [] if report is None else [(info.nodes[0], info.reason) for info in report.steps
                                          if info.kind != "captured"]


class GraphStep:
    """One bound eager step (``tidal.runtime.program.StepWork``)."""

    program = STEP_PROGRAM

    def __init__(self, run: Callable[..., Any], inputs: Sequence[Any], targets: Any,
                 loss_fn: Callable, optimizer: torch.optim.Optimizer):
        self._run, self._inputs, self._targets = run, tuple(inputs), targets
        self._loss_fn, self._optimizer = loss_fn, optimizer
        self._loss: Optional[torch.Tensor] = None
        self._autocast = autocast_state()  # the binding thread's: the pieces run under it

    def work(self, index: int, piece: Piece) -> Callable[[], Any]:
        return under_autocast(self._autocast,
                              self._forward if piece.name == FORWARD else self._backward)

    def _forward(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)
        self._loss = self._loss_fn(self._run(*self._inputs), self._targets)

    def _backward(self) -> None:
        self._loss.backward()
        self._optimizer.step()

    def loss(self) -> torch.Tensor:
        return self._loss.detach()


class GraphBackward:
    """One bound open step (``tidal.runtime.program.StepWork``): the gradient of
    ``scale * loss`` added to the trainable parameters' ``.grad`` with what ``local`` holds
    (``sync``), or added to ``local``."""

    def __init__(self, run: Callable[..., Any], params: dict[str, torch.Tensor],
                 inputs: Sequence[Any], targets: Any, loss_fn: Callable, scale: Any,
                 sync: bool, local: LocalGrads):
        self.program = OPEN_PROGRAMS[sync]
        self._run, self._inputs, self._targets = run, tuple(inputs), targets
        self._loss_fn, self._scale, self._params, self._local = loss_fn, scale, params, local
        self._loss: Optional[torch.Tensor] = None
        self._grads: dict[str, torch.Tensor] = {}
        self._autocast = autocast_state()  # the binding thread's: forward, backward under it

    def work(self, index: int, piece: Piece) -> Callable[[], Any]:
        compute = piece.name in (FORWARD, BACKWARD)
        return under_autocast(self._autocast if compute else NO_AUTOCAST,
                              {FORWARD: self._forward, BACKWARD: self._backward,
                               GRADS: self._add, ACCUMULATE: self._accumulate}[piece.name])

    def _forward(self) -> None:
        self._loss = self._loss_fn(self._run(*self._inputs), self._targets)

    def _backward(self) -> None:
        if not self._params:
            return
        loss = self._loss if self._scale is None else self._loss * self._scale
        grads = torch.autograd.grad(loss, list(self._params.values()), allow_unused=True)
        self._grads = {n: g for n, g in zip(self._params, grads) if g is not None}

    def _add(self) -> None:
        add_grads(self._params, {n: self._local.plus(self._params[n], g)
                                 for n, g in self._grads.items()})
        for _, param, left in self._local.drain():   # accumulated, unused in this call
            if param.requires_grad:
                accumulate_grad(param, left)

    def _accumulate(self) -> None:
        for n, g in self._grads.items():
            self._local.add(n, self._params[n], g)

    def loss(self) -> torch.Tensor:
        return self._loss.detach()


def lowered_graph(gm: fx.GraphModule, example_inputs: Any, lower: Optional[str]
                  ) -> Optional[torch.nn.Module]:
    """The lowered form of ``gm`` for ``compile(lower=...)``: ``"graphs"`` captured segments
    (``tidal.runtime.lower``), ``"none"`` None (the graph runs as it is); by default
    ``"graphs"`` on a GPU, ``"none"`` on the CPU. ``ValueError`` for another value, or for an
    example input on another device than the parameters (named)."""
    params = list(gm.parameters())
    if lower is None:
        lower = "graphs" if params and params[0].device.type == "cuda" else "none"
    if lower not in ("graphs", "none"):
        raise ValueError(f"compile(lower={lower!r}): use 'graphs' (captured segments) or 'none'")
    if lower == "none":
        return None
    from tidal.runtime.lower import lower as lower_graph

    _inputs_on_the_parameters_device(gm, example_inputs)
    return lower_graph(gm, example_inputs)


def _inputs_on_the_parameters_device(gm: fx.GraphModule, example_inputs: Any) -> None:
    """A ``ValueError`` naming the first example input on another device than the
    parameters (a capture would fail deep inside torch)."""
    params = list(gm.parameters())
    if not params:
        return
    where = params[0].device
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    for name, value in zip(names, bind_inputs(gm, example_inputs, "compile example_inputs")):
        if isinstance(value, torch.Tensor) and value.device != where:
            raise ValueError(f"compile: example input {name!r} is on {value.device}, the "
                             f"model's parameters on {where}: move it there "
                             f"({name}.to('{where}')) or the model to {value.device}")

"""Guards of a compiled model: what runs when the state a capture depends on has changed.

The compile traced the model in one state (``tidal.ir.step_state``: module ``training`` flags,
``requires_grad``, autocast, grad mode), and a plan's program captures its training step in
the state of its first step. At every call and step :class:`CaptureGuard` compares the state
now with those, and never runs a capture made in another state:

- **forward** (``compiled(x)``): in another training mode than the trace's, the model is traced
  again in the mode it is in now (once per mode, kept); when that trace differs from the
  compile's (a mode read at trace time: ``torch.export`` records dropout's flag,
  ``F.dropout(x, p, self.training)`` is a constant to fx), that graph runs, after a plan's
  stale copies are brought up to date (``burst_parallel``: a collective), so
  ``compiled.eval()`` gives eval semantics (no dropout, BatchNorm's running statistics) under
  every plan; when it is the same, the compiled forward runs (its modules read the mode). The
  ``clustered_attention`` plan (CHAI), whose rewritten forward *is* the compiled graph,
  raises instead. Under an autocast other than the trace's, a lowered graph
  (captured segments) runs uncaptured (the graph itself honours autocast);
- **step** with no plan (the graph runs as it is, with autograd): as the forward; autograd
  honours ``requires_grad``, autocast and grad mode itself;
- **step** under a plan's program: the first step fixes the state the program captured; a
  later change of ``training`` flags or ``requires_grad`` (freezing, unfreezing,
  ``model.eval()``) re-captures: the rank program is built again for the new state
  (``recapture``, given by ``Compiled``: it carries over what the old program holds beside
  the model and the optimizer, ``runtime_state``/``load_runtime_state``) and kept, at most
  :data:`MAX_CAPTURES` of them, so going back to an earlier state runs its program again;
  one line on stderr says so for each new state (``tidal: <plan>: re-capturing the step:
  <what changed>``). It raises :class:`StepGuardError` naming what changed where a
  re-capture cannot be right: a training mode whose trace differs from the compile's (the
  plan was made on the compile's graph), grad mode off, modules or parameters replaced, a
  change inside a ``no_sync`` accumulation. Autocast: a rank program whose
  ``recaptures_autocast`` is true captures its step once per autocast state and runs its eager
  pieces under the autocast of the thread that bound the step
  (``tidal.runtime.programs.piece_autocast``), so a step inside ``torch.autocast`` computes as
  the eager step would, and an autocast change between steps is no change of state for it;
  a program whose ``recaptures_autocast`` is not true raises inside ``torch.autocast``,
  naming its plans (its pieces would silently compute in the parameters' dtype). The values ``loss_fn`` reads besides its
  arguments (globals, closure variables, its object's attributes) are watched too: the
  program traced ``loss_fn`` at the first step, so a later change raises naming the variable
  (``tidal.compiler.loss_watch``).

Example:
    >>> import torch, tidal
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    >>> c = tidal.compile(model, (torch.randn(2, 4),))
    >>> x = torch.randn(2, 4)
    >>> torch.equal(c.eval()(x), model(x))   # eval: no dropout, as the model
    True
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

import sys

import torch
import torch.fx as fx

from tidal.compiler.loss_watch import changed_reads, loss_reads
from tidal.ir.errors import TidalError
from tidal.ir.step_state import StepState, state_changes, step_state

FORWARD_PLANS = ("clustered_attention",)
"""Plans whose rewritten forward is the compiled graph itself (a re-trace would drop it)."""

MAX_CAPTURES = 4
"""Rank programs a guard keeps, one per step state (the latest used; never the one in use)."""

Recapture = Callable[[Any, Optional[Any], str], Any]
"""``(program in use, the new state's kept program or None, where) -> the program to run``:
builds (or takes the kept one), carries the old one's runtime state over and installs it."""


class StepGuardError(TidalError, RuntimeError):
    """A step or call in a state its capture was not made in (the message says what changed
    and what to do)."""


class CaptureGuard:
    """The guards of one compiled model (see the module docstring): ``gm`` the compiled graph,
    ``example_inputs`` what it was traced on, ``plans`` the names of the plans it runs,
    ``program`` the rank program of a plan that runs the steps (None: the graph as it is runs
    them; its ``recaptures_autocast``, see the module docstring); ``recapture`` switches the
    program to a new step state (:data:`Recapture`; None: a change of state raises)."""

    def __init__(self, model: torch.nn.Module, gm: fx.GraphModule, example_inputs: Any,
                 plans: tuple[str, ...], program: Any, traced: Optional[fx.Graph] = None,
                 refresh: Optional[Callable[[fx.GraphModule], None]] = None,
                 loss_fn: Optional[Callable] = None, recapture: Optional[Recapture] = None):
        self.model, self.gm, self.example_inputs = model, gm, example_inputs
        self.plans, self.program = plans, program
        self.traced: StepState = step_state(model, named=True)
        self.first_step: Optional[StepState] = None
        self.current: Optional[StepState] = None
        """The state the program in use captured (named)."""
        self._recapture = recapture
        self._programs: dict[StepState, Any] = {}  # by state, the latest used last
        self._trace_code = _code(traced) if traced is not None else None
        self._refresh = refresh
        self.loss_fn = loss_fn
        self._loss_reads: dict[str, Any] = {}
        self._graphs: dict[tuple[bool, ...], Optional[fx.GraphModule]] = {}

    def forward_graph(self, lowered: bool, now: Optional[StepState] = None
                      ) -> Optional[fx.GraphModule]:
        """The graph a forward must run now instead of the compiled one (None: the compiled
        one is right). ``lowered``: the compiled forward runs captured segments; ``now``: the
        state, when read already."""
        now = step_state(self.model) if now is None else now
        graph = self._retraced(now) if now.training != self.traced.training else None
        if graph is not None:
            forward_plans = [p for p in self.plans if p in FORWARD_PLANS]
            if forward_plans:
                raise StepGuardError(self._message(
                    "Compiled.__call__", now,
                    f"the {forward_plans[0]} plan rewrote the forward in the mode it was "
                    f"compiled in: put the model back in that mode, or compile it again in "
                    f"this one"))
            if self._refresh is not None:
                self._refresh(self.gm)
            return graph
        if lowered and now.autocast != self.traced.autocast:
            return self.gm
        return None

    def step_graph(self, lowered: bool, where: str = "Compiled.step"
                   ) -> Optional[fx.GraphModule]:
        """The graph a step must run now instead of the compiled one (None: the compiled one
        is right, or a program runs the step); raises :class:`StepGuardError` when a plan's
        program would run in a state other than the one it captured."""
        now = step_state(self.model)
        if self.program is None:   # autograd follows the state; a step drops frozen grads
            if self.current is not None and now.requires_grad != self.current.requires_grad \
                    and self._recapture is not None:
                self._recapture(None, None, where)
            self.current = now
            return self.forward_graph(lowered, now)
        if now.training != self.traced.training and self._retraced(now) is not None:
            raise StepGuardError(self._message(
                where, now, "the plan was made on the graph traced in the compile's mode, and "
                "the model traces to another graph in this one (a mode read at trace time): "
                "call model.train() (or .eval()) before tidal.compile, to compile the model "
                "in the mode it trains in", self.traced))
        recaptures = bool(getattr(self.program, "recaptures_autocast", False))
        autocast = [f"autocast({d}, {dt})" for d, on, dt in now.autocast if on]
        if autocast and not recaptures:
            raise StepGuardError(
                f"{where}: {autocast[0]} is on, and the program of "
                f"{', '.join(self.plans) or 'the plan'} does not run its captured pieces under "
                f"autocast yet (they would silently compute in the parameters' dtype): step "
                f"outside autocast, or compile without {', '.join(self.plans) or 'the plan'} "
                f"(no pass, compression, burst_parallel, tick_tock and round_robin run under "
                f"autocast)")
        self._check_loss_fn(where)
        if recaptures:  # captured once per autocast state: a change of it is no change
            now = replace(now, autocast=())
        if self.first_step is None:
            self.first_step = self.current = self._named(now)
            self._programs[now] = self.program
        elif now != self.current:
            self._switch(now, where)
        return None

    def _named(self, now: StepState) -> StepState:
        """``now`` with its module and parameter names (read again: a rare call)."""
        named = step_state(self.model, named=True)
        return replace(named, autocast=now.autocast)

    def _switch(self, now: StepState, where: str) -> None:
        """Run the program of state ``now``: the one kept for it, or a new capture (one line
        on stderr says what changed); raises :class:`StepGuardError` where a re-capture
        cannot be right (the module docstring)."""
        named = self._named(now)
        changes = state_changes(self.current, named)
        fix = self._refusal(now, changes)
        if fix:
            raise StepGuardError(self._message(where, named, fix, self.current))
        kept = self._programs.get(now)
        self.program = self._recapture(self.program, kept, where)
        if kept is None:
            print(f"tidal: {', '.join(self.plans)}: re-capturing the step: "
                  f"{'; '.join(changes)}", file=sys.stderr)
        self._programs.pop(now, None)
        self._programs[now] = self.program
        self.current = named
        while len(self._programs) > MAX_CAPTURES:   # the oldest first; never ``now``'s
            del self._programs[next(iter(self._programs))]

    def _refusal(self, now: StepState, changes: list[str]) -> str:
        """What to do instead, where a program cannot be re-captured for ``now`` ('' when
        it can)."""
        if self._recapture is None:
            return ("train in the state of the first step (freeze parameters before it), or "
                    "compile the model again")
        if changes == ["the model's modules or parameters were replaced"]:
            return ("the plan was made on the compiled modules and parameters: compile the "
                    "model again")
        if not now.grad_enabled:
            return "a training step needs grad mode: step outside torch.no_grad()"
        if _accumulating(self.program):
            return ("gradients accumulated inside no_sync() belong to the old state's "
                    "trainable parameters: keep the state the same over an accumulation")
        return ""

    def _check_loss_fn(self, where: str) -> None:
        """The values ``loss_fn`` reads besides its arguments are those of the first step
        (the program traced it then: ``tidal.compiler.loss_watch``); else raise naming them."""
        if self.loss_fn is None:
            return
        if self.first_step is None:
            self._loss_reads = loss_reads(self.loss_fn)
            return
        changed = changed_reads(self.loss_fn, self._loss_reads)
        if changed:
            raise StepGuardError(
                f"{where}: loss_fn reads {', '.join(changed)}, which changed since the first "
                f"step; the program of {', '.join(self.plans)} traced loss_fn then and would "
                f"keep the old value: pass what changes as an input or target, or compile "
                f"without a parallelism or compression pass (loss_fn then runs every step)")

    def _retraced(self, now: StepState) -> Optional[fx.GraphModule]:
        """The model traced again in its current training mode (kept per mode), or None when
        that trace is the compile's own (the graph reads the modes when it runs: the modules
        whose behaviour depends on them are called, not inlined). Before a re-traced graph
        runs, a plan's stale copies are brought up to date (``refresh``: a collective)."""
        from tidal.ir.capture import trace

        if now.mode_key not in self._graphs:
            graph = trace(self.model, self.example_inputs)
            same = self._trace_code is not None and _code(graph.graph) == self._trace_code
            self._graphs[now.mode_key] = None if same else graph
        return self._graphs[now.mode_key]

    def _message(self, where: str, now: StepState, fix: str,
                 before: Optional[StepState] = None) -> str:
        changes = state_changes(before or self.traced, now)
        plans = ", ".join(self.plans) or "no plan"
        return (f"{where}: the state the capture ({plans}) was made in changed: "
                f"{'; '.join(changes)}. {fix}")


def _accumulating(program: Any) -> bool:
    """Whether ``program`` holds gradients a ``no_sync`` accumulation left to sync (its
    ``local_grads``: one ``LocalGrads``, or one per wave)."""
    held = getattr(program, "local_grads", None)
    parts = held.values() if isinstance(held, dict) else () if held is None else (held,)
    return any(len(part) for part in parts)


def _code(graph: fx.Graph) -> str:
    """The Python code of ``graph`` (two traces of one model in two modes are the same graph
    when their code is the same)."""
    return graph.python_code("self").src

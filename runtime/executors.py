"""Executors from plans: passes emit ``(graph, Plan)``; the runtime decides how a plan runs.

Every plan kind with a program builder (a row of ``tidal.runtime.programs.BUILDERS``, the
registry of builders by the plan's registered kind name, ``tidal.ir.plan.plan_kind``) runs as
that builder's rank program in the one :class:`~tidal.runtime.program.ProgramExecutor`.
:func:`build` walks the plans of a compile in pass order: a parallelism plan gives the executor, and a
``CompressionPlan`` that wraps one changes its gradient sync
(``tidal.runtime.programs.compression.compression_executor``); alone, a ``CompressionPlan`` is
data parallelism, compressed or not (``tidal.runtime.programs.data_parallel``). Plans with no
builder (CHAI's, a layer-group plan without a weight store) leave the graph to run as it is,
through the same executor (``tidal.runtime.programs.graph``).
The runtime never imports a pass: a plan is read by its fields.

Example:
    >>> import torch, tidal
    >>> from tidal.runtime import executors
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> c = tidal.compile(model, (torch.randn(4, 8),), passes=["compression"],
    ...                   loss_fn=torch.nn.functional.cross_entropy,
    ...                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    >>> ex = executors.build(c.graph_module, [p for _, p in c.plan.passes])
    >>> type(ex).__name__, type(ex.rank_program).__name__
    ('ProgramExecutor', 'DataParallelProgram')
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from tidal.ir.pass_api import Executor
from tidal.ir.plan import Plan, plan_kind
from tidal.runtime.program import ProgramExecutor
from tidal.runtime.programs import BUILDERS
from tidal.runtime.programs.compression import PLAN_KIND as COMPRESSION
from tidal.runtime.programs.compression import compression_executor
from tidal.runtime.programs.graph import GraphProgram


def build(gm: fx.GraphModule, plans: Sequence[Plan],
          lowered: Optional[torch.nn.Module] = None) -> Executor:
    """The executor for ``plans`` (in pass order) on the final graph ``gm``: each plan with a
    builder gives its rank program in a ``ProgramExecutor`` (a builder may return None:
    nothing to run differently); when none does, the graph runs as it is
    (``tidal.runtime.programs.graph.GraphProgram``, on ``lowered``, the graph's lowered form,
    when given). Only the builders of the kinds in ``plans`` are imported."""
    executor: Optional[Executor] = None
    for plan in plans:
        kind = plan_kind(type(plan))
        if kind == COMPRESSION and plan.wraps is not None:  # the sync of the pass it names
            executor = compression_executor(plan, executor)
        elif kind in BUILDERS:
            rank_program = BUILDERS.get(kind)(gm, plan)
            executor = executor if rank_program is None else ProgramExecutor(rank_program)
    return executor if executor is not None else ProgramExecutor(GraphProgram(lowered, gm))


def weight_streaming(gm: fx.GraphModule, plan: Plan, path: Any,
                     device: Optional[torch.device] = None) -> ProgramExecutor:
    """The executor of a ``layer_groups`` plan whose weights stream in from the store at
    ``path`` onto ``device`` (by default where ``gm``'s parameters are), built by the plan
    kind's builder: its first forward is a cold start (``Compiled.cold_start``)."""
    plan = dataclasses.replace(plan, weight_store=str(path))
    return ProgramExecutor(BUILDERS.get(plan_kind(type(plan)))(gm, plan, device=device))

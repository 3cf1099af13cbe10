"""Executors from plans: passes emit ``(graph, Plan)``; the runtime decides how a plan runs.

``BUILDERS`` maps a plan's registered kind name (``tidal.ir.plan.plan_kind``) to the function
that builds its executor from the transformed graph and the plan. :func:`build` walks the plans
of a compile in pass order: a parallelism plan gives the executor, and a ``CompressionPlan``
after one wraps its gradient sync (alone, it trains data parallel with compressed gradients; with
compression off, as a program whose all-reduces overlap backward,
``tidal.runtime.program.DataParallelProgram``).
Plans with no builder (CHAI's, a layer-group plan without a weight store) leave the graph to
run as it is. The runtime never imports a pass: a plan is read by its fields.

Example:
    >>> import torch, tidal
    >>> from tidal.runtime import executors
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> c = tidal.compile(model, (torch.randn(4, 8),), passes=["burst_parallel"],
    ...                   cluster=tidal.Cluster(gpus=2), loss_fn=torch.nn.functional.cross_entropy,
    ...                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    >>> type(executors.build(c.graph_module, [p for _, p in c.plan.passes])).__name__
    'BurstExecutor'
"""
from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any, Callable, Optional, Sequence

import torch.fx as fx

from tidal.ir.pass_api import Executor
from tidal.ir.plan import Plan, plan_kind
from tidal.runtime.data_parallel import compression_executor
from tidal.runtime.program import ProgramExecutor
from tidal.runtime.programs import builders
from tidal.runtime.programs.data_parallel import DataParallelProgram

Builder = Callable[[fx.GraphModule, Any], Optional[Executor]]

_LEGACY: "MappingProxyType[str, str]" = MappingProxyType({
    "BurstPlan": "tidal.runtime.burst_exec",
    "TickTockPlan": "tidal.runtime.wave_exec",
    "RoundRobinPlan": "tidal.runtime.round_robin_exec",
    "LayerGroupPlan": "tidal.runtime.weight_loader",
})
"""Plan kind -> the module of the executor that runs it while it has no program builder
(``tidal.runtime.programs``) yet."""


def _builder(kind: str) -> Optional[Builder]:
    found = builders()
    if kind in found:
        return lambda gm, plan: _as_executor(found[kind](gm, plan))
    if kind in _LEGACY:
        return importlib.import_module(_LEGACY[kind]).from_plan
    return None


def _as_executor(rank_program: Any) -> Optional[Executor]:
    return None if rank_program is None else ProgramExecutor(rank_program)

COMPRESSION = "CompressionPlan"


def build(gm: fx.GraphModule, plans: Sequence[Plan]) -> Optional[Executor]:
    """The executor for ``plans`` (in pass order) on the final graph ``gm``, or None when the
    graph runs as it is."""
    executor: Optional[Executor] = None
    for plan in plans:
        kind = plan_kind(type(plan))
        if kind == COMPRESSION and _plain_data_parallel(plan):
            executor = DataParallelProgram(plan.bucket_bytes,
                                           fallback=compression_executor(plan, None))
        elif kind == COMPRESSION:  # wraps the sync of the parallelism plan it names, if any
            executor = compression_executor(plan, executor if plan.wraps else None)
        elif _builder(kind) is not None:
            executor = _builder(kind)(gm, plan) or executor
    return executor


def _plain_data_parallel(plan: Any) -> bool:
    """A compression plan that is plain data parallelism (compression off, nothing wrapped):
    it runs as a program (``tidal.runtime.program``), all-reduces overlapping backward."""
    return not plan.enabled and plan.wraps is None

"""Program builders, one module per plan kind.

A builder module declares ``PLAN_KIND`` (the plan's registered kind name,
``tidal.ir.plan.plan_kind``) and ``from_plan(gm, plan)``, which returns the rank program
(``tidal.runtime.program.RankProgram``) that :class:`~tidal.runtime.program.ProgramExecutor`
runs. :data:`BUILDERS` is their registry (``tidal.ir.registry.Registry``): plan kind ->
``from_plan``, each module imported when its kind is first looked up. A new plan kind is one new
module here and one row in ``BUILDERS``.

Example:
    >>> from tidal.runtime.programs import BUILDERS, builders
    >>> "BurstPlan" in BUILDERS, BUILDERS.get("BurstPlan").__module__
    (True, 'tidal.runtime.programs.burst')
    >>> "BurstPlan" in builders()
    True
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from tidal.ir.registry import Entry, Registry

Builder = Callable[[fx.GraphModule, Any], Any]

BUILDERS: Registry[Builder] = Registry("program builder", (
    Entry("BurstPlan", "tidal.runtime.programs.burst:from_plan"),
    Entry("TickTockPlan", "tidal.runtime.programs.tick_tock:from_plan"),
    Entry("RoundRobinPlan", "tidal.runtime.programs.round_robin:from_plan"),
    Entry("CompressionPlan", "tidal.runtime.programs.compression:from_plan"),
    Entry("LayerGroupPlan", "tidal.runtime.programs.layer_groups:from_plan"),
))
"""Plan kind -> the ``from_plan`` of the module that builds its program."""


def builders() -> dict[str, Builder]:
    """Plan kind -> the ``from_plan`` of the module that builds its program (every builder
    module imported)."""
    return dict(BUILDERS.items())

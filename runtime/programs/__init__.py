"""Program builders, one module per plan kind.

A builder module declares ``PLAN_KIND`` (the plan's registered kind name,
``tidal.ir.plan.plan_kind``) and ``from_plan(gm, plan)``, which returns the rank program
(``tidal.runtime.program.RankProgram``) that :class:`~tidal.runtime.program.ProgramExecutor`
runs. :func:`builders` finds them (every module of this package that declares a kind), so a new
plan kind is one new module here.

Example:
    >>> from tidal.runtime.programs import builders
    >>> "BurstPlan" in builders()
    True
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable

import torch.fx as fx

Builder = Callable[[fx.GraphModule, Any], Any]


def builders() -> dict[str, Builder]:
    """Plan kind -> the ``from_plan`` of the module that builds its program."""
    found: dict[str, Builder] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        kind = getattr(module, "PLAN_KIND", None)
        if kind is not None:
            if kind in found:
                raise RuntimeError(f"two program builders for plan kind {kind!r}")
            found[kind] = module.from_plan
    return found

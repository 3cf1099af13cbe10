"""Pass manager: orders the selected passes, runs each with its checks, and records what it did.

After every pass the graph is linted, ``requires``/``ensures`` are checked, nodes the pass
added are marked (``tidal.ir.meta.set_added_by``), and a ``PassRecord`` keeps the wall time,
node counts, added/removed node names, the plan, notes, artifacts, and snapshots of the graph
before and after (for dumps).

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir.pass_api import Pass, PassContext, PassResult
    >>> from tidal.compiler.pass_manager import run_passes
    >>> class Noop(Pass):
    ...     '''Does nothing.'''
    ...     name = "noop"
    ...     def __call__(self, gm, ctx):
    ...         return PassResult(gm)
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> gm, records = run_passes(gm, [Noop()], PassContext.for_inputs((torch.randn(1, 2),)))
    >>> records[0].name, records[0].nodes_before, records[0].added
    ('noop', 3, ())
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch.fx as fx

from tidal.ir import meta
from tidal.ir.errors import PassError
from tidal.ir.pass_api import Pass, PassContext, PassResult
from tidal.ir.plan import Plan


@dataclass(frozen=True)
class PassRecord:
    """What one pass (or compile stage such as tracing) did."""

    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    plan: Optional[Plan] = None
    notes: tuple[str, ...] = ()
    artifacts: Mapping[str, str] = field(default_factory=dict)
    graph_before: Optional[fx.Graph] = field(default=None, repr=False, compare=False)
    graph_after: Optional[fx.Graph] = field(default=None, repr=False, compare=False)


def snapshot(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with the same node names and (shallow-copied) node meta."""
    copy = fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy


def order_passes(passes: Sequence[Pass]) -> list[Pass]:
    """Order passes so each runs after the passes it names in ``after`` and before those in
    ``before`` (constraints on unselected passes are ignored); otherwise keep the given order.
    Raises ``PassError`` for a duplicate pass or contradictory constraints."""
    names = [p.name for p in passes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise PassError(f"pass {dupes[0]!r} is selected more than once")
    index = {p.name: i for i, p in enumerate(passes)}
    deps: dict[str, set[str]] = {p.name: set() for p in passes}
    for p in passes:
        deps[p.name] |= {a for a in p.after if a in index}
        for b in p.before:
            if b in index:
                deps[b].add(p.name)
    ordered: list[Pass] = []
    done: set[str] = set()
    while len(ordered) < len(passes):
        ready = [p for p in passes if p.name not in done and deps[p.name] <= done]
        if not ready:
            stuck = sorted(set(names) - done)
            raise PassError(f"passes {stuck} have contradictory after/before constraints")
        ordered.append(ready[0])
        done.add(ready[0].name)
    return ordered


def _lint(p: Pass, gm: fx.GraphModule) -> None:
    try:
        gm.graph.lint()
        gm.recompile()
    except Exception as e:
        raise PassError(f"pass {p.name!r} produced an invalid graph: {e}") from e


def run_pass(gm: fx.GraphModule, p: Pass, ctx: PassContext) -> tuple[fx.GraphModule, PassRecord]:
    """Run one pass with its checks; return the new graph module and the record."""
    before = snapshot(gm.graph)
    names_before = {n.name for n in gm.graph.nodes}
    p.requires(gm, ctx)
    t0 = time.perf_counter()
    result = p(gm, ctx)
    seconds = time.perf_counter() - t0
    if not isinstance(result, PassResult):
        raise PassError(f"pass {p.name!r} returned {type(result).__name__}, not a PassResult")
    new_gm = result.gm
    _lint(p, new_gm)
    p.ensures(new_gm, ctx, result)
    names_after = [n.name for n in new_gm.graph.nodes]
    added = tuple(n for n in names_after if n not in names_before)
    for n in new_gm.graph.nodes:
        if n.name in added and meta.get_added_by(n) is None:
            meta.set_added_by(n, p.name)
    removed = tuple(sorted(names_before - set(names_after)))
    if result.plan is not None:
        ctx.plans[p.name] = result.plan
    record = PassRecord(
        name=p.name, seconds=seconds, nodes_before=len(names_before),
        nodes_after=len(names_after), added=added, removed=removed, plan=result.plan,
        notes=tuple(result.notes), artifacts=dict(result.artifacts),
        graph_before=before, graph_after=snapshot(new_gm.graph),
    )
    return new_gm, record


def run_passes(gm: fx.GraphModule, passes: Sequence[Pass], ctx: PassContext
               ) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Order and run ``passes`` on ``gm``; return the final graph module and one record each."""
    records = []
    for p in order_passes(passes):
        ctx.log(f"running pass {p.name}")
        gm, record = run_pass(gm, p, ctx)
        records.append(record)
    return gm, records

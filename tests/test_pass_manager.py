"""Pass manager: ordering, checks, lint, records."""
import pytest
import torch

import tidal
from tidal.ir.capture import trace
from tidal.compiler.pass_manager import order_passes, run_passes
from tidal.ir import meta, ops
from tidal.ir.pass_api import Pass, PassContext, PassResult


def _pass(name, after=(), before=(), fn=None, requires=None):
    def call(self, gm, ctx):
        return fn(gm, ctx) if fn else PassResult(gm)

    attrs = {"name": name, "after": tuple(after), "before": tuple(before), "__call__": call,
             "__doc__": f"toy pass {name}"}
    if requires:
        attrs["requires"] = lambda self, gm, ctx: requires(self)
    return type(f"P_{name}", (Pass,), attrs)()


def test_order_respects_after_and_before_and_keeps_given_order_otherwise():
    a, b, c, d = _pass("a", after=["c"]), _pass("b"), _pass("c"), _pass("d", before=["b"])
    assert [p.name for p in order_passes([a, b, c, d])] == ["c", "a", "d", "b"]
    assert [p.name for p in order_passes([_pass("x", after=["missing"])])] == ["x"]


def test_order_errors():
    with pytest.raises(tidal.PassError, match="contradictory"):
        order_passes([_pass("a", after=["b"]), _pass("b", after=["a"])])
    with pytest.raises(tidal.PassError, match="more than once"):
        order_passes([_pass("a"), _pass("a")])


def _boundary_pass(gm, ctx):
    first = next(n for n in gm.graph.nodes if n.op == "call_module")
    with gm.graph.inserting_before(first):
        gm.graph.call_function(ops.GROUP_BOUNDARY, (0,))
    return PassResult(gm, notes=("one boundary",))


def test_records_added_nodes_and_marks_them():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    x = torch.randn(2, 3)
    gm = trace(model, (x,))
    gm, (rec,) = run_passes(gm, [_pass("mark", fn=_boundary_pass)], PassContext.for_inputs((x,)))
    assert rec.added == ("group_boundary_default",) and rec.removed == ()
    assert (rec.nodes_before, rec.nodes_after) == (3, 4) and rec.seconds >= 0
    node = next(n for n in gm.graph.nodes if n.target is ops.GROUP_BOUNDARY)
    assert meta.get_added_by(node) == "mark"
    assert len(rec.graph_before.nodes) == 3 and len(rec.graph_after.nodes) == 4
    torch.testing.assert_close(gm(x), model(x))


def test_invalid_graph_is_a_pass_error_naming_the_pass():
    def broken(gm, ctx):
        lin = next(n for n in gm.graph.nodes if n.op == "call_module")
        first = next(iter(gm.graph.nodes))
        with gm.graph.inserting_before(first):  # uses lin's value before it is computed
            gm.graph.call_function(torch.relu, (lin,))
        return PassResult(gm)

    gm = trace(torch.nn.Sequential(torch.nn.Linear(3, 3)), (torch.randn(1, 3),))
    with pytest.raises(tidal.PassError, match="'broken'"):
        run_passes(gm, [_pass("broken", fn=broken)], PassContext.for_inputs((torch.randn(1, 3),)))


def test_requires_failure_stops_before_running():
    ran = []

    def fn(gm, ctx):
        ran.append(1)
        return PassResult(gm)

    p = _pass("needy", fn=fn, requires=lambda self: self.fail("needs a loss function"))
    gm = trace(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(tidal.PassError, match="'needy': needs a loss"):
        run_passes(gm, [p], PassContext.for_inputs((torch.randn(1, 2),)))
    assert ran == []


def test_returning_something_else_is_an_error():
    p = _pass("lazy", fn=lambda gm, ctx: gm)
    gm = trace(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(tidal.PassError, match="not a PassResult"):
        run_passes(gm, [p], PassContext.for_inputs((torch.randn(1, 2),)))


def test_plans_reach_later_passes_and_compiled_plan(tmp_path):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Groups(tidal.Plan):
        sizes: tuple[int, ...]

    seen = {}

    def first(gm, ctx):
        return PassResult(gm, plan=Groups((2, 1)))

    def second(gm, ctx):
        seen.update(ctx.plans)
        return PassResult(gm)

    model, x = torch.nn.Sequential(torch.nn.Linear(3, 3)), torch.randn(2, 3)
    compiled = tidal.compile(model, x, passes=[_pass("second", after=["first"], fn=second),
                                               _pass("first", fn=first)])
    assert seen == {"first": Groups((2, 1))}
    assert compiled.plan.get("first") == Groups((2, 1))

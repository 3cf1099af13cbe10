"""Bad input that used to pass silently or crash without a name (issue 35 items 8 and 9):
plan JSON (deep nesting, NaN/Infinity, unknown fields, a pass paired with another pass's plan
kind, huge echoed values, a plan for another world size) and training data (an empty global
batch; a non-finite loss under ``compile(check_finite=True)``). One process."""
import json

import pytest
import torch

import tidal
from tidal.compiler.api import check_world
from tidal.compiler.pass_manager import PassRecord
from tidal.compiler.step_checks import NonFiniteLossError
from tidal.ir.errors import PlanError, TidalError
from tidal.ir.plan import CompiledPlan, Plan
from tidal.ir.plans.burst import BurstPlan
from tidal.passes.burst_parallel import BurstParallel
from tidal.runtime.batch_data import BatchError
from training_passes import TRAINING_PASSES


def _burst_plan(world=2):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    c = tidal.compile(model, (torch.randn(4, 8),), passes=["burst_parallel"],
                      cluster=tidal.Cluster(gpus=world),
                      loss_fn=torch.nn.functional.cross_entropy,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    return c


# ---- item 8: plans ----------------------------------------------------------------------

def test_deeply_nested_plan_json_is_a_plan_error_not_a_recursion_error():
    for depth in (100, 100_000):
        with pytest.raises(PlanError, match="nests deeper than"):
            Plan.from_json("[" * depth + "]" * depth)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_in_a_plan_are_refused(token):
    text = _burst_plan().plan.get("burst_parallel").to_json()
    data = json.loads(text)
    data["data"]["time_us"] = "@"
    with pytest.raises(PlanError, match="finite"):
        BurstPlan.from_json(json.dumps(data).replace('"@"', token))


def test_unknown_fields_are_named():
    plan = _burst_plan().plan.get("burst_parallel")
    data = json.loads(plan.to_json())
    data["data"]["wrold"] = 4
    with pytest.raises(PlanError, match="unknown field.*'wrold'"):
        BurstPlan.from_json(json.dumps(data))
    data = json.loads(plan.to_json())
    data["data"]["layers"][0]["gpu"] = 2
    with pytest.raises(PlanError, match=r"layers\[0\].*unknown field.*'gpu'"):
        BurstPlan.from_json(json.dumps(data))
    data = json.loads(plan.to_json())
    data["extra"] = 1
    with pytest.raises(PlanError, match="unknown field.*'extra'"):
        BurstPlan.from_json(json.dumps(data))
    assert BurstPlan.from_json(plan.to_json()) == plan      # the round trip still holds


def test_a_pass_paired_with_another_pass_plan_kind_is_refused():
    compiled = _burst_plan()
    text = compiled.plan.to_json()
    assert CompiledPlan.from_json(text) == compiled.plan
    with pytest.raises(PlanError, match="a BurstPlan is made by pass 'burst_parallel'.*'tick_tock'"):
        CompiledPlan.from_json(text.replace('"burst_parallel"', '"tick_tock"'))


def test_a_huge_kind_is_not_echoed_whole():
    huge = "K" * 5_000_000
    for text in (json.dumps({"kind": huge, "data": {}}),
                 json.dumps({"kind": "BurstPlan", "data": {"world": huge}})):
        with pytest.raises(PlanError) as info:
            Plan.from_json(text)
        assert len(str(info.value)) < 2000 and "5000002 characters" in str(info.value)
    with pytest.raises(PlanError, match="not valid"):
        Plan.from_json("1" * 10_000)         # more digits than Python converts


def test_burst_parallel_plan_option_goes_through_the_checked_loader():
    text = _burst_plan().plan.get("burst_parallel").to_json()
    with pytest.raises(PlanError, match="finite"):
        BurstParallel(plan=text.replace('"time_us": ', '"time_us": NaN, "x": ', 1))


def test_a_plan_for_another_world_size_is_a_plan_error_at_compile(monkeypatch):
    records = [PassRecord("burst_parallel", 0.0, 1, 1,
                          plan=_burst_plan(world=4).plan.get("burst_parallel"))]
    check_world(records)                                   # no process group: nothing to check
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(PlanError, match="plan is for 4 GPUs but the job has 2 ranks"):
        check_world(records)
    check_world([PassRecord("burst_parallel", 0.0, 1, 1,
                            plan=_burst_plan(world=2).plan.get("burst_parallel"))])


# ---- item 9: empty batches and non-finite losses -----------------------------------------

def _training(passes, check_finite=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 1])
    c = tidal.compile(model, (x,), passes=passes, loss_fn=torch.nn.functional.cross_entropy,
                      optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1),
                      check_finite=check_finite)
    return model, c, x, y


@pytest.mark.parametrize("name", sorted(TRAINING_PASSES))
def test_an_empty_global_batch_is_an_error_under_every_pass(name):
    model, c, x, y = _training(TRAINING_PASSES[name]())
    c.step(x, y)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for call in (c.step, c.backward):
        with pytest.raises(BatchError, match=f"Compiled.{call.__name__}: the global batch is "
                                             f"empty"):
            call(x[:0], y[:0])
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    assert torch.isfinite(c.step(x, y))                      # and training goes on


@pytest.mark.parametrize("name", sorted(TRAINING_PASSES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_stops_the_step_with_parameters_untouched(name, bad):
    model, c, x, y = _training(TRAINING_PASSES[name](), check_finite=True)
    assert torch.isfinite(c.step(x, y))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)}
             for k, s in c.optimizer.state_dict()["state"].items()}
    poisoned = x.clone()
    poisoned[1, 2] = bad
    with pytest.raises(NonFiniteLossError, match="loss of step 2 is nan") as info:
        c.step(poisoned, y)
    assert isinstance(info.value, TidalError) and info.value.step == 2
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    for k, s in c.optimizer.state_dict()["state"].items():
        for n, t in state[k].items():
            torch.testing.assert_close(s[n], t, rtol=0, atol=0, msg=f"{k}.{n}")
    assert torch.isfinite(c.step(x, y))                      # the next good step trains


def test_backward_names_the_step_of_a_non_finite_loss_before_the_optimizer():
    model, c, x, y = _training([], check_finite=True)
    c.backward(x, y)
    poisoned = x.clone()
    poisoned[0, 0] = float("nan")
    weight = model[0].weight.detach().clone()
    with pytest.raises(NonFiniteLossError, match="Compiled.backward: the loss of step 2"):
        c.backward(poisoned, y)
    torch.testing.assert_close(model[0].weight, weight, rtol=0, atol=0)


def test_without_check_finite_a_nan_loss_trains_as_pytorch_does():
    model, c, x, y = _training([])
    poisoned = x.clone()
    poisoned[0, 0] = float("nan")
    assert torch.isnan(c.step(poisoned, y))
    with pytest.raises(TypeError, match="check_finite"):
        tidal.compile(model, (x,), check_finite="yes")

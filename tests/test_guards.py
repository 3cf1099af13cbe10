"""Guards: a call or step in another state than its capture's re-traces or raises, never runs
the old capture; ``Compiled`` behaves like a module where users expect one."""
import copy

import pytest
import torch
import torch.nn.functional as F

import tidal
from tidal.compiler.guards import CaptureGuard, StepGuardError


class FunctionalDropout(torch.nn.Module):
    """``F.dropout(..., self.training)``: an fx trace records the flag as a constant."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.b(F.dropout(torch.relu(self.a(x)), 0.5, self.training))


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


@pytest.mark.parametrize("passes", [[], ["compression"]])
def test_eval_forward_has_eval_semantics(passes):
    torch.manual_seed(0)
    model = FunctionalDropout()
    x, y = _data()
    c = tidal.compile(model, (x,), passes=passes, loss_fn=F.cross_entropy, optimizer=_sgd)
    assert c.eval() is c and not c.training and not model.training
    torch.testing.assert_close(c(x), model(x), rtol=0, atol=0)   # no dropout
    c.train()
    assert model.training


def test_a_step_without_plans_follows_the_mode_and_freezing():
    torch.manual_seed(0)
    model = FunctionalDropout()
    ref = copy.deepcopy(model)
    x, y = _data()
    c = tidal.compile(model, (x,), loss_fn=F.cross_entropy, optimizer=_sgd)
    opt = _sgd(ref.parameters())
    for mode, frozen in ((False, False), (False, True)):
        c.train(mode)
        ref.train(mode)
        model.a.weight.requires_grad_(not frozen)
        ref.a.weight.requires_grad_(not frozen)
        loss = c.step((x,), y)
        opt.zero_grad()
        want = F.cross_entropy(ref(x), y)
        want.backward()
        opt.step()
        torch.testing.assert_close(loss, want.detach(), rtol=0, atol=1e-7)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_a_program_step_in_another_state_recaptures_or_raises_naming_what_changed():
    """Freezing re-captures (tests/test_recapture.py compares it with eager); a training mode
    whose trace differs from the compile's raises, naming the change and why."""
    torch.manual_seed(0)
    model = FunctionalDropout()
    x, y = _data()
    c = tidal.compile(model, (x,), passes=["compression"], loss_fn=F.cross_entropy,
                      optimizer=_sgd)
    c.step((x,), y)
    model.a.weight.requires_grad_(False)
    frozen = model.a.weight.detach().clone()
    c.step((x,), y)
    assert torch.equal(model.a.weight, frozen)
    model.a.weight.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c.step((x,), y)   # captured again under autocast (tests/test_autocast_programs.py)
    c.eval()
    with pytest.raises(StepGuardError, match=r"training mode True -> False \(modules ''.*"
                                             r"the plan was made on the graph traced"):
        c.step((x,), y)
    c.train()
    c.step((x,), y)   # back in the captured state: runs


def test_compiled_behaves_like_a_module_where_users_expect_one():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    c = tidal.compile(model, (torch.randn(3, 4),))
    assert [id(p) for p in c.parameters()] == [id(p) for p in model.parameters()]
    assert [n for n, _ in c.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in c.named_buffers()] == [n for n, _ in model.named_buffers()]
    state = c.state_dict()
    assert list(state) == list(model.state_dict())
    new = {k: torch.zeros_like(v) if v.is_floating_point() else v for k, v in state.items()}
    c.load_state_dict(new)
    assert float(model[0].weight.detach().abs().sum()) == 0.0
    with pytest.raises(TypeError, match="train_scheduled"):
        c.train(lambda i: None, 3)


class _Program:
    """A rank program as the guard sees it (``recaptures_autocast`` or not)."""

    def __init__(self, recaptures):
        self.recaptures_autocast = recaptures


def _guard(recaptures, plans=("round_robin",)):
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    gm = torch.fx.symbolic_trace(model)
    return model, CaptureGuard(model, gm, (torch.randn(2, 4),), plans,
                               program=_Program(recaptures))


def test_a_program_that_does_not_recapture_under_autocast_raises_naming_its_plans():
    """Not silently fp32: a program that does not capture per autocast state (its pieces would
    compute in the parameters' dtype) is refused inside autocast, from the first step."""
    _, guard = _guard(recaptures=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(StepGuardError, match=r"autocast\(cpu, bfloat16\) is on, and the "
                                                 r"program of round_robin does not run"):
            guard.step_graph(lowered=False)
    assert guard.step_graph(lowered=False) is None   # outside autocast: runs


def test_an_autocast_change_is_no_change_for_a_program_that_recaptures_per_autocast_state():
    model, guard = _guard(recaptures=True, plans=("compression",))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert guard.step_graph(lowered=False) is None
    assert guard.step_graph(lowered=False) is None
    model[0].bias.requires_grad_(False)   # any other change still raises, naming it
    with pytest.raises(StepGuardError, match=r"requires_grad True -> False \(parameters "
                                             r"'0\.bias'\)"):
        guard.step_graph(lowered=False)


def test_a_step_without_plans_under_autocast_equals_eager_autocast():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    x, y = _data()
    c = tidal.compile(model, (x,), loss_fn=F.cross_entropy, optimizer=_sgd)
    opt = _sgd(ref.parameters())
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = c.step((x,), y)
            want = F.cross_entropy(ref(x), y)
        opt.zero_grad()
        want.backward()
        opt.step()
        torch.testing.assert_close(loss, want.detach(), rtol=0, atol=0)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_program_step_after_the_loss_fn_read_a_changed_value_raises_naming_it():
    """Under a plan, loss_fn is traced once: a weight it reads from a closure that changes
    afterwards raises (never a silently stale loss); with no plan it runs every step."""
    weight = {"w": 1.0}

    def loss_fn(out, target):
        return F.cross_entropy(out, target) * weight["w"]

    x, y = _data()
    for passes in ([], ["compression"]):
        weight["w"] = 1.0
        c = tidal.compile(FunctionalDropout().eval(), (x,), passes=passes, loss_fn=loss_fn,
                          optimizer=_sgd)
        first = float(c.step((x,), y))
        weight["w"] = 0.5
        if passes:
            with pytest.raises(StepGuardError, match=r"loss_fn reads closure variable 'weight'"):
                c.step((x,), y)
        else:
            assert float(c.step((x,), y)) < first * 0.6

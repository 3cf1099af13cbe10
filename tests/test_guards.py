"""Guards: a call or step in another state than its capture's re-traces or raises, never runs
the old capture; ``Compiled`` behaves like a module where users expect one."""
import copy

import pytest
import torch
import torch.nn.functional as F

import tidal
from tidal.compiler.guards import StepGuardError


class _FunctionalDropout(torch.nn.Module):
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
    model = _FunctionalDropout()
    x, y = _data()
    c = tidal.compile(model, (x,), passes=passes, loss_fn=F.cross_entropy, optimizer=_sgd)
    assert c.eval() is c and not c.training and not model.training
    torch.testing.assert_close(c(x), model(x), rtol=0, atol=0)   # no dropout
    c.train()
    assert model.training


def test_a_step_without_plans_follows_the_mode_and_freezing():
    torch.manual_seed(0)
    model = _FunctionalDropout()
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


def test_a_program_step_in_another_state_raises_naming_what_changed():
    torch.manual_seed(0)
    model = _FunctionalDropout()
    x, y = _data()
    c = tidal.compile(model, (x,), passes=["compression"], loss_fn=F.cross_entropy,
                      optimizer=_sgd)
    c.step((x,), y)
    model.a.weight.requires_grad_(False)
    with pytest.raises(StepGuardError, match=r"requires_grad True -> False \(parameters "
                                             r"'a\.weight'\)"):
        c.step((x,), y)
    model.a.weight.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(StepGuardError, match=r"autocast\(cpu, bfloat16\) is on"):
            c.step((x,), y)
    c.eval()
    with pytest.raises(StepGuardError, match=r"training mode True -> False \(modules ''"):
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


def test_a_program_step_under_autocast_from_the_first_step_raises():
    """Not silently fp32: the program's pieces do not run under the caller's autocast."""
    model = _FunctionalDropout()
    x, y = _data()
    c = tidal.compile(model, (x,), passes=["compression"], loss_fn=F.cross_entropy,
                      optimizer=_sgd)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(StepGuardError, match=r"autocast\(cpu, bfloat16\) is on.*compression"):
            c.step((x,), y)


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
        c = tidal.compile(_FunctionalDropout().eval(), (x,), passes=passes, loss_fn=loss_fn,
                          optimizer=_sgd)
        first = float(c.step((x,), y))
        weight["w"] = 0.5
        if passes:
            with pytest.raises(StepGuardError, match=r"loss_fn reads closure variable 'weight'"):
                c.step((x,), y)
        else:
            assert float(c.step((x,), y)) < first * 0.6

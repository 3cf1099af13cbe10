"""A change of state after the first step re-captures the plan's program (issue 34, item 2):
freezing, unfreezing and ``model.eval()``/``train()`` between steps train as plain PyTorch
would (tick_tock: as its Eq. 1 update), under every training pass and no pass, in one process.
Tolerance: rtol 1e-5, atol 1e-6 (float32 sums in another order)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import tidal
from test_guards import FunctionalDropout
from tidal.compiler.guards import MAX_CAPTURES, CaptureGuard, StepGuardError
from training_passes import TRAINING_PASSES

TOL = dict(rtol=1e-5, atol=1e-6)
PASSES = list(TRAINING_PASSES)


class _Net(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(8, 16), torch.nn.Linear(16, 16),
                                  torch.nn.Linear(16, 3))
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.drop(torch.relu(self.a(x))))))


def _batch(i):
    g = torch.Generator().manual_seed(10 + i)
    return torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


class _Reference:
    """Plain PyTorch from the compiled model's state after its first step: the eager step
    (round_robin's accumulation of 2 micro-batches is the same mean), or for tick_tock Eq. 1
    (tests/test_tick_tock.py): the tick wave on the first half, the tock replica on the second,
    each applying the mean of its gradient and the other wave's latest, with its optimizer.
    Freezing (tests/tick_tock_reference.py): a frozen parameter keeps its value in both
    replicas (no gradient, its optimizer skips it); the other wave's latest gradient is kept by
    parameter name, so a parameter trained again takes its own gradient alone at its first
    tick, as on the very first one."""

    def __init__(self, c, model, name):
        self.tick_tock = name == "tick_tock"
        self.models = [copy.deepcopy(model)]
        self.opts = [_sgd(self.models[0].parameters())]
        self.opts[0].load_state_dict(copy.deepcopy(c.optimizer.state_dict()))
        if self.tick_tock:
            state = c.runtime_state_dict()
            tock = copy.deepcopy(model)
            tock.load_state_dict(state["tock"])
            self.models.append(tock)
            self.opts.append(_sgd(tock.parameters()))
            tock_opt = state["tock_optimizer"] if "tock_optimizer" in state else \
                state["tock_optimizers"][0]
            self.opts[1].load_state_dict(copy.deepcopy(tock_opt))
            self.prev = dict(state["prev_tock"])   # by parameter name

    def change(self, what):
        for m in self.models:
            what(m)

    def _grads(self, model, x, y):
        loss = F.cross_entropy(model(x), y)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, [p for _, p in named])
        return loss.detach(), dict(zip((n for n, _ in named), grads))

    def step(self, x, y):
        if not self.tick_tock:
            model, opt = self.models[0], self.opts[0]
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()
        (tick, tock), half = self.models, x.shape[0] // 2
        loss_t, g_tick = self._grads(tick, x[:half], y[:half])
        loss_k, g_tock = self._grads(tock, x[half:], y[half:])
        applied = ({n: (g + self.prev[n]) / 2 if n in self.prev else g for n, g in g_tick.items()},
                   {n: (g + g_tick[n]) / 2 for n, g in g_tock.items()})
        for model, opt, grads in zip(self.models, self.opts, applied):
            opt.zero_grad()
            for n, p in model.named_parameters():
                p.grad = grads.get(n)
            opt.step()
        self.prev = g_tock
        return (loss_t + loss_k) / 2


def _compiled(name, p):
    model = _Net(p).train()
    x, _ = _batch(0)
    c = tidal.compile(model, (x,), passes=TRAINING_PASSES[name](), loss_fn=F.cross_entropy,
                      optimizer=_sgd)
    return c, model


def _same(model, ref, tol=TOL, replica=0):
    for (k, a), b in zip(model.state_dict().items(), ref.models[replica].state_dict().values()):
        torch.testing.assert_close(a, b, **tol, msg=k)


def _same_replicas(c, model, ref):
    """The model equals the reference's (tick) copy; under tick_tock the tock replica its."""
    _same(model, ref)
    if ref.tick_tock:
        _same(c.executor.tock, ref, replica=1)


def _freeze(m):
    m.a.weight.requires_grad_(False)


def _unfreeze(m):
    m.a.weight.requires_grad_(True)


@pytest.mark.parametrize("name", PASSES)
def test_freeze_after_the_first_step_then_unfreeze_trains_as_eager(name, capsys):
    c, model = _compiled(name, p=0.0)   # training mode without dropout's randomness
    c.step(*_batch(0))
    ref = _Reference(c, model, name)
    _freeze(model), ref.change(_freeze)
    frozen = [m.a.weight.detach().clone() for m in _replicas(c, model, name)]
    for i in (1, 2):
        torch.testing.assert_close(c.step(*_batch(i)), ref.step(*_batch(i)), **TOL)
    _same_replicas(c, model, ref)
    for m, before in zip(_replicas(c, model, name), frozen):   # tick_tock: the tock's too
        assert torch.equal(m.a.weight, before) and m.a.weight.grad is None
        assert not m.a.weight.requires_grad
    err = capsys.readouterr().err
    if name != "none":   # one line for the new state, not one per step
        assert err.count(f"tidal: {name}: re-capturing the step: requires_grad True -> "
                         f"False (parameters 'a.weight')") == 1, err
    _unfreeze(model), ref.change(_unfreeze)
    torch.testing.assert_close(c.step(*_batch(3)), ref.step(*_batch(3)), **TOL)
    _same_replicas(c, model, ref)
    for m, before in zip(_replicas(c, model, name), frozen):
        assert not torch.equal(m.a.weight, before)


def _replicas(c, model, name):
    """The model, and under tick_tock the tock replica of the program running now."""
    return [model, c.executor.tock] if name == "tick_tock" else [model]


@pytest.mark.parametrize("name", PASSES)
def test_eval_then_step_has_no_dropout_and_train_again_uses_the_first_capture(name, capsys):
    c, model = _compiled(name, p=0.5)
    c.step(*_batch(0))   # with dropout: the reference starts from its result
    first = c.executor.rank_program
    ref = _Reference(c, model, name)
    model.eval(), ref.change(lambda m: m.eval())
    for i in (1, 2):
        torch.testing.assert_close(c.step(*_batch(i)), ref.step(*_batch(i)), **TOL)
    _same_replicas(c, model, ref)
    model.train()
    losses = [float(c.step(*_batch(3))) for _ in range(2)]
    assert losses[0] != losses[1] or name == "tick_tock"   # dropout is on again
    assert c.executor.rank_program is first      # the kept train-mode capture
    err = capsys.readouterr().err
    if name != "none":
        assert err.count("re-capturing the step") == 1, err
        assert "training mode True -> False (modules '', 'a', 'b', 'c' and 1 more)" in err


def test_a_mode_whose_trace_differs_from_the_compiles_still_raises_saying_why():
    model = FunctionalDropout()
    c = tidal.compile(model, (_batch(0)[0],), passes=["compression"], loss_fn=F.cross_entropy,
                      optimizer=_sgd)
    c.step(*_batch(0))
    c.eval()
    with pytest.raises(StepGuardError, match=r"training mode True -> False .* the plan was "
                                             r"made on the graph traced in the compile's mode"):
        c.step(*_batch(1))


def test_grad_mode_off_and_a_change_inside_an_accumulation_raise_naming_them():
    c, model = _compiled("compression", p=0.0)
    c.step(*_batch(0))
    with torch.no_grad(), pytest.raises(StepGuardError, match=r"grad mode on -> off.*needs "
                                                              r"grad mode"):
        c.step(*_batch(1))
    with c.no_sync():
        c.backward(*_batch(1))
    _freeze(model)
    with pytest.raises(StepGuardError, match=r"'a\.weight'.*inside no_sync\(\)"):
        c.backward(*_batch(2))


class _Program:
    recaptures_autocast = True


def test_the_guard_keeps_at_most_max_captures_programs():
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(MAX_CAPTURES + 2)])
    built = []

    def recapture(old, kept, where):
        built.append(kept is None)
        return kept if kept is not None else _Program()

    guard = CaptureGuard(model, torch.fx.symbolic_trace(model), (torch.randn(1, 2),),
                         ("compression",), _Program(), recapture=recapture)
    guard.step_graph(False)
    for layer in model:                       # a new state each time
        layer.weight.requires_grad_(False)
        guard.step_graph(False)
    assert built == [True] * len(model)
    for layer in model:
        layer.weight.requires_grad_(True)
    guard.step_graph(False)                   # the first state: dropped long ago, built again
    model[-1].weight.requires_grad_(False)
    model[-2].weight.requires_grad_(False)    # a recent one: kept
    guard.step_graph(False)
    assert built[-2:] == [True, True] and len(guard._programs) == MAX_CAPTURES

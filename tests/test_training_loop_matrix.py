"""Issue 34's table: what a real training loop does, under every training pass and no pass, on
one process, against plain PyTorch. Every cell is equal (stated tolerance) or a refusal that
names what it refuses (README: Training loops); none is silently different. The same table
on two gloo ranks, against DDP, is tests/test_training_loop_ranks.py (one spawned job).
"""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import tidal
from tick_tock_reference import Eq1Reference
from training_passes import TRAINING_PASSES, LoopNet

TOL = dict(rtol=1e-5, atol=1e-6)
PASSES = TRAINING_PASSES
OPEN = ("none", "compression", "burst_parallel", "round_robin", "tick_tock")
"""Passes with the open step (``compiled.backward``); the others raise OpenStepError."""


def _batch(i=0, rows=8):
    g = torch.Generator().manual_seed(10 + i)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _pair(name, buffer=False, optimizer=None):
    """(compiled, its model, an eager copy) in eval mode (dropout off: deterministic), so the
    reference is plain PyTorch on the whole batch."""
    model = LoopNet(buffer=buffer).eval()
    ref = copy.deepcopy(model)
    x, _ = _batch()
    c = tidal.compile(model, (x,), passes=PASSES[name](), loss_fn=F.cross_entropy,
                      optimizer=optimizer)
    return c, model, ref


def _same(model, ref, tol=TOL):
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, **tol, msg=k)


def _groups(params):
    params = list(params)
    return torch.optim.AdamW([{"params": params[0::2], "weight_decay": 0.1},
                              {"params": params[1::2], "weight_decay": 0.0}], lr=1e-2)


def _open_loop(c, ref, steps=2, micro=1, clip=None, scaler=False, two=False):
    """The open step's loop on ``c`` and the eager loop on ``ref`` (or, for tick_tock, Eq. 1's
    reference: an ``Eq1Reference``, its optimizers on both copies), side by side."""
    def optimizers(params):
        params = list(params)
        return [_groups(params[:2]), torch.optim.SGD(params[2:], lr=0.1)] if two \
            else [_groups(params)]
    eq1 = isinstance(ref, Eq1Reference)
    runs = [(c, optimizers(c.parameters())),
            (ref, ref.both(optimizers) if eq1 else optimizers(ref.parameters()))]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**6) if scaler else None
               for _ in runs]
    for step in range(steps):
        for (net, opts), gs in zip(runs, scalers):
            for i in range(micro):
                x, y = _batch(step * micro + i)
                if net is c:
                    sync = c.no_sync() if i < micro - 1 else contextlib.nullcontext()
                    with sync:
                        c.backward(x, y, scale=gs if gs is not None else 1 / micro)
                elif eq1:
                    ref.backward(x, y, 1 / micro, sync=i == micro - 1)
                else:
                    loss = F.cross_entropy(ref(x), y)
                    (gs.scale(loss) if gs is not None else loss / micro).backward()
            if gs is not None:
                for opt in opts:
                    gs.unscale_(opt)
            if clip is not None:
                norm = (c.clip_grad_norm_(clip) if net is c else ref.clip_grad_norm_(clip)
                        if eq1 else torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
                assert torch.isfinite(torch.as_tensor(norm))
            for opt in opts:
                if gs is not None:
                    gs.step(opt)
                else:
                    opt.step()
                opt.zero_grad()
            if gs is not None:
                gs.update()


OPEN_ROWS = {
    "clip by global norm": dict(clip=0.05),
    "fp16-style GradScaler": dict(scaler=True),
    "accumulation over 4 micro-batches": dict(micro=4),
    "two optimizers": dict(two=True),
}


@pytest.mark.parametrize("row", list(OPEN_ROWS))
@pytest.mark.parametrize("name", list(PASSES))
def test_open_step_rows(name, row):
    c, model, ref = _pair(name)
    if name not in OPEN:
        with pytest.raises(tidal.OpenStepError, match=r"not available under \w+Plan"):
            _open_loop(c, ref, **OPEN_ROWS[row])
        return
    if name == "tick_tock":   # Eq. 1's reference; GradScaler refused (unscale_ sees one wave)
        ref = Eq1Reference(ref, F.cross_entropy)
        if OPEN_ROWS[row].get("scaler"):
            with pytest.raises(tidal.OpenStepError, match="GradScaler.unscale_"):
                _open_loop(c, ref, **OPEN_ROWS[row])
            return
    _open_loop(c, ref, **OPEN_ROWS[row])
    _same(model, ref.tick if name == "tick_tock" else ref)
    if name == "tick_tock":
        _same(c.executor.tock, ref.tock)


def _closed_steps(c, ref, steps=2, sched=None, between=None):
    """``steps`` closed steps of ``c`` and the same eager steps of ``ref`` (its ``_opt``)."""
    for step in range(steps):
        x, y = _batch(step)
        c.step((x,), y)
        F.cross_entropy(ref(x), y).backward()
        opt_ref = ref._opt
        opt_ref.step()
        opt_ref.zero_grad()
        for s in sched or ():
            s.step()
        if between is not None:
            between(step)


@pytest.mark.parametrize("name", [n for n in PASSES if n != "tick_tock"])
def test_closed_step_with_adamw_groups_and_a_schedule(name):
    """tick_tock's reference is Lemma 1, not eager: tests/test_tick_tock.py runs it with two
    groups and a schedule (the second wave follows them every step)."""
    c, model, ref = _pair(name, optimizer=_groups)
    ref._opt = _groups(ref.parameters())
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1))
              for o in (c.optimizer, ref._opt)]
    _closed_steps(c, ref, steps=3, sched=scheds)
    _same(model, ref)


def test_tick_tock_closed_step_with_adamw_groups_runs_and_both_waves_follow_the_rate():
    c, model, _ = _pair("tick_tock", optimizer=_groups)
    sched = torch.optim.lr_scheduler.LambdaLR(c.optimizer, lambda s: 1 / (s + 1))
    for step in range(3):
        c.step(*_batch(step))   # both waves stepped at the rate in force now
        assert [g["lr"] for g in c.executor.tock_optimizers()[0].param_groups] == \
            [g["lr"] for g in c.optimizer.param_groups] == pytest.approx([1e-2 / (step + 1)] * 2)
        sched.step()


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


STATE_ROWS = {
    "freeze a layer after step 1": lambda model: model.a.weight.requires_grad_(False),
    "model.eval() then step": lambda model: model.eval(),
}


@pytest.mark.parametrize("row", list(STATE_ROWS))
@pytest.mark.parametrize("name", list(PASSES))
def test_a_change_of_state_after_the_first_step(name, row):
    if name == "tick_tock":   # Eq. 1's reference (tests/tick_tock_reference.py)
        return _tick_tock_change_of_state(row)
    c, model, ref = _pair(name, optimizer=_sgd)
    model.train(), ref.train()
    model.drop.p = ref.drop.p = 0.0  # training mode, without dropout's randomness
    ref._opt = _sgd(ref.parameters())
    _closed_steps(c, ref, steps=1)
    STATE_ROWS[row](model), STATE_ROWS[row](ref)
    _closed_steps(c, ref, steps=2)   # the programs re-capture (tests/test_recapture.py)
    _same(model, ref)


def _tick_tock_change_of_state(row):
    """tick_tock's cell of a row: closed steps (SGD) against Eq. 1's reference, the change
    made after the first step to the model and to both reference copies (a frozen parameter
    keeps its value in both replicas); the tock replica compared too."""
    c, model, ref = _pair("tick_tock", optimizer=_sgd)
    model.train(), ref.train()
    model.drop.p = ref.drop.p = 0.0
    ref = Eq1Reference(ref, F.cross_entropy)
    opts = ref.both(lambda ps: [_sgd(ps)])
    for step in range(3):
        if step == 1:
            STATE_ROWS[row](model), ref.change(STATE_ROWS[row])
            kept = [m.a.weight.detach().clone() for m in (model, c.executor.tock)]
        x, y = _batch(step)
        torch.testing.assert_close(c.step((x,), y), ref.backward(x, y), **TOL)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    _same(model, ref.tick)
    _same(c.executor.tock, ref.tock)
    frozen = row.startswith("freeze")
    assert [torch.equal(m.a.weight, k) for m, k in zip((model, c.executor.tock), kept)] == \
        [frozen, frozen]


@pytest.mark.parametrize("name", list(PASSES))
def test_autocast_around_step(name):
    """Every pass: a step inside ``torch.autocast`` (bf16) computes as the eager step inside it
    (round_robin: as its accumulation of 2 micro-batches), then a step outside as the fp32 one
    (re-captured, not the autocast capture replayed). tick_tock's reference is Lemma 1
    (tests/test_autocast_programs.py compares it, and the bf16/fp32 distance)."""
    c, model, ref = _pair(name, optimizer=_sgd)
    ref._opt = _sgd(ref.parameters())
    micro = 2 if name == "round_robin" else 1
    for step, on in enumerate((True, True, False)):
        x, y = _batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            loss = c.step((x,), y)
            want = [F.cross_entropy(ref(xb), yb) / micro
                    for xb, yb in zip(x.chunk(micro), y.chunk(micro))]
        sum(want).backward()
        ref._opt.step()
        ref._opt.zero_grad()
        assert torch.isfinite(loss)
        if name != "tick_tock":
            torch.testing.assert_close(loss, sum(want).detach(), rtol=1e-3, atol=1e-4)
    if name != "tick_tock":
        _same(model, ref, dict(rtol=1e-3, atol=1e-4))


@pytest.mark.parametrize("name", list(PASSES))
def test_eval_forward_after_training(name):
    c, model, ref = _pair(name, optimizer=_sgd)
    model.train(), ref.train()
    model.drop.p = ref.drop.p = 0.0
    c.step(*_batch(0))
    c.eval()
    x, _ = _batch(5)
    with torch.no_grad():
        assert not model.training
        out = c(x)
    assert out.shape == (8, 3)
    if name != "tick_tock":   # tick_tock's tick replica trained on half the batch (Eq. 1)
        ref._opt = _sgd(ref.parameters())
        F.cross_entropy(ref(_batch(0)[0]), _batch(0)[1]).backward()
        ref._opt.step()
        torch.testing.assert_close(out, ref.eval()(x), **TOL)


@pytest.mark.parametrize("name", list(PASSES))
def test_a_buffer_updated_in_place(name):
    if name in ("tick_tock", "round_robin"):
        with pytest.raises(tidal.BufferUpdateError, match=r"'count'|'ema'"):
            _pair(name, buffer=True, optimizer=_sgd)
        return
    c, model, ref = _pair(name, buffer=True, optimizer=_sgd)
    ref._opt = _sgd(ref.parameters())
    _closed_steps(c, ref, steps=3)
    _same(model, ref)
    assert float(model.count) == 3.0


@pytest.mark.parametrize("name", [n for n in PASSES if n != "tick_tock"])
def test_state_dict_after_training_is_current(name):
    c, model, ref = _pair(name, optimizer=_sgd)
    ref._opt = _sgd(ref.parameters())
    _closed_steps(c, ref, steps=2)
    for (k, a), b in zip(c.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, **TOL, msg=k)

"""The open step (``Compiled.backward``, ``no_sync``, ``clip_grad_norm_``) under ``tick_tock``:
the loop steps its own optimizers and the tock replica steps a clone of each (groups, rates,
weight decay following the user's every step). Against Eq. 1's reference in plain PyTorch
(tests/tick_tock_reference.py: two model copies, each with the user's optimizers): SGD and
AdamW with two param groups and a LambdaLR over 3 steps, clipping (each wave by its own norm),
accumulation of 2 micro-batches under no_sync, bf16 autocast; equal to the closed
``Compiled.step`` for SGD; a checkpoint resumes bit for bit; the refusals (a GradScaler's
tensor scale, open and closed steps mixed) name what they refuse. Tolerances: parameters and
losses within 1e-6 absolute (+1e-5 relative) in fp32, 2e-2 under bf16 autocast. Then one
spawned 2-rank job (gloo): open step + clip + AdamW equals the reference on both ranks.
Freezing then unfreezing a weight between steps re-captures and equals the reference (both
replicas keep a frozen weight's value), on one process and in the spawned job."""
import contextlib
import gc
import io
import weakref

import pytest
import torch
import torch.nn.functional as F

import tidal
from tidal.passes.tick_tock import TickTock
from tidal.runtime.distributed import spawn
from tidal.runtime.program import OpenStepError
from tidal.runtime.programs.optimizer_mirror import StepMirrors
from tick_tock_reference import Eq1Reference

BATCH, STEPS = 8, 3
TOL = dict(rtol=1e-5, atol=1e-6)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _data(step, k=0):
    g = torch.Generator().manual_seed(100 + 10 * step + k)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _compile(world=1, optimizer=None):
    x, y = _data(0)
    return tidal.compile(_model(), (x,), passes=[TickTock(ranks=world)], loss_fn=F.cross_entropy,
                         example_targets=y, optimizer=optimizer)


def _sgd(params):
    return [torch.optim.SGD(params, lr=0.1, momentum=0.9)]


def _adamw(params):
    """AdamW, two param groups (weights decay, biases not)."""
    params = list(params)
    return [torch.optim.AdamW([{"params": params[0::2], "weight_decay": 0.1},
                               {"params": params[1::2], "weight_decay": 0.0}], lr=2e-2)]


class _Tidal:
    """The compiled model as the loop drives it (the reference's face)."""

    def __init__(self, c):
        self.c = c

    def parameters(self):
        return self.c.parameters()

    def both(self, make):   # the tock's clones are made from these by tidal
        return make(self.c.parameters())

    def no_sync(self):
        return self.c.no_sync()

    def backward(self, x, y, scale=None):
        return self.c.backward(x, y, scale=scale)

    def clip_grad_norm_(self, max_norm):
        return self.c.clip_grad_norm_(max_norm)


def _loop(run, make_opts, micro=1, clip=None, autocast=False, steps=STEPS):
    """``steps`` steps: ``micro`` micro-batches (scale 1/micro, all but the last inside
    no_sync), optional clipping, every optimizer stepped, a LambdaLR on each, zero_grad.
    Returns the losses and clipping norms."""
    opts = run.both(make_opts)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)) for o in opts]
    losses, norms = [], []
    for step in range(steps):
        for k in range(micro):
            x, y = _data(step, k)
            quiet = run.no_sync() if k < micro - 1 else contextlib.nullcontext()
            with quiet, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                losses.append(run.backward(x, y, 1 / micro if micro > 1 else None))
        if clip is not None:
            norms.append(run.clip_grad_norm_(clip))
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
        for o in opts:
            o.zero_grad()
    return torch.stack(losses), torch.stack(norms) if norms else torch.zeros(1)


def _check(c, ref, got, want, tol=TOL):
    torch.testing.assert_close(got[0].float(), want[0].float(), **tol, msg="losses")
    torch.testing.assert_close(got[1], want[1], **tol, msg="clipping norms")
    for name, model in (("tick", ref.tick), ("tock", ref.tock)):
        mine = c.model if name == "tick" else c.executor.tock
        for (k, a), b in zip(mine.state_dict().items(), model.state_dict().values()):
            torch.testing.assert_close(a, b, **tol, msg=f"{name} {k}")
    # two real replicas, and the loop trained them
    tick, tock = c.model.state_dict()["0.weight"], c.executor.tock.state_dict()["0.weight"]
    assert not torch.allclose(tick, tock)
    assert not torch.allclose(tick, _model()[0].weight, atol=1e-3)


CASES = {
    "sgd": dict(make_opts=_sgd),
    "adamw_groups": dict(make_opts=_adamw),
    "clip": dict(make_opts=_adamw, clip=0.05),
    "accumulate_2": dict(make_opts=_adamw, micro=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_open_step_loop_equals_eq1_reference(case):
    c = _compile()
    ref = Eq1Reference(_model(), F.cross_entropy)
    got = _loop(_Tidal(c), **CASES[case])
    _check(c, ref, got, _loop(ref, **CASES[case]))
    if CASES[case].get("clip"):   # the clip bit: the norms exceed it
        assert (got[1] > CASES[case]["clip"]).all()
    # one clone per user optimizer, following its rate and groups
    clones = c.executor.tock_optimizers()
    assert len(clones) == 1 and len(clones[0].param_groups) == len(
        CASES[case]["make_opts"](_model().parameters())[0].param_groups)


def test_bf16_autocast_open_step_equals_the_reference_under_autocast():
    c = _compile()
    ref = Eq1Reference(_model(), F.cross_entropy)
    got = _loop(_Tidal(c), _adamw, autocast=True)
    _check(c, ref, got, _loop(ref, _adamw, autocast=True), BF16_TOL)


def test_no_sync_keeps_gradients_in_the_program_until_the_synchronized_call():
    c = _compile()
    x, y = _data(0)
    with c.no_sync():
        c.backward(x, y, scale=0.5)
    names = [p.name for p in c.executor.last_program.pieces]
    assert names == ["tick F", "tick B", "tock F", "tock B", "tick accumulate",
                     "tock accumulate", "loss"]
    assert all(p.grad is None for p in c.parameters())
    assert all(p.grad is None for p in c.executor.tock.parameters())
    c.backward(x, y, scale=0.5)
    assert "tick grads" in [p.name for p in c.executor.last_program.pieces]
    ref = Eq1Reference(_model(), F.cross_entropy)
    with ref.no_sync():
        ref.backward(x, y, 0.5)
    ref.backward(x, y, 0.5)
    for model, mine in ((ref.tick, c.model), (ref.tock, c.executor.tock)):
        for p, q in zip(mine.parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_open_step_with_sgd_equals_the_closed_step():
    closed = _compile(optimizer=lambda ps: _sgd(ps)[0])
    opened = _compile()
    opt = _sgd(opened.parameters())[0]
    for step in range(STEPS):
        want = closed.step(*_data(step))
        got = opened.backward(*_data(step))
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(got, want, **TOL)
    for a, b in ((opened.model, closed.model), (opened.executor.tock, closed.executor.tock)):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, **TOL)


def test_open_step_with_compression_off_equals_tick_tock_alone():
    """The compression pass wraps each wave's sync in the open step too: off, bit for bit."""
    from tidal.passes.compression import CompressionPass

    x, y = _data(0)
    composed = tidal.compile(_model(), (x,), passes=[TickTock(ranks=1), CompressionPass(
        mode="off")], loss_fn=F.cross_entropy, example_targets=y)
    alone = _compile()
    for c in (composed, alone):
        _loop(_Tidal(c), _adamw, micro=2, clip=0.05)
    assert {w: s.compressor.spec() for w, s in composed.executor.syncs.items()} == \
        {"T": "none", "K": "none"}
    for a, b in ((composed.model, alone.model), (composed.executor.tock, alone.executor.tock)):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)


def test_two_optimizers_each_step_their_own_clone_and_others_are_left_alone():
    c = _compile()
    params = list(c.parameters())
    opts = [torch.optim.SGD(params[:2], lr=0.1), torch.optim.Adam(params[2:], lr=1e-2)]
    other = torch.nn.Linear(2, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    ref = Eq1Reference(_model(), F.cross_entropy)
    ref_opts = []
    for m in (ref.tick, ref.tock):
        ps = list(m.parameters())
        ref_opts += [torch.optim.SGD(ps[:2], lr=0.1), torch.optim.Adam(ps[2:], lr=1e-2)]
    for step in range(STEPS):
        c.backward(*_data(step))
        ref.backward(*_data(step))
        for o in opts + ref_opts:
            o.step()
            o.zero_grad()
        other.weight.grad = torch.ones_like(other.weight)
        other_opt.step()          # another model's optimizer: no clone for it
    assert [type(o).__name__ for o in c.executor.tock_optimizers()] == ["SGD", "Adam"]
    for mine, model in ((c.model, ref.tick), (c.executor.tock, ref.tock)):
        for p, q in zip(mine.parameters(), model.parameters()):
            torch.testing.assert_close(p, q, **TOL)


def test_refusals_name_what_they_refuse():
    c = _compile(optimizer=lambda ps: _sgd(ps)[0])
    x, y = _data(0)
    with pytest.raises(OpenStepError, match="GradScaler.unscale_.*tick wave"):
        c.backward(x, y, scale=torch.amp.GradScaler("cpu", init_scale=2.0 ** 6))
    with pytest.raises(OpenStepError, match="GradScaler"):
        c.backward(x, y, scale=torch.tensor(0.5))
    c.backward(x, y, scale=0.5)           # a number works
    with pytest.raises(OpenStepError, match=r"Compiled.step after Compiled.backward"):
        c.step((x,), y)
    closed = _compile(optimizer=lambda ps: _sgd(ps)[0])
    closed.step((x,), y)
    with pytest.raises(OpenStepError, match=r"Compiled.backward after Compiled.step"):
        closed.backward(x, y)
    with pytest.raises(OpenStepError, match="clip_grad_norm_ after Compiled.step"):
        closed.clip_grad_norm_(1.0)


def _first_weight(m):
    """The first layer's weight of the model, a reference copy or the tock replica."""
    return m.get_parameter("0.weight")


def _freeze_then_unfreeze(world=1):
    """Freeze the first layer's weight after step 1, unfreeze it after step 3 (AdamW, two
    groups): the program re-captures, the tock replica follows (its copy frozen: no gradient,
    no update, its clone skips it) and Eq. 1 carries the kept tock gradient by name
    (tests/tick_tock_reference.py says how freezing is modelled). Asserts it equals the
    reference."""
    c = _compile(world)
    ref = Eq1Reference(_model(), F.cross_entropy)
    runs = [(c, _adamw(c.parameters())), (ref, ref.both(_adamw))]

    def freeze(on):
        for m in (c.model, ref.tick, ref.tock):   # the reference's copies alike
            _first_weight(m).requires_grad_(not on)

    for step in range(5):
        if step in (1, 3):
            freeze(step == 1)
            kept = [_first_weight(m).detach().clone() for m in (c.model, c.executor.tock)]
        losses = [net.backward(*_data(step)) for net, _ in runs]
        torch.testing.assert_close(losses[0], losses[1], **TOL)
        if step == 1:   # nothing for the frozen weight in either replica
            assert [_first_weight(m).grad for m in (c.model, c.executor.tock)] == [None, None]
            assert not _first_weight(c.executor.tock).requires_grad
        for opt in (o for _, opts in runs for o in opts):
            opt.step()
            opt.zero_grad()
        if step:   # the frozen weight kept its value in both replicas, and only then
            frozen = step < 3
            assert [torch.equal(_first_weight(m), k) for m, k in
                    zip((c.model, c.executor.tock), kept)] == [frozen, frozen]
    for name, model in (("tick", ref.tick), ("tock", ref.tock)):
        mine = c.model if name == "tick" else c.executor.tock
        for (k, a), b in zip(mine.state_dict().items(), model.state_dict().values()):
            torch.testing.assert_close(a, b, **TOL, msg=f"{name} {k}")


def test_freezing_then_unfreezing_in_the_open_step_equals_the_reference():
    _freeze_then_unfreeze()


def test_a_checkpoint_resumes_the_open_step_bit_for_bit():
    """model + the loop's optimizer + schedule + Compiled.runtime_state_dict() (the tock
    replica, its clone's state, the kept tock gradient) after 2 steps, loaded into a fresh
    compile: the next 2 steps equal the uninterrupted run's exactly."""
    def fresh():
        c = _compile()
        opt = _adamw(c.parameters())[0]
        return c, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))

    def train(c, opt, sched, steps):
        for step in steps:
            c.backward(*_data(step))
            opt.step()
            sched.step()
            opt.zero_grad()

    c, opt, sched = fresh()
    train(c, opt, sched, range(2))
    saved = {"model": {k: v.clone() for k, v in c.state_dict().items()},
             "optim": opt.state_dict(), "sched": sched.state_dict(),
             "runtime": c.runtime_state_dict()}
    blob = _roundtrip(saved).getvalue()
    train(c, opt, sched, range(2, 4))
    # the kept tock gradient is saved by parameter name; an older checkpoint's list (in the
    # trainable parameters' order) resumes alike, or is refused naming it
    assert list(saved["runtime"]["prev_tock"]) == [n for n, _ in c.model.named_parameters()]
    for older in (False, True):
        saved = torch.load(io.BytesIO(blob), weights_only=False)   # loading shares tensors
        runtime = saved["runtime"]
        if older:
            runtime["prev_tock"] = list(runtime["prev_tock"].values())
        c2, opt2, sched2 = fresh()
        c2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["optim"])
        sched2.load_state_dict(saved["sched"])
        c2.load_runtime_state_dict(runtime)
        train(c2, opt2, sched2, range(2, 4))
        for a, b in ((c.model, c2.model), (c.executor.tock, c2.executor.tock)):
            for (k, p), q in zip(a.state_dict().items(), b.state_dict().values()):
                assert torch.equal(p, q), (k, older)
    c4 = _compile()
    c4.model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="'prev_tock' holds 4 gradients by position"):
        c4.load_runtime_state_dict(runtime)


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_the_step_hook_goes_with_the_mirrors():
    model, replica = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    mirrors = StepMirrors({id(p): q for p, q in zip(model.parameters(), replica.parameters())})
    gone = weakref.ref(mirrors)
    del mirrors
    gc.collect()
    assert gone() is None
    before = replica.weight.detach().clone()
    model.weight.grad = torch.ones_like(model.weight)
    replica.weight.grad = torch.ones_like(replica.weight)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    assert torch.equal(replica.weight, before)   # no hook left to step it


# --- two gloo ranks, one spawned job ---------------------------------------------------------

def _ranks_open_step(rank, world):
    c = _compile(world)
    ref = Eq1Reference(_model(), F.cross_entropy)
    got = _loop(_Tidal(c), _adamw, clip=0.05)
    _check(c, ref, got, _loop(ref, _adamw, clip=0.05))
    _freeze_then_unfreeze(world)
    return torch.cat([p.detach().reshape(-1) for p in c.parameters()]), \
        torch.cat([p.detach().reshape(-1) for p in c.executor.tock.parameters()])


@pytest.mark.slow
def test_two_gloo_ranks_open_step_with_clipping_and_adamw_equals_the_reference():
    """And freezing then unfreezing (``_freeze_then_unfreeze``) on both ranks."""
    (tick0, tock0), (tick1, tock1) = spawn(_ranks_open_step, 2)
    assert torch.equal(tick0, tick1) and torch.equal(tock0, tock1)   # the ranks agree

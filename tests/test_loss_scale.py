"""fp16 loss scaling in the open step (``Compiled.backward(x, y, scale=...)``), as eager
``scaler.scale(loss).backward()``: the scale seeds the backward of the captured joint graph
(``tidal.ir.capture.loss_seed``), so fp16 intermediate gradients do not underflow.

A loss of ``cross_entropy * 1e-6`` under ``torch.autocast("cpu", float16)``: without scaling
most of the fp16 gradients underflow to exactly zero (asserted: scaling the gradients after
backward, as tidal did before, keeps those zeros). With a ``GradScaler`` (init scale 2^16)
through ``Compiled.backward``, ``unscale_``, ``step``, ``update``, 3 steps of SGD equal the
eager GradScaler loop on one process under ``compression`` (none: data parallelism's captured
step), ``round_robin`` (its reference accumulates ``scaler.scale(loss_b / 2)`` over the two
micro-batches; an even batch and a 7-row batch whose micro-batches are weighted by their rows),
data parallelism's eager pieces and round_robin's eager partitions (what runs when a step
cannot be captured) and no pass (eager autograd); a scale too large for fp16 (2^40) skips the
same steps as eager (inf gradients). ``tick_tock`` (which refuses a GradScaler) with a float
scale and a manual unscale of both replicas equals its Eq. 1 reference
(tests/tick_tock_reference.py) seeded with the same scale. Tolerance: gradients and
parameters within 1e-12 absolute + 1e-5 relative (the gradients are ~1e-7: the same ops on the
same rows give the same bits; the tolerance only absorbs a summation order); the scaler's
scale after each step exactly. Every compiled step is checked to have run captured (or
eagerly, where that is the case under test), so the path under test is the one that ran."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tidal
from tidal.ir.capture import capture_train_step, loss_seed
from tidal.passes.compression import CompressionPass
from tidal.passes.round_robin import RoundRobin
from tidal.passes.tick_tock import TickTock
from tidal.runtime.programs import round_robin_capture
from tick_tock_reference import Eq1Reference

STEPS, BATCH, SCALE, LR = 3, 8, 2.0 ** 16, 1e3
TOL = dict(rtol=1e-5, atol=1e-12, equal_nan=True)   # an overflowed step: inf, nan alike
FP16 = dict(device_type="cpu", dtype=torch.float16)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _loss(out, y):
    """A loss small enough that its fp16 gradients underflow without scaling."""
    return F.cross_entropy(out, y) * 1e-6


def _data(rows=BATCH):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, generator=g), torch.randint(0, 4, (rows,), generator=g))
            for _ in range(STEPS)]


def _eager_loop(model, data, micro=1, init_scale=SCALE):
    """The eager GradScaler loop; with ``micro`` > 1 each batch's gradient accumulated over its
    ``micro`` row-cut pieces, each loss / micro weighted by its rows (round_robin's reference).
    Returns the unscaled gradients of each step, then the scale after its ``update``."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    grads = []
    for x, y in data:
        for xb, yb in zip(x.tensor_split(micro), y.tensor_split(micro)):
            with torch.autocast(**FP16):
                loss = _loss(model(xb), yb) / micro * (len(yb) * micro / len(y))
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads.append([p.grad.clone() for p in model.parameters()])
        scaler.step(opt)
        scaler.update()
        grads[-1].append(scaler.get_scale())
        opt.zero_grad()
    return grads


def _tidal_loop(passes, data, eager=False, init_scale=SCALE):
    """The same loop through ``Compiled.backward(scale=scaler)`` (``eager``: data
    parallelism's eager pieces, as when a step cannot be captured)."""
    x, y = _data()[0]          # compiled on an even batch; a 7-row batch runs too
    c = tidal.compile(_model(), (x,), passes=passes, loss_fn=_loss, example_targets=y)
    if eager:
        c.executor.rank_program.fallback_reason = "eager pieces asked for"
    return c, _scaler_loop(c, data, init_scale)


def _scaler_loop(c, data, init_scale=SCALE):
    """The GradScaler loop on the compiled ``c``: each step's unscaled gradients, then the
    scale after its ``update``."""
    opt = torch.optim.SGD(c.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    grads = []
    for x, y in data:
        with torch.autocast(**FP16):
            c.backward((x,), y, scale=scaler)
        scaler.unscale_(opt)
        grads.append([p.grad.clone() for p in c.parameters()])
        scaler.step(opt)
        scaler.update()
        grads[-1].append(scaler.get_scale())
        opt.zero_grad()
    return grads


def _close(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if isinstance(a, float):    # the scaler's scale after the step: the same decision
            assert a == b, (a, b)
        else:
            torch.testing.assert_close(a, b, **TOL)


def _zeros(grads):
    """How many entries of ``grads`` are exactly zero."""
    return sum(int((g == 0).sum()) for g in grads)


def _unscaled_zeros(model, x, y):
    """How many gradient entries of the fp16-autocast loss are exactly zero with no scale (the
    post-scaling result: a zero times the scale is zero), and the gradients."""
    with torch.autocast(**FP16):
        loss = _loss(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return _zeros(grads), grads


def test_fp16_gradients_underflow_without_scaling():
    """The premise: unscaled, most fp16 gradients are exactly zero; scaled before backward
    (the loss seed), none is, and the captured step with a seed equals eager's."""
    model = _model()
    (x, y), = _data()[:1]
    zeros, plain = _unscaled_zeros(model, x, y)
    assert zeros > 100, zeros
    with torch.autocast(**FP16):
        step = capture_train_step(model, (x,), y, _loss)
        loss = _loss(model(x), y)
    eager = torch.autograd.grad(loss * loss_seed(SCALE), list(model.parameters()))
    _, seeded = step.run(model, (x,), y, seed=torch.tensor(SCALE))
    assert _zeros(seeded.values()) * 10 < zeros
    for (name, p), g in zip(model.named_parameters(), eager):
        torch.testing.assert_close(seeded[name], g, **TOL)
    post = [g * SCALE for g in plain]      # the old post-scaling, far from eager's
    assert max(float((a - b).abs().max()) for a, b in zip(post, eager)) > 100 * float(
        max(g.abs().max() for g in eager)) * TOL["rtol"]


def _ran_captured(c):
    """The last step ran the captured joint graph (no eager piece, nothing uncaptured)."""
    assert not getattr(c.executor.rank_program, "fallback_reason", ""), \
        c.executor.rank_program.fallback_reason
    assert c.executor.uncaptured() == [], c.executor.uncaptured()
    assert not {"forward", "backward"} & {p.name for p in c.executor.last_program.pieces}


def test_no_pass_scales_the_loss_before_eager_backward():
    """With no pass the step is eager autograd (``GraphProgram``): the loss times the scale."""
    data = _data()
    reference = _model()
    want = _eager_loop(reference, data)
    c, got = _tidal_loop([], data)
    assert {"forward", "backward"} <= {p.name for p in c.executor.last_program.pieces}
    for g, w in zip(got, want):
        _close(g, w)
    _close(list(c.parameters()), list(reference.parameters()))


@pytest.mark.parametrize("name,passes,micro,rows", [
    ("compression", [CompressionPass("none")], 1, BATCH),
    ("round_robin", [RoundRobin(partitions=2)], 2, BATCH),
    ("round_robin_uneven", [RoundRobin(partitions=2)], 2, 7),
])
def test_grad_scaler_loop_equals_eager(name, passes, micro, rows):
    data = _data(rows)
    reference = _model()
    want = _eager_loop(reference, data, micro)
    c, got = _tidal_loop(passes, data)
    _ran_captured(c)
    underflowed, _ = _unscaled_zeros(_model(), *data[0])   # what post-scaling would keep
    assert _zeros(got[0][:-1]) * 10 < underflowed, (_zeros(got[0][:-1]), underflowed)
    for g, w in zip(got, want):
        _close(g, w)
    _close(list(c.parameters()), list(reference.parameters()))


def test_grad_scaler_loop_eager_fallback_equals_eager():
    """A data-parallel step that cannot be captured runs eagerly and scales the loss before
    backward."""
    data = _data()
    reference = _model()
    want = _eager_loop(reference, data)
    c, got = _tidal_loop([CompressionPass("none")], data, eager=True)
    assert {"forward", "backward"} <= {p.name for p in c.executor.last_program.pieces}
    for g, w in zip(got, want):
        _close(g, w)
    _close(list(c.parameters()), list(reference.parameters()))


def test_round_robin_eager_partitions_scale_the_loss(monkeypatch):
    """round_robin partitions that cannot be captured run eagerly: the last one's loss times
    the scale before backward (7 rows: weighted micro-batches)."""
    def cannot(*args, **kwargs):
        raise RuntimeError("asked to run eagerly")

    monkeypatch.setattr(round_robin_capture, "capture_partition", cannot)
    data = _data(7)
    reference = _model()
    want = _eager_loop(reference, data, micro=2)
    c, got = _tidal_loop([RoundRobin(partitions=2)], data)
    assert len(c.executor.uncaptured()) == 2      # both partitions, named
    for g, w in zip(got, want):
        _close(g, w)
    _close(list(c.parameters()), list(reference.parameters()))


def test_tick_tock_float_scale_equals_eq1_reference():
    """tick_tock refuses a GradScaler (the tock replica's gradients would stay scaled): a
    float scale, both replicas unscaled by hand, against Eq. 1 seeded with the same scale."""
    data = _data()
    ref = Eq1Reference(_model(), _loss)
    c = tidal.compile(_model(), (data[0][0],), passes=[TickTock(ranks=1)], loss_fn=_loss,
                      example_targets=data[0][1])
    opts = [torch.optim.SGD(c.parameters(), lr=LR)]
    ref_opts = ref.both(lambda params: [torch.optim.SGD(params, lr=LR)])
    for x, y in data:
        with torch.autocast(**FP16):
            c.backward((x,), y, scale=SCALE)
            ref.backward(x, y, scale=SCALE)
        got = [p.grad for p in c.parameters()]
        assert _zeros(got) * 10 < _unscaled_zeros(ref.tick, x[:BATCH // 2], y[:BATCH // 2])[0]
        _close(got, [p.grad for p in ref.tick.parameters()])
        for p in [*c.parameters(), *c.executor.tock.parameters(), *ref.tick.parameters(),
                  *ref.tock.parameters()]:
            p.grad.div_(SCALE)
        for opt in opts + ref_opts:
            opt.step()
            opt.zero_grad()
    _ran_captured(c)
    _close(list(c.parameters()), list(ref.tick.parameters()))
    _close(list(c.executor.tock.parameters()), list(ref.tock.parameters()))


def test_grad_scaler_skips_the_steps_eager_skips():
    """A scale too large for fp16 (2^40): the seeded backward overflows to inf where eager's
    does, so ``scaler.step`` skips and ``update`` backs off on the same steps (post-scaling
    an fp32 gradient would stay finite and never skip)."""
    data = _data()
    reference = _model()
    want = _eager_loop(reference, data, init_scale=2.0 ** 40)
    c, got = _tidal_loop([CompressionPass("none")], data, init_scale=2.0 ** 40)
    assert [w[-1] for w in want] == [2.0 ** 39, 2.0 ** 38, 2.0 ** 38]   # two steps skipped
    assert not all(bool(torch.isfinite(g).all()) for g in got[0][:-1])
    _ran_captured(c)
    for g, w in zip(got, want):
        _close(g, w)
    _close(list(c.parameters()), list(reference.parameters()))


def test_layer_groups_grad_scaler_loop_equals_eager(tmp_path):
    """layer_groups (weights streamed from a store at the first call, then its captured joint
    graph) seeds its backward with the scale too."""
    from tidal.passes.layer_groups import LayerGroups
    from tidal.runtime.weights.loader import write_groups

    data = _data()
    reference = _model()
    want = _eager_loop(reference, data)
    x, y = data[0]
    path = tmp_path / "w.safetensors"
    write_groups(tidal.compile(_model(), (x,), passes=[LayerGroups(grouping="per_layer")])
                 .graph_module, path)
    c = tidal.compile(_model(), (x,), passes=[LayerGroups(grouping="per_layer",
                                                          weight_store=str(path))],
                      loss_fn=_loss, example_targets=y)
    got = _scaler_loop(c, data)
    assert c.executor.rank_program.fallback_reason == ""
    for g, w in zip(got, want):
        _close(g, w)
    _close(list(c.parameters()), list(reference.parameters()))

"""Buffers updated in place in forward keep eager semantics (issue 34, item 5).

A module whose forward does ``self.count.add_(1)``, ``self.ema.mul_(0.9).add_(...)`` and, under
``torch.no_grad()``, ``self.seen.add_(...)`` of an activation: after 3 calls of the compiled
forward and after 3 training steps with SGD (no pass, ``compression``, ``burst_parallel`` on one
process) every buffer and parameter equals eager PyTorch's (≤ 1e-6; counters exactly), on the
torch.fx capture and on the torch.export one. ``tick_tock`` and ``round_robin`` run the forward
once per wave or micro-batch, so they refuse such a model with a ``BufferUpdateError`` naming
the buffer; BatchNorm statistics are not refused. Everything runs in one process.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import tidal
from tidal.ir.capture import (BufferUpdateError, buffer_writes, capture_train_step,
                              refuse_buffer_writes, trace)
from tidal.ir.errors import TraceError
from tidal.ir.meta import get_trace_notes
from tidal.runtime.lower import lower

TOL = 1e-6
STEPS = 3


class Stats(torch.nn.Module):
    """A counter, an EMA of the input and a no-grad sum of an activation, all in place.
    ``shape_branch`` adds Python on a shape torch.fx cannot trace (captured by torch.export)."""

    def __init__(self, shape_branch: bool = False):
        super().__init__()
        self.shape_branch = shape_branch
        self.lin = torch.nn.Linear(4, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x):
        if self.shape_branch and x.shape[0] > 1:
            x = x * 1.0
        self.count.add_(1)
        self.ema.mul_(0.9).add_(x.mean(0) * 0.1)
        h = self.lin(x)
        with torch.no_grad():
            self.seen.add_(h.abs().sum(0))
        return h


def _model(shape_branch=False):
    torch.manual_seed(0)
    return Stats(shape_branch)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))
            for _ in range(STEPS)]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _eager_trained(model):
    opt = _sgd(model.parameters())
    for x, y in _batches():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _assert_state_equal(got, want):
    for name, value in want.state_dict().items():
        mine = got.state_dict()[name]
        if value.is_floating_point():
            torch.testing.assert_close(mine, value, rtol=0, atol=TOL, msg=name)
        else:
            assert torch.equal(mine, value), name
    assert not got.seen.requires_grad  # the no-grad update leaves no autograd history


@pytest.mark.parametrize("shape_branch", [False, True], ids=["fx", "export"])
def test_compiled_forward_updates_buffers_as_eager(shape_branch):
    model, ref = _model(shape_branch), _model(shape_branch)
    compiled = tidal.compile(model, (torch.randn(8, 4),))
    assert model.count.item() == 0 and not model.ema.any()  # compiling updates nothing
    notes = " ".join(get_trace_notes(compiled.graph_module))
    assert ("torch.export" in notes) == shape_branch
    for x, _ in _batches():
        torch.testing.assert_close(compiled(x), ref(x), rtol=0, atol=TOL)
    assert model.count.item() == STEPS
    _assert_state_equal(model, ref)


def test_the_traced_graph_holds_every_update_with_its_line():
    gm = trace(_model(), (torch.randn(8, 4),))
    writes = buffer_writes(gm)
    assert [(w.buffer, w.op) for w in writes] == [("count", "add_"), ("ema", "mul_"),
                                                   ("ema", "add_"), ("seen", "add_")]
    assert all(w.location.startswith(__file__) for w in writes)
    assert "count.add_(1)" in gm.code and "mul_(0.9)" in gm.code


def test_an_update_fx_would_run_at_trace_time_is_refused_by_name():
    """``if self.ready`` needs the buffer's value: torch.fx then traces with plain tensors and
    would run ``self.calls += 1`` at trace time, leaving it out of the graph; torch.export
    cannot branch on a buffer's value either. The capture fails naming the buffer."""

    class Gated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)
            self.register_buffer("ready", torch.ones((), dtype=torch.bool))
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            if self.ready:
                self.calls += 1
            return self.lin(x)

    model = Gated()
    with pytest.raises(TraceError, match="buffer 'calls' is updated in place"):
        trace(model, (torch.randn(3, 4),))
    assert model.calls.item() == 0


def test_an_update_under_python_on_a_buffer_is_kept_when_fx_can_trace_it():
    """``self.steps.add_(1)`` beside Python reading another buffer's value (a plain-tensor
    trace) is recorded when its value is a traced one."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("on", torch.ones((), dtype=torch.bool))
            self.register_buffer("total", torch.zeros(4))

        def forward(self, x):
            if self.on:
                self.total.add_(x.sum(0))
            return x * 2

    model, x = Scaled(), torch.randn(3, 4)
    gm = trace(model, (x,))
    for _ in range(STEPS):
        gm(x)
    torch.testing.assert_close(model.total, STEPS * x.sum(0), rtol=0, atol=TOL)


def test_lowered_forward_writes_the_buffers_once_per_call():
    """Capturing a segment runs it; the buffers it writes are put back, and the writes run
    uncaptured (on a GPU a replay would write a static copy)."""
    model, ref = _model(), _model()
    x = torch.randn(8, 4)
    lowered = lower(trace(model, (x,)), (x,))
    assert model.count.item() == 0 and not model.ema.any()
    assert any("in-place update of buffer ema" in s.reason for s in lowered.report.steps)
    with torch.no_grad():
        for x, _ in _batches():
            torch.testing.assert_close(lowered(x), ref(x), rtol=0, atol=TOL)
    _assert_state_equal(model, ref)


def test_captured_step_applies_the_updates_on_the_model():
    model, ref = _model(), _model()
    x, y = _batches()[0]
    step = capture_train_step(model, (x,), y, F.cross_entropy)
    assert {w.buffer for w in buffer_writes(step)} == {"count", "ema", "seen"}
    loss, _ = step.run(model, (x,), y)
    torch.testing.assert_close(loss, F.cross_entropy(ref(x), y), rtol=0, atol=TOL)
    _assert_state_equal(model, ref)


@pytest.mark.parametrize("passes", [None, "compression", "burst_parallel"])
@pytest.mark.parametrize("shape_branch", [False, True], ids=["fx", "export"])
def test_training_steps_update_buffers_as_eager(passes, shape_branch):
    ref = _eager_trained(_model(shape_branch))
    model = _model(shape_branch)
    options = {} if passes is None else {"passes": [passes]}
    if passes == "burst_parallel":
        options["cluster"] = tidal.Cluster(gpus=2)
    compiled = tidal.compile(model, (torch.randn(8, 4),), loss_fn=F.cross_entropy,
                             optimizer=_sgd, **options)
    for x, y in _batches():
        compiled.step((x,), y)
    assert model.count.item() == STEPS
    _assert_state_equal(model, ref)


@pytest.mark.parametrize("passes", ["tick_tock", "round_robin"])
def test_passes_that_run_the_forward_per_shard_refuse_by_buffer_name(passes):
    options = {"cluster": tidal.Cluster(gpus=2)} if passes == "round_robin" else {}
    model = _model()
    with pytest.raises(BufferUpdateError, match=rf"buffer 'count' is updated in place in "
                                                rf"forward \(add_ at .*\.py:\d+\).*{passes}"):
        tidal.compile(model, (torch.randn(8, 4),), passes=[passes], loss_fn=F.cross_entropy,
                      optimizer=_sgd, **options)
    assert model.count.item() == 0


def test_batchnorm_statistics_are_not_refused():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 2))
    x, y = _batches()[0]
    step = capture_train_step(model, (x,), y, F.cross_entropy)
    assert buffer_writes(step) == ()
    assert {w.buffer for w in buffer_writes(step, statistics=True)} == {
        "1.running_mean", "1.running_var", "1.num_batches_tracked"}
    refuse_buffer_writes(step, "tick_tock", "unused")  # nothing to refuse
    compiled = tidal.compile(copy.deepcopy(model), (x,), passes=["tick_tock"],
                             loss_fn=F.cross_entropy, optimizer=_sgd)
    assert "tick_tock" in [r.name for r in compiled.records]

"""Memory-bound batch sizing (Wavelet §3.2's premise): under a per-rank budget, data
parallelism's largest batch and tick-tock's largest per-wave batch are the largest that fit by
the memory timeline (the next one up does not), and one wave step's memory, measured after a
real step (state tensors, saved activations), is within 10 % of the prediction."""
import pytest
import torch

import tidal
from tidal.ir.capture import capture_train_step
from tidal.ir.memory_fit import fit_batches, measure_step_bytes, predicted_state_bytes, rows_at
from tidal.ir.memory_timeline import interleave, memory_timeline
from tidal.ir.plan import Plan
from tidal.passes.tick_tock import TickTock

LOSS = torch.nn.functional.cross_entropy


def _cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(16, 10))


def _adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def _data(batch):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, 3, 16, 16, generator=g),), torch.randint(0, 10, (batch,),
                                                                        generator=g)


def test_the_batches_are_the_largest_that_fit():
    model = _cnn()
    x, y = _data(4)
    state = predicted_state_bytes(model, _adam(model.parameters()))

    def timeline(b):
        return memory_timeline(capture_train_step(model, rows_at(x, b), rows_at(y, b), LOSS))

    budget = state * 2 + 3_000_000
    fit = fit_batches(timeline, state, budget, limit=512)
    assert 0 < fit.wave_batch and 0 < fit.dp_batch < 512
    assert fit.dp_peak <= budget < state + timeline(fit.dp_batch + 1).peak_bytes
    nxt = timeline(fit.wave_batch + 1)
    assert fit.wave_peak <= budget < 2 * state + interleave(nxt, nxt.forward_us).peak_sum
    # two waves interleaved need less than two waves started together at the same batch
    at = timeline(fit.wave_batch)
    il = interleave(at, at.forward_us)
    assert il.peak_sum < il.peak_gang
    assert fit_batches(timeline, state, state // 2, limit=64).dp_batch == 0  # nothing fits


@pytest.mark.parametrize("batch", [8, 64])
def test_measured_step_memory_is_within_ten_percent_of_the_prediction(batch):
    model = _cnn()
    x, y = _data(batch)
    timeline = memory_timeline(capture_train_step(model, x, y, LOSS))
    got = measure_step_bytes(model, x, y, LOSS, _adam, timeline)
    assert got.measured_state == got.predicted_state  # Adam: exp_avg, exp_avg_sq per param
    assert got.measured_saved > 0 and got.error <= 0.10, got.summary()
    before = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # a copy ran


def test_tick_tock_under_a_budget_reports_the_batches_and_the_measured_step():
    model = _cnn()
    x, y = _data(8)
    cluster = tidal.Cluster(gpus=1, memory_gb=0.004)
    c = tidal.compile(model, x, passes=[TickTock()], cluster=cluster, example_targets=y,
                      loss_fn=LOSS, optimizer=_adam)
    plan = c.plan.get("tick_tock")
    assert plan.memory is not None and plan.memory.wave_batch > 0
    assert plan.step_bytes.batch == 4 and plan.step_bytes.error <= 0.10
    assert Plan.from_json(plan.to_json()) == plan
    report = c.report()
    assert "data parallel batch" in report and "measured" in report
    big_x, big_y = _data(1024)
    small = tidal.compile(_cnn(), big_x, passes=[TickTock()], example_targets=big_y,
                          cluster=cluster, loss_fn=LOSS, optimizer=_adam)
    assert "exceed" in small.report()  # 512 per wave does not fit: the note says so


def test_a_bad_budget_is_named():
    with pytest.raises(ValueError, match="memory_gb"):
        tidal.Cluster(gpus=1, memory_gb=0)

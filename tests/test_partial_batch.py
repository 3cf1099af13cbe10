"""A last, smaller batch (issue 34, item 2): global batches that do not split evenly.

Data parallelism (``compression``, ``runtime/programs/data_parallel.py``) splits a global batch
of B rows over W ranks as ``torch.tensor_split`` does and weights each rank's gradient and loss
by its rows / B, so a step on 7, 8 or 1 rows (rank 1 then has none) equals one process on the
global batch's mean loss (max |Δparam| ≤ 1e-6), with ``Compiled.step`` and with the open step
(``Compiled.backward``, ``no_sync`` accumulation of unequal micro-batches equal to eager
accumulation of ``scale * loss``), and through a compressor (Top-K 100 %: the weighting comes
before compression). ``round_robin`` cuts the global batch into its N micro-batches the same way
and weights each micro-batch's loss by its rows * N / B (micro-batches of two shapes, each
shape captured; one with no rows when B < N runs a stand-in row with weight 0), so its steps
on 7, 5 and 1 rows with 2 partitions equal eager too, closed and open (one process: every
rank's pieces here, a partition run eagerly included; two ranks: the forward transfers are
sized for the micro-batch sent); it refuses, naming itself, only a batch with fewer rows than
partitions on a model with floating-point buffers (the stand-in would update them).
``tick_tock`` refuses a batch it cannot cut into equal shards with a ``BatchError`` naming the
pass and what it needs, on every rank alike and before any collective (a following step runs).
Two gloo ranks share one spawned job.
"""
import contextlib

import pytest
import torch
import torch.nn as nn

import tidal
from tidal.passes.compression import CompressionPass
from tidal.passes.round_robin import RoundRobin
from tidal.passes.tick_tock import TickTock
from tidal.runtime.batch_data import BatchError
from tidal.runtime.distributed import spawn

TOL = 1e-6
BATCHES = (7, 8, 1)
RR_BATCHES = (7, 5, 8, 1)    # 2 partitions: micro-batches of 4+3, 3+2, 4+4, 1+none


class _Gate(nn.Module):
    """Host-side control flow (``float`` of a tensor): ``make_fx`` cannot capture it, so its
    partition runs eagerly. Always doubles (never a tie on the data)."""

    def forward(self, x):
        return x * 2 if float(x.detach().abs().sum()) >= 0 else x


def _model(gate=False):
    torch.manual_seed(0)
    if gate:
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), _Gate(),
                             nn.Linear(16, 3))
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(rows, seed):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _compile(passes, optimizer=_sgd, gate=False):
    x, y = _data(8, 0)
    return tidal.compile(_model(gate), (x,), passes=list(passes), loss_fn=_loss,
                         example_targets=y, optimizer=optimizer,
                         **({"leaf_modules": [_Gate]} if gate else {}))


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _steps_equal_eager(passes, batches, gate=False):
    """``Compiled.step`` on each global batch of ``batches`` rows equals one process's step
    on the batch's mean loss (loss and parameters, ≤ TOL)."""
    c = _compile(passes, gate=gate)
    ref = _model(gate)
    opt = _sgd(ref.parameters())
    for i, rows in enumerate(batches):
        x, y = _data(rows, i)
        got = c.step((x,), y)
        opt.zero_grad()
        want = _loss(ref(x), y)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=TOL)
        diff = _max_diff(c.model, ref)
        assert diff <= TOL, f"{passes} batch {rows}: max |Δparam| {diff:.2e} > {TOL}"
    assert _max_diff(c.model, _model(gate)) > 1e-3   # it trained
    return c


def _backward_equals_eager(passes, micro=BATCHES, single=1, gate=False):
    """One step accumulating micro-batches of ``micro`` rows (scale 1/k, all but the last
    inside no_sync), then one step on ``single`` rows, with the user's SGD: ``.grad`` and the
    parameters equal eager accumulation of ``scale * loss`` (≤ TOL)."""
    c = _compile(passes, optimizer=None, gate=gate)
    ref = _model(gate)
    opts = _sgd(c.model.parameters()), _sgd(ref.parameters())
    for step, sizes in enumerate((micro, (single,))):
        for k, rows in enumerate(sizes):
            x, y = _data(rows, 10 * step + k)
            scale = 1.0 / len(sizes)
            with c.no_sync() if k < len(sizes) - 1 else contextlib.nullcontext():
                got = c.backward((x,), y, scale=scale)
            want = _loss(ref(x), y)
            (want * scale).backward()
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=TOL)
        for p, q in zip(c.model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=TOL)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    diff = _max_diff(c.model, ref)
    assert diff <= TOL, f"{passes} open step: max |Δparam| {diff:.2e} > {TOL}"
    return c


def _refused(passes, rows, match):
    """A step on ``rows`` rows raises a BatchError matching ``match``; a step on 8 rows then
    runs (nothing was left half done)."""
    c = _compile(passes)
    x, y = _data(rows, 0)
    with pytest.raises(BatchError, match=match):
        c.step((x,), y)
    assert torch.isfinite(c.step(*_pair(8)))


def _pair(rows, seed=0):
    x, y = _data(rows, seed)
    return (x,), y


# --- one process -----------------------------------------------------------------------------

@pytest.mark.parametrize("passes", [(), (CompressionPass(mode="off"),)],
                         ids=["no_pass", "compression"])
def test_one_process_batches_of_7_then_8_equal_eager(passes):
    _steps_equal_eager(passes, (7, 8, 7))
    _backward_equals_eager(passes, micro=(7, 8), single=7)


def test_one_process_tick_tock_names_what_it_needs():
    _refused([TickTock(ranks=1)], 7, r"tick_tock: the global batch size 7 is not divisible by "
                                     r"2 x ranks = 2.*drop_last=True")


def test_one_process_round_robin_uneven_batches_equal_eager():
    rr = [RoundRobin(partitions=2)]
    c = _steps_equal_eager(rr, RR_BATCHES)
    ex = c.executor
    assert ex.fallback_reason == "" and ex.uncaptured() == []
    # one capture per micro-batch shape: 4, 3, 2 and 1 rows (8 rows: 4 and 4)
    assert sorted(k[1][0][0][0] for k in ex.graphs) == [1, 2, 3, 4]
    assert all(g is not None for gs in ex.graphs.values() for g in gs)
    _backward_equals_eager(rr, micro=(7, 5, 8), single=1)


def test_one_process_round_robin_uneven_batches_with_an_eager_partition():
    rr = [RoundRobin(partitions=2)]
    c = _steps_equal_eager(rr, (7, 5), gate=True)
    assert "runs eagerly" in c.executor.fallback_reason, c.executor.fallback_reason
    _backward_equals_eager(rr, micro=(7, 5), single=1, gate=True)


def test_one_process_round_robin_refuses_fewer_rows_than_partitions_with_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    x, y = _data(8, 0)
    c = tidal.compile(model, (x,), passes=[RoundRobin(partitions=2)], loss_fn=_loss,
                      example_targets=y, optimizer=_sgd)
    before = [b.clone() for b in model.buffers()]
    with pytest.raises(BatchError, match=r"round_robin: the global batch has 1 rows, fewer "
                                         r"than the 2 partitions.*floating-point buffers"):
        c.step(*_pair(1))
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))   # untouched
    assert torch.isfinite(c.step(*_pair(7)))


# --- two gloo ranks, one spawned job ---------------------------------------------------------

def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _two_ranks(rank, size):
    """compression(none) with step and backward, Top-K 100 % with step, on batches of 7, 8
    and 1 rows, round_robin with step and backward on 7, 5, 8 and 1 rows, against one
    process; the tick_tock refusal."""
    assert size == 2
    out = {"step": _params(_steps_equal_eager([CompressionPass(mode="off")], BATCHES).model),
           "backward": _params(_backward_equals_eager([CompressionPass(mode="off")]).model),
           "topk": _params(_steps_equal_eager([CompressionPass(
               "topk:1.0")], BATCHES).model)}
    _refused([TickTock()], 6, r"tick_tock: the global batch size 6 is not divisible by "
                              r"2 x ranks = 4")
    rr = [RoundRobin(partitions=2)]
    out["rr_step"] = _params(_steps_equal_eager(rr, RR_BATCHES).model)
    out["rr_backward"] = _params(_backward_equals_eager(rr, micro=(7, 5, 8), single=1).model)
    return out


def test_two_ranks_uneven_batches_equal_one_process():
    ranks = spawn(_two_ranks, 2)
    for name in ranks[0]:                            # every rank holds the same parameters
        assert torch.equal(ranks[0][name], ranks[1][name]), name

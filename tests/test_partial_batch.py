"""A last, smaller batch (issue 34, item 2): global batches that do not split evenly.

Data parallelism (``compression``, ``runtime/programs/data_parallel.py``) splits a global batch
of B rows over W ranks as ``torch.tensor_split`` does and weights each rank's gradient and loss
by its rows / B, so a step on 7, 8 or 1 rows (rank 1 then has none) equals one process on the
global batch's mean loss (max |Δparam| ≤ 1e-6), with ``Compiled.step`` and with the open step
(``Compiled.backward``, ``no_sync`` accumulation of unequal micro-batches equal to eager
accumulation of ``scale * loss``), and through a compressor (Top-K 100 %: the weighting comes
before compression). ``tick_tock`` and ``round_robin`` refuse a batch they cannot cut into equal
shards with a ``BatchError`` naming the pass and what it needs, on every rank alike and before
any collective (a following step runs). Two gloo ranks share one spawned job.
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


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(rows, seed):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _compile(passes, optimizer=_sgd):
    x, y = _data(8, 0)
    return tidal.compile(_model(), (x,), passes=list(passes), loss_fn=_loss,
                         example_targets=y, optimizer=optimizer)


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _steps_equal_eager(passes, batches):
    """``Compiled.step`` on each global batch of ``batches`` rows equals one process's step
    on the batch's mean loss (loss and parameters, ≤ TOL)."""
    c = _compile(passes)
    ref = _model()
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
    assert _max_diff(c.model, _model()) > 1e-3       # it trained
    return c


def _backward_equals_eager(passes, micro=BATCHES, single=1):
    """One step accumulating micro-batches of ``micro`` rows (scale 1/k, all but the last
    inside no_sync), then one step on ``single`` rows, with the user's SGD: ``.grad`` and the
    parameters equal eager accumulation of ``scale * loss`` (≤ TOL)."""
    c = _compile(passes, optimizer=None)
    ref = _model()
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


def test_one_process_tick_tock_and_round_robin_name_what_they_need():
    _refused([TickTock(ranks=1)], 7, r"tick_tock: the global batch size 7 is not divisible by "
                                     r"2 x ranks = 2.*drop_last=True")
    _refused([RoundRobin(partitions=2)], 7, r"round_robin: the global batch size 7 is not "
                                            r"divisible by 2 .*drop_last=True")


# --- two gloo ranks, one spawned job ---------------------------------------------------------

def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _two_ranks(rank, size):
    """compression(none) with step and backward, Top-K 100 % with step, on batches of 7, 8
    and 1 rows, against one process; tick_tock and round_robin refusals."""
    assert size == 2
    out = {"step": _params(_steps_equal_eager([CompressionPass(mode="off")], BATCHES).model),
           "backward": _params(_backward_equals_eager([CompressionPass(mode="off")]).model),
           "topk": _params(_steps_equal_eager([CompressionPass(
               "topk:1.0")], BATCHES).model)}
    _refused([TickTock()], 6, r"tick_tock: the global batch size 6 is not divisible by "
                              r"2 x ranks = 4")
    _refused([RoundRobin(partitions=2)], 7, r"round_robin: the global batch size 7 is not "
                                            r"divisible by 2")
    return out


def test_two_ranks_uneven_batches_equal_one_process():
    ranks = spawn(_two_ranks, 2)
    for name in ranks[0]:                            # every rank holds the same parameters
        assert torch.equal(ranks[0][name], ranks[1][name]), name

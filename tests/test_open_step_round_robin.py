"""The open step (``Compiled.backward``, ``no_sync``, ``clip_grad_norm_``) under ``round_robin``:
the loop a user writes around DDP, on the round-robin schedule with no update piece. In one
process against eager PyTorch on the same model (fp32: max |Δparam| ≤ 1e-6; bf16 autocast:
the eager micro-batch accumulation under autocast, ≤ 1e-3): one SGD/AdamW step, accumulation
of 2 micro-batches with ``no_sync`` and ``scale=1/2``, clipping by the global norm, two
optimizers and two param groups with a ``LambdaLR``, open and closed steps alternating. On two
gloo ranks (one spawned job): the same step, accumulation and clipping against eager PyTorch
on the global batch, every rank holding the same parameters and the whole gradient, and a
checkpoint taken inside ``no_sync`` under Top-K (compressor state and the kept gradient)
resumed bit for bit."""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import tidal
from tidal.passes.round_robin import RoundRobin
from tidal.runtime.distributed import spawn

ROWS, STEPS = 8, 2
TOL = dict(rtol=1e-5, atol=1e-6)
BF16_TOL = dict(rtol=1e-3, atol=1e-3)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g)


def _pair(optimizer=None, extra=()):
    """(compiled under round_robin over 2 partitions and the passes ``extra``, its model, an
    eager copy)."""
    model = _model()
    ref = copy.deepcopy(model)
    c = tidal.compile(model, (_batch(0)[0],), passes=[RoundRobin(partitions=2), *extra],
                      loss_fn=F.cross_entropy, optimizer=optimizer)
    return c, model, ref


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _same(model, ref, tol=TOL):
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, **tol, msg=k)


def _moved(model):
    """The parameters left the initial ones (the loop trained: the comparison could fail)."""
    return max((p - q).abs().max().item()
               for p, q in zip(model.parameters(), _model().parameters())) > 1e-3


def _loop(c, ref, make_opts, steps=STEPS, micro=1, clip=None, scheds=None):
    """``steps`` steps of the open loop on ``c`` and of the eager loop on ``ref``: ``micro``
    micro-batches (``no_sync`` but the last, ``scale=1/micro``), clipping by ``clip``, each
    optimizer of ``make_opts(params)`` stepped and zeroed, each scheduler of ``scheds(opt)``
    stepped. Asserts the losses and norms equal; returns the norms."""
    runs = []
    for net in (c, ref):
        opts = make_opts(list(net.parameters()))
        runs.append((net, opts, [s for o in opts for s in (scheds(o) if scheds else ())]))
    norms = []
    for step in range(steps):
        got = []
        for net, opts, sch in runs:
            losses = []
            for i in range(micro):
                x, y = _batch(step * micro + i)
                if net is c:
                    with c.no_sync() if i < micro - 1 else contextlib.nullcontext():
                        losses.append(c.backward(x, y, scale=1 / micro))
                else:
                    loss = F.cross_entropy(ref(x), y)
                    (loss / micro).backward()
                    losses.append(loss.detach())
            norm = None
            if clip is not None:
                norm = (c.clip_grad_norm_(clip) if net is c else
                        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
            for opt in opts:
                opt.step()
                opt.zero_grad()
            for s in sch:
                s.step()
            got.append((torch.stack(losses), norm))
        torch.testing.assert_close(got[0][0], got[1][0], **TOL)
        if clip is not None:
            torch.testing.assert_close(got[0][1], got[1][1], **TOL)
            norms.append(float(got[1][1]))
    return norms


# --- one process ----------------------------------------------------------------------------

@pytest.mark.parametrize("make_opt", [_sgd, _adamw], ids=["sgd", "adamw"])
def test_open_step_and_optimizer_step_equal_eager(make_opt):
    c, model, ref = _pair()
    _loop(c, ref, lambda ps: [make_opt(ps)])
    _same(model, ref)
    assert _moved(model)
    names = [p.name for p in c.executor.last_program.pieces]
    assert names[-1] == "grads" and not any(n == "U" or n.startswith("U") for n in names)


def test_accumulation_over_two_micro_batches_with_no_sync_equals_eager():
    c, model, ref = _pair()
    _loop(c, ref, lambda ps: [_sgd(ps)], micro=2)
    _same(model, ref)
    assert _moved(model)


def test_no_sync_keeps_the_gradient_in_the_program_and_backward_adds_to_grad():
    c, model, ref = _pair()
    x, y = _batch(0)
    with c.no_sync():
        c.backward(x, y, scale=0.5)
    assert all(p.grad is None for p in model.parameters())
    names = [p.name for p in c.executor.last_program.pieces]
    assert names[-1] == "accumulate" and not [n for n in names if n.startswith("A")]
    assert [n for n in names if n.startswith("buffers")] == ["buffers 1", "buffers 0"]
    c.backward(x, y, scale=0.5)                  # the two halves: one whole gradient
    F.cross_entropy(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    c.backward(x, y)                             # added to .grad, as loss.backward() adds
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad, **TOL)


def test_clipping_equals_torch_clip_grad_norm_in_eager():
    c, model, ref = _pair()
    norms = _loop(c, ref, lambda ps: [_sgd(ps)], steps=3, clip=0.1)
    assert min(norms) > 0.1                      # every step clipped: the clip mattered
    _same(model, ref)
    assert not hasattr(c.executor.rank_program, "clip_grad_norm_")  # torch's, on all of them


def test_two_optimizers_and_two_param_groups_with_a_schedule_equal_eager():
    def opts(ps):
        groups = torch.optim.AdamW([{"params": ps[0:2], "weight_decay": 0.0},
                                    {"params": ps[2:4], "weight_decay": 0.1}], lr=1e-2)
        return [groups, torch.optim.SGD(ps[4:], lr=0.1)]

    c, model, ref = _pair()
    _loop(c, ref, opts, steps=3,
          scheds=lambda o: [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1))])
    _same(model, ref)
    assert _moved(model)


def test_bf16_autocast_around_backward_equals_eager_under_autocast():
    """round_robin's gradient is the accumulation of its 2 micro-batches (loss / 2 each): the
    eager reference accumulates the same micro-batches under autocast."""
    c, model, ref = _pair()
    opts = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)]
    for step, on in enumerate((True, True, False)):
        x, y = _batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            loss = c.backward(x, y)
            want = sum(F.cross_entropy(ref(xb), yb) / 2 for xb, yb in zip(x.chunk(2), y.chunk(2)))
        want.backward()
        torch.testing.assert_close(loss, want.detach(), **BF16_TOL)
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **BF16_TOL)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    _same(model, ref, BF16_TOL)


def test_open_and_closed_steps_alternate_on_one_compiled_model():
    c, model, ref = _pair(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        x, y = _batch(step)
        if step % 2:
            c.backward(x, y)
            c.optimizer.step()
            c.optimizer.zero_grad()
            assert c.executor.last_program.pieces[-1].name == "grads"
        else:
            c.step(x, y)
            assert c.executor.last_program.pieces[-1].name == "U"
            c.optimizer.zero_grad()              # the closed step leaves its gradients
        F.cross_entropy(ref(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad()
    _same(model, ref)
    assert c.executor.stats["steps"] == 2        # the closed steps only


# --- two gloo ranks, one spawned job --------------------------------------------------------

def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ranks(rank, world):
    """Every rank passes the global batch: SGD steps, accumulation of 2 micro-batches through
    each partition's compressor (none: the plain sync), and clipping, against eager PyTorch
    on the global batch; then ``no_sync`` + a synchronized call; the parameters of each."""
    from tidal.passes.compression import CompressionPass

    out = {}
    for name, kw in (("step", {}), ("accumulate", dict(micro=2)),
                     ("clip", dict(clip=0.1, steps=3))):
        c, model, ref = _pair(extra=[CompressionPass("none")] if name == "accumulate" else [])
        norms = _loop(c, ref, lambda ps: [_sgd(ps)], **kw)
        _same(model, ref)
        assert _moved(model)
        assert c.executor.resident_partitions() == [0, 1], name   # whole between calls
        assert bool(c.executor.syncs) == (name == "accumulate"), name
        if name == "clip":
            assert min(norms) > 0.1
        out[name] = _params(model)
        if name == "step":
            out["grad"] = _no_sync_then_sync(c, model, ref)
    out["resumed inside no_sync"] = _resume_inside_no_sync()
    return out


def _checkpointed_no_sync(saved=None, load_runtime=True):
    """Under Top-K 30 %: a synchronized call and an SGD step, a call inside ``no_sync`` and a
    checkpoint (model, optimizer, ``runtime_state_dict``) when ``saved`` is None, else a fresh
    compile loading ``saved`` (the runtime state if ``load_runtime``); then a synchronized
    call and a step. Returns (the checkpoint, the parameters)."""
    from tidal.passes.compression import CompressionPass

    c, model, _ = _pair(extra=[CompressionPass("topk:0.3")])
    opt = _sgd(model.parameters())
    if saved is None:
        c.backward(*_batch(0))
        opt.step()
        opt.zero_grad()
        with c.no_sync():
            c.backward(*_batch(1))
        saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                 c.runtime_state_dict())
    else:
        model.load_state_dict(saved[0])
        opt.load_state_dict(copy.deepcopy(saved[1]))   # it would share the momenta
        if load_runtime:
            c.load_runtime_state_dict(saved[2])
    c.backward(*_batch(2))
    opt.step()
    return saved, _params(model)


def _resume_inside_no_sync():
    """A checkpoint taken inside a ``no_sync`` accumulation holds each partition's compressor
    state and the gradient kept for the next synchronized call, by parameter name: a fresh
    compile that loads it continues bit for bit; without it, it differs."""
    saved, want = _checkpointed_no_sync()
    assert sorted(saved[2]) == ["local_grads", "syncs"], sorted(saved[2])
    assert len(saved[2]["local_grads"]) == 6 and sorted(saved[2]["syncs"]) == [0, 1]
    _, resumed = _checkpointed_no_sync(saved)
    assert torch.equal(resumed, want)
    _, fresh = _checkpointed_no_sync(saved, load_runtime=False)
    assert float((fresh - want).abs().max()) > 1e-4
    return resumed


def _no_sync_then_sync(c, model, ref):
    """A call inside ``no_sync`` (nothing all-reduced, ``.grad`` untouched), then one outside:
    ``.grad`` holds both calls' gradients, whole on every rank."""
    x, y = _batch(9)
    with c.no_sync():
        c.backward(x, y)
    names = [p.name for p in c.executor.last_program.pieces]
    assert names[-2:] == ["restore", "accumulate"] and not [n for n in names if n[0] == "A"]
    assert all(p.grad is None for p in model.parameters())
    c.backward(x, y)
    names = [p.name for p in c.executor.last_program.pieces]
    assert names[-2:] == ["restore", "grads"] and not [n for n in names if n[0] == "U"]
    F.cross_entropy(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):   # twice the gradient
        torch.testing.assert_close(p.grad, 2 * q.grad, **TOL)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_two_gloo_ranks_equal_eager_on_the_global_batch():
    first, second = spawn(_ranks, 2)
    for name in first:                           # every rank holds the same parameters
        assert torch.equal(first[name], second[name]), name

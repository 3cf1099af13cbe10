"""The ``compression`` pass: data-parallel steps on gloo ranks (2 ranks in their test, 4 in a
background job while other tests run: ``tests/background_jobs.py``); compression off (or
effectively off) equals eager training on the global batch; the DDP-hook path and the compile
path give the same parameters; the executor's state (residuals, warm-start Q, Accordion)
checkpoints bit for bit; ``mode="auto"`` follows the performance model; the pass emits a plan
and the runtime (``compression_executor``) builds the data-parallel executor or wraps a host's
sync from it."""
import io

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tidal
from tidal.ir.pass_api import PassContext
from tidal.ir.plan import Plan
from tidal.ir.plans.compression import CompressionPlan
from tidal.passes.compression import CompressionPass
from tidal.runtime.comm import ddp_hooks
from tidal.runtime.comm.compressors import NoCompression, PowerSGD, make_compressor
from tidal.runtime.programs.compression import compression_executor
from tidal.runtime.programs.data_parallel import DataParallelProgram

from background_jobs import Job, sized_job

BATCH = 8
LR = 0.1


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 6, 3), nn.ReLU(), nn.Flatten(), nn.Linear(54, 10),
                         nn.ReLU(), nn.Linear(10, 3))


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 2, 5, 5, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _compressor(spec):
    """The spec, with PowerSGD compressing every matrix (the test model's are small)."""
    return spec + ",min_compression_rate=0" if spec.startswith("powersgd") else spec


def _compiled(model, spec, **kw):
    x, _ = _data(0)
    return tidal.compile(model, x, passes=[CompressionPass(compressor=_compressor(spec), **kw)],
                         loss_fn=_loss, optimizer=_sgd)


def _hook_state(spec, module):
    name, level = spec.split(":") if ":" in spec else (spec, None)
    opts = {"min_compression_rate": 0} if name == "powersgd" else {}
    ctor = getattr(ddp_hooks, f"{name}_state")
    args = () if level is None else ((float(level) if name in ("topk", "randomk")
                                      else int(level)),)
    return ctor(module, *args, **opts), getattr(ddp_hooks, name)


def _assert_params(a, b, msg, exact=False):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(p, q), f"{msg}: {n}"
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{msg}: {n}")


def _check_off_equals_eager(rank, size):
    """Plain all-reduce, PowerSGD at full rank and Top-K 100 %: two steps equal eager steps on
    the global batch."""
    for spec, kw in (("powersgd:4", {"mode": "off"}), ("powersgd:10", {}), ("topk:1.0", {}),
                     ("randomk:1.0", {})):
        _steps_equal_eager(_compiled(_model(), spec, **kw), f"{spec} {kw}")
    return True


def _steps_equal_eager(compiled, what):
    """Two steps of ``compiled`` equal eager SGD steps on the global batch."""
    ref = _model()
    opt = _sgd(ref.parameters())
    for step in range(2):
        x, y = _data(step)
        loss = compiled.step((x,), y)
        opt.zero_grad()
        ref_loss = _loss(ref(x), y)
        ref_loss.backward()
        opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        _assert_params(compiled.model, ref, f"{what} step {step}")


def _check_hooks_equal_compile(rank, size):
    per = BATCH // size
    for spec in ("powersgd:2", "topk:0.2", "randomk:0.3", "signsgd", "qsgd:4"):
        a = _model()
        ddp = DDP(a)
        state, hook = _hook_state(spec, a)
        ddp.register_comm_hook(state, hook)
        opt = _sgd(ddp.parameters())
        compiled = _compiled(_model(), spec)
        for step in range(3):
            x, y = _data(step)
            opt.zero_grad()
            _loss(ddp(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
            opt.step()
            compiled.step((x,), y)
            _assert_params(compiled.model, a, f"{spec} step {step}")
    return True


def _check_checkpoint(rank, size):
    """Stop after 3 steps, save the executor, model and optimizer, restore into a fresh
    compile, and continue: identical to not stopping."""
    for spec, kw in (("powersgd:3", {"accordion": (3, 1), "accordion_interval": 1}),
                     ("topk:0.2", {"accordion": (0.5, 0.1), "accordion_interval": 2}),
                     ("qsgd:4", {})):
        a = _compiled(_model(), spec, **kw)
        for step in range(3):
            a.step(*_pair(step))
        buf = io.BytesIO()
        torch.save({"exec": a.executor.state_dict(), "model": a.model.state_dict(),
                    "opt": a.optimizer.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf)
        b = _compiled(_model(), spec, **kw)
        b.model.load_state_dict(saved["model"])
        b.optimizer.load_state_dict(saved["opt"])
        b.executor.load_state_dict(saved["exec"])
        if "accordion" in kw:
            assert b.executor.accordion.history == a.executor.accordion.history
            assert len(a.executor.accordion.history) >= 1
        for step in range(3, 6):
            la, lb = a.step(*_pair(step)), b.step(*_pair(step))
            assert torch.equal(la, lb), f"{spec} loss step {step}"
            _assert_params(a.model, b.model, f"{spec} step {step}", exact=True)
    return True


def _pair(step):
    x, y = _data(step)
    return (x,), y


def _check_uneven_batch_trains(rank, size):
    """A global batch that does not split evenly over the ranks (a last, smaller batch) trains:
    the ranks' shards are weighted by their rows (tests/test_partial_batch.py checks the
    values against one process)."""
    compiled = _compiled(_model(), "topk:0.5")
    x, y = _data(0)
    return bool(torch.isfinite(compiled.step((x[:7],), y[:7])))


def _check_program_runs_as_simulated(rank, size):
    """Compressed data parallelism as a program (Top-K 100 %, two buckets): two steps of
    ``Compiled.step`` equal eager steps on the global batch; the syncs of a compressor start
    after backward as the dissertation's §4.2.1 runs them; the simulator, running this rank's own ``last_program`` with
    the durations of every rank's ``last_trace``, orders the pieces of each stream of each rank
    as the executor did, and both start every piece after the pieces it depends on."""
    import torch.distributed as dist

    from tidal.runtime.program import COMM
    from tidal.sim.engine import simulate
    from tidal.sim.programs import (join_ranks, measured_durations, simulated_order,
                                    trace_order)

    compiled = _compiled(_model(), "topk:1.0", bucket_mb=580 * 4 / 2**20)
    _steps_equal_eager(compiled, "program")
    program, trace = compiled.executor.last_program, compiled.executor.last_trace
    assert compiled.executor.fallback_reason == "" and len(trace) == len(program.pieces)
    comm = [i for i, p in enumerate(program.pieces) if p.stream == COMM]
    assert sorted(program.pieces[i].name for i in comm) == ["broadcast", "sync 0", "sync 1"]
    last_segment = max(i for i, p in enumerate(program.pieces) if p.nodes)
    assert comm[1] > last_segment  # compressed syncs wait for the end of backward (§4.2.1)
    traces = [None] * size
    dist.all_gather_object(traces, trace)
    traces = dict(enumerate(traces))
    assert simulated_order(program, traces) == trace_order(traces)
    sim = [i for i in simulate(join_ranks(program, measured_durations(traces)))
           if i.gpu == rank]
    modelled = {i.name: i for i in sim}
    for piece, t in zip(program.pieces, trace):
        for d in piece.deps:
            assert t.start_us >= trace[d].end_us, (piece.name, trace)
            assert modelled[piece.name].start_us >= modelled[program.pieces[d].name].end_us
    return True


def _all(rank, size):
    return [f(rank, size) for f in (_check_off_equals_eager, _check_hooks_equal_compile,
                                    _check_checkpoint, _check_uneven_batch_trains,
                                    _check_program_runs_as_simulated)]


def test_one_process_step_equals_eager_with_compression_off():
    assert _check_off_equals_eager(0, 1)


def test_plan_round_trips_and_buckets_close_at_the_cap_as_ddp():
    compiled = _compiled(_model(), "powersgd:2", bucket_mb=580 * 4 / 2**20)
    plan = compiled.plan.get("compression")
    assert isinstance(plan, CompressionPlan) and plan.enabled
    assert Plan.from_json(plan.to_json()) == plan
    names = [n for n, _ in compiled.model.named_parameters()]
    assert [n for b in plan.buckets for n in b] == names[::-1]       # reverse order, all once
    sizes = dict((n, p.numel()) for n, p in compiled.model.named_parameters())
    assert len(plan.buckets) > 1
    # as DDP: a bucket closes once it holds the cap or more (its last gradient may pass it)
    assert all(sum(sizes[n] for n in b[:-1]) < 580 for b in plan.buckets)
    assert all(sum(sizes[n] for n in b) >= 580 for b in plan.buckets[:-1])
    assert plan.payload_bytes == sum(PowerSGD(2, min_compression_rate=0).payload_bytes(
        tuple(p.shape)) for p in compiled.model.parameters())


def test_auto_mode_follows_the_performance_model():
    x, _ = _data(0)

    def run(gbps):
        c = tidal.compile(_model(), x, passes=[CompressionPass(
            compressor="powersgd:1", mode="auto", encode_decode_ms=0.01)],
            cluster=tidal.Cluster(gpus=8, bandwidth_gbps=gbps, latency_us=1),
            loss_fn=_loss, optimizer=_sgd)
        return c.plan.get("compression"), c.report(), c.executor.compressor

    plan, report, comp = run(1e-4)
    assert plan.enabled and plan.predicted_compressed_ms < plan.predicted_sync_ms
    assert isinstance(comp, PowerSGD) and "compression on" in report
    plan, report, comp = run(1e5)
    assert not plan.enabled and plan.predicted_compressed_ms >= plan.predicted_sync_ms
    assert isinstance(comp, NoCompression) and "off (no predicted speedup)" in report


@pytest.mark.parametrize("kw, match", [
    ({"mode": "sometimes"}, "mode 'sometimes'"),
    ({"compressor": "zip"}, "unknown compressor 'zip'"),
    ({"compressor": "powersgd:2", "accordion": (0, 1)}, "rank 0"),
    ({"compressor": "topk:0.1", "accordion": (0.5, 1.5)}, "fraction 1.5"),
    ({"bucket_mb": 0}, "bucket_mb=0"),
    ({"accordion_interval": 0}, "accordion_interval=0"),
])
def test_bad_options_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        CompressionPass(**kw)


def test_hook_rejects_a_mismatched_state():
    with pytest.raises(TypeError, match="powersgd hook needs a HookState with a PowerSGD"):
        ddp_hooks.powersgd(ddp_hooks.topk_state(_model(), 0.1), None)


def test_after_tick_tock_the_pass_wraps_its_sync_and_refuses_accordion():
    from tidal.passes.tick_tock import TickTock

    x, y = _data(0)
    kw = dict(loss_fn=_loss, optimizer=_sgd, example_targets=y)
    c = tidal.compile(_model(), x, passes=[TickTock(ranks=1), CompressionPass("topk:0.5")], **kw)
    assert type(c.executor.rank_program).__name__ == "TickTockProgram"   # not the DP program
    assert any("wraps the gradient sync of tick_tock" in n
               for r in c.records for n in r.notes)
    c.step((x,), y)
    assert {w: s.compressor.spec() for w, s in c.executor.syncs.items()} == \
        {"T": "topk:0.5", "K": "topk:0.5"}
    assert c.executor.syncs["T"].compressor.residual("0.weight") is not None  # error feedback
    with pytest.raises(tidal.PassError, match="accordion switching .* not available on top "
                                              "of 'tick_tock'"):
        tidal.compile(_model(), x, passes=[TickTock(ranks=1),
                                           CompressionPass("powersgd:4", accordion=(4, 1))],
                      **kw)


# --- plan level: the pass emits data, the runtime builds from it ------------------------------

def _ctx(**kw):
    x, y = _data(0)
    return PassContext.for_inputs((x,), model=_model(), loss_fn=_loss, optimizer=_sgd,
                                  example_targets=y, **kw)


def _plan(**kw):
    ctx = _ctx()
    p = CompressionPass(**kw)
    p.requires(None, ctx)
    result = p(None, ctx)
    return result.plan


def test_a_compressor_object_is_read_through_its_spec():
    obj = make_compressor("powersgd:2", min_compression_rate=0, seed=3)
    assert _plan(compressor=obj) == _plan(compressor="powersgd:2,min_compression_rate=0,seed=3")
    assert _plan(compressor=obj).compressor == obj.spec()
    with pytest.raises(TypeError, match="spec string like 'powersgd:4'"):
        CompressionPass(compressor=4)


def test_auto_mode_measures_through_the_context_or_says_what_it_needs():
    seen = []

    def measure(spec, shapes):
        seen.append((spec, list(shapes)))
        return 1e-5

    ctx = _ctx(cluster=tidal.Cluster(gpus=8, bandwidth_gbps=1e-4, latency_us=1),
               encode_decode_s=measure)
    gm = tidal.compile(ctx.model, ctx.example_inputs).graph_module     # traced, costs annotated
    plan = CompressionPass("topk:0.1", mode="auto")(gm, ctx).plan
    names = [n for b in plan.buckets for n in b]
    shapes = dict((n, tuple(p.shape)) for n, p in ctx.model.named_parameters())
    assert plan.enabled and seen == [("topk:0.1", [shapes[n] for n in names])]
    with pytest.raises(tidal.PassError, match="mode='auto' needs the encode\\+decode time"):
        CompressionPass("topk:0.1", mode="auto")(gm, _ctx())


def test_the_runtime_measurer_has_the_context_signature():
    from tidal.runtime.comm.compressors.modeling import encode_decode_s

    assert encode_decode_s("powersgd:2", [(16, 8), (8,)]) > 0


def test_accordion_schedule_is_recorded_as_data():
    plan = _plan(compressor="powersgd:2", accordion=(2, 1), accordion_interval=3,
                 accordion_lr_schedule=lambda s: 0.1 if s < 6 else 0.01,
                 accordion_lr_horizon=30)
    assert plan.accordion == (2.0, 1.0, 0.5, 3) and plan.accordion_levels == (2, 1)
    assert plan.accordion_lr_decays == ((6, 0.1, 0.01),) and plan.accordion_lr_horizon == 30
    assert Plan.from_json(plan.to_json()) == plan
    assert "decay ahead after steps 6" in plan.table()
    ex = compression_executor(plan, None)
    assert ex.lr_lookahead.now_and_next(6, 3, 0.1) == (0.1, 0.01)
    assert ex.lr_lookahead.now_and_next(30, 3, 0.01) is None        # past the horizon
    with pytest.raises(ValueError, match=r"accordion_lr_schedule\(4\) failed"):
        _plan(accordion=(4, 1), accordion_lr_schedule=([0.1] * 4).__getitem__,
              accordion_lr_horizon=10)


def test_compression_executor_alone_is_data_parallel_from_the_plan():
    plan = _plan(compressor="qsgd:4", accordion=(8, 2), accordion_interval=2)
    ex = compression_executor(plan, None)
    assert isinstance(ex.rank_program, DataParallelProgram) and ex.compressor.spec() == "qsgd:4"
    assert ex.buckets == plan.buckets and ex.accordion_interval == 2
    assert (ex.accordion.low, ex.accordion.high, ex.accordion.eta) == (8, 2, 0.5)
    model = _model()
    opt = _sgd(model.parameters())
    for step in range(2):
        ex.step(model, model, *_pair(step), _loss, opt)
    assert len(ex.accordion.history) == 1 and set(ex.state_dict()) >= {"compressor",
                                                                       "accordion"}
    off = compression_executor(_plan(compressor="qsgd:4", mode="off"), None)
    assert isinstance(off.compressor, NoCompression)


class _Host:
    def __init__(self):
        self.factory = None

    def forward(self, gm, *args):
        return gm(*args)

    def step(self, *args):
        return None

    def use_grad_sync(self, factory):
        self.factory = factory


def test_compression_executor_wraps_a_host_sync():
    plan = _plan(compressor="topk:0.5", bucket_mb=1)
    host = _Host()
    assert compression_executor(plan, host) is host
    a, b = host.factory(None), host.factory(None)
    assert a.compressor.spec() == "topk:0.5" and a.compressor is not b.compressor
    assert a.bucket_bytes == plan.bucket_bytes == 2**20
    off = _Host()
    compression_executor(_plan(mode="off"), off)
    assert off.factory(None).compressor.spec() == "none"


def test_compression_executor_refusals_name_the_reason():
    class NoHook:
        def forward(self, gm, *args):
            return None

        def step(self, *args):
            return None

    with pytest.raises(tidal.PassError, match="NoHook\\) does not take one"):
        compression_executor(_plan(), NoHook())
    with pytest.raises(tidal.PassError, match="accordion switching .* not available on top"):
        compression_executor(_plan(accordion=(4, 1)), _Host())
    wrapping = CompressionPlan(**{**_plan().__dict__, "wraps": "tick_tock"})
    with pytest.raises(tidal.PassError, match="no executor was built for 'tick_tock'"):
        compression_executor(wrapping, None)


def test_a_checkpoint_with_the_runtime_state_resumes_a_compressor_bit_for_bit(tmp_path):
    """PowerSGD keeps residuals and a warm-started Q: Compiled.runtime_state_dict() saves them
    beside the model and optimizer, and a fresh compile that loads all three continues the
    uninterrupted run exactly (without it, the resumed run differs)."""
    x, y = _data(0)

    def compiled():
        model = _model()
        return model, tidal.compile(model, (x,), passes=[CompressionPass("powersgd:1")],
                                    loss_fn=torch.nn.functional.cross_entropy,
                                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1,
                                                                         momentum=0.9))

    model, c = compiled()
    for step in range(4):
        if step == 2:
            torch.save({"model": c.state_dict(), "optim": c.optimizer.state_dict(),
                        "runtime": c.runtime_state_dict()}, tmp_path / "ckpt.pt")
        c.step(*_data(step))
    model2, c2 = compiled()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    c2.load_state_dict(saved["model"])
    c2.optimizer.load_state_dict(saved["optim"])
    c2.load_runtime_state_dict(saved["runtime"])
    for step in (2, 3):
        c2.step(*_data(step))
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v), k


# --- on gloo ranks: last in the module, so that the 4-rank job, queued in the background when
# collection ends, runs while the one-process tests above do ---------------------------------

BACKGROUND_SIZE = 4
"""The world size whose job runs in the background (the larger: 4 ranks on 2 cores)."""


def background_job(items):
    """The 4-rank job, run in the background while other tests run (``tests/conftest.py``),
    when its test is collected; the 2-rank job runs in its test."""
    return sized_job(items, "test_compression_pass_on_gloo_ranks", _all, BACKGROUND_SIZE)


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_compression_pass_on_gloo_ranks(size, request, background_jobs):
    # the background run's result for 4 ranks (a failed one reruns here), else spawned here
    ranks = background_jobs.result(request.module.__name__, Job(_all, size))
    assert ranks == [[True] * 5] * size

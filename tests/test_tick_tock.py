"""tick_tock: the gradient each wave applies is Lemma 1's mean over 2N shards; both replicas
match an independent simulation of the two waves; on 2 gloo ranks the simulator runs each rank's
program (its pieces on the tick, tock and comm streams) in the order the executor ran it;
schedule, plan and bad input."""
import copy

import pytest
import torch

import tidal
from tidal.ir.plan import Plan
from tidal.passes.tick_tock import TickTock, tick_tock_schedule
from tidal.runtime.distributed import spawn

from rank_parts import part, spawn_parts

STEPS = 4
BATCH = 8
TOL = dict(rtol=1e-5, atol=1e-6)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, 6, generator=g),), torch.randint(0, 3, (BATCH,), generator=g)


def _opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _shard_grads(model, x, y, shards):
    """Per-shard gradient of the mean loss, by parameter name."""
    out = []
    size = x.shape[0] // shards
    for s in range(shards):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[s * size:(s + 1) * size]),
                                          y[s * size:(s + 1) * size]).backward()
        out.append({k: p.grad.clone() for k, p in model.named_parameters()})
    return out


def _mean(grads):
    return {k: sum(g[k] for g in grads) / len(grads) for k in grads[0]}


def _reference(world):
    """Lemma 1 simulated directly: G_m = mean of the 2N shard gradients of iterations m-1, m
    (G_0: the N tick shards), each wave applying its G with its own optimizer."""
    tick, tock = _model(), _model()
    opts = {"T": _opt(tick.parameters()), "K": _opt(tock.parameters())}
    prev_tock, applied = None, []
    for step in range(STEPS):
        (x,), y = _data(step)
        n = BATCH // 2
        g_tick = _shard_grads(tick, x[:n], y[:n], world)
        g_tock = _shard_grads(tock, x[n:], y[n:], world)
        G_tick = _mean(g_tick + (prev_tock or []))
        G_tock = _mean(g_tock + g_tick)
        for model, G, w in ((tick, G_tick, "T"), (tock, G_tock, "K")):
            for k, p in model.named_parameters():
                p.grad = G[k].clone()
            opts[w].step()
        prev_tock = g_tock
        applied.append({"T": G_tick, "K": G_tock})
    return applied, tick.state_dict(), tock.state_dict()


def _train(world, extra=(), model_fn=None):
    """tick_tock (plus ``extra`` passes) for STEPS steps on ``model_fn()`` (default: _model):
    the compiled model and, as plain data, each step's applied wave gradients, the final
    parameters and the tock replica."""
    model = (model_fn or _model)()
    x, y = _data(0)
    c = tidal.compile(model, x, passes=[TickTock(ranks=world), *extra], example_targets=y,
                      loss_fn=torch.nn.functional.cross_entropy, optimizer=_opt)
    applied = []
    for step in range(STEPS):
        x, y = _data(step)
        c.step(x, y)
        applied.append({w: dict(g) for w, g in c.executor.last_applied.items()})
    return c, _plain((applied, model.state_dict(), c.executor.tock.state_dict()))


def _run_tick_tock(rank, world):
    return _train(world)[1]


def _plain(obj):
    """Tensors as numpy arrays (results cross process boundaries by plain pickling)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _tensors(obj):
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tensors(v) for v in obj)
    return torch.as_tensor(obj)


def _check(result, world):
    applied, tick_sd, tock_sd = _tensors(result)
    ref_applied, ref_tick, ref_tock = _reference(world)
    for step, (got, want) in enumerate(zip(applied, ref_applied)):
        for wave in ("T", "K"):
            for k in want[wave]:
                torch.testing.assert_close(got[wave][k], want[wave][k], **TOL,
                                           msg=f"step {step} wave {wave} {k}")
    for k in ref_tick:
        torch.testing.assert_close(tick_sd[k], ref_tick[k], **TOL, msg=f"tick {k}")
        torch.testing.assert_close(tock_sd[k], ref_tock[k], **TOL, msg=f"tock {k}")
    assert not torch.equal(tick_sd["0.weight"], tock_sd["0.weight"])  # two real replicas


def test_one_process_waves_follow_lemma_1():
    _check(_run_tick_tock(0, 1), 1)


class _Counting(torch.nn.Module):
    """_model with a buffer its forward writes in place: how many samples it saw."""

    def __init__(self):
        super().__init__()
        self.net = _model()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(x.shape[0])
        return self.net(x)


def test_compute_pieces_are_captured_and_a_buffer_written_in_place_is_refused():
    c, _ = _train(1)
    assert c.executor.uncaptured() == []  # every node of both waves' F and B runs captured
    # each wave runs its own replica on half the batch: the model's buffer would count only
    # the tick wave's shard (eager counts the whole batch), so the pass refuses, naming it
    from tidal.ir.capture import BufferUpdateError

    with pytest.raises(BufferUpdateError, match=r"'seen'.*tick_tock"):
        _train(1, model_fn=_Counting)


def _two_ranks(rank, world):
    """The 2-rank run as _check reads it, with the executor's last program, its trace (the
    pieces as they ran) and why the waves ran eagerly ('' when they ran captured segments),
    and the final replicas of the same training through ``Compiled.train_scheduled`` (persistent waves:
    the steps overlap)."""
    c, result = _train(world)
    return (result, c.executor.last_program, c.executor.last_trace, c.executor.fallback_reason,
            _train_persistent(world))


def _train_persistent(world, backend=None):
    """STEPS steps through ``Compiled.train_scheduled`` (a ``Runtime`` on ``backend`` when given): the
    final parameters and tock replica (plain data), and the scheduler's trace."""
    from tidal.runtime.scheduler import Runtime

    model = _model()
    x, y = _data(0)
    c = tidal.compile(model, x, passes=[TickTock(ranks=world)], example_targets=y,
                      loss_fn=torch.nn.functional.cross_entropy, optimizer=_opt)
    if backend is None:
        c.train_scheduled(_data, STEPS)
        trace = c.train_trace
    else:
        with Runtime(backend=backend) as rt:
            rt.submit(c.job(_data, iterations=STEPS), priority="high")
            rt.run()
            trace = rt.trace
    return _plain((model.state_dict(), c.executor.tock.state_dict())), trace


def test_persistent_waves_overlap_across_steps_and_train_as_separate_steps():
    # Compiled.train_scheduled binds step m + 1 while step m runs: on a logical clock (F 10, B 20, the
    # syncs and updates 1 µs) the tick's forward of step m + 1 runs during the tock's backward
    # of step m, and the replicas end exactly as Lemma 1 says (as separate steps do)
    from tidal.runtime.backend import LogicalBackend

    times = {"F": 10.0, "B": 20.0, "A": 1.0, "U": 1.0}
    backend = LogicalBackend(lambda label, _: times.get(label.rsplit(" ", 1)[-1], 0.0))
    (tick_sd, tock_sd), trace = _train_persistent(1, backend)
    _, ref_tick, ref_tock = _reference(1)
    for k in ref_tick:
        torch.testing.assert_close(torch.as_tensor(tick_sd[k]), ref_tick[k], **TOL)
        torch.testing.assert_close(torch.as_tensor(tock_sd[k]), ref_tock[k], **TOL)
    piece = {(r.piece, r.iteration): r for r in trace}
    for m in range(STEPS - 1):
        tock_b, tick_f = piece[("tock B", m)], piece[("tick F", m + 1)]
        assert tock_b.start_us < tick_f.start_us < tock_b.end_us, (m, tock_b, tick_f)
        assert tick_f.start_us < piece[("loss", m)].end_us  # a step boundary is no barrier


@pytest.fixture(scope="module")
def two_rank_job():
    """One 2-rank job for every 2-rank case of this module: {case: the ranks' results}."""
    return spawn_parts(2, [part(_two_ranks), part(_bn_statistics), part(_run_composed)])


@pytest.fixture(scope="module")
def two_ranks(two_rank_job):
    return two_rank_job["_two_ranks"]


@pytest.mark.slow
def test_two_gloo_ranks_waves_follow_lemma_1_and_replicas_match_reference(two_ranks):
    _, ref_tick, ref_tock = _reference(2)
    for result, _, _, why, ((tick_sd, tock_sd), trace) in two_ranks:
        assert why == ""  # the waves ran segments of the captured joint graph
        _check(result, 2)
        for k in ref_tick:  # persistent waves (Compiled.train_scheduled) end as separate steps do
            torch.testing.assert_close(torch.as_tensor(tick_sd[k]), ref_tick[k], **TOL)
            torch.testing.assert_close(torch.as_tensor(tock_sd[k]), ref_tock[k], **TOL)
        firsts = [min(r.start_us for r in trace if r.iteration == m) for m in range(STEPS)]
        lasts = [max(r.end_us for r in trace if r.iteration == m) for m in range(STEPS)]
        assert any(f < e for f, e in zip(firsts[1:], lasts)), "every step drained"


@pytest.mark.slow
def test_the_simulator_runs_the_ranks_programs_in_the_order_they_ran(two_ranks):
    # the program of each rank (ProgramExecutor's last_program) and its measured trace: the
    # simulator, timing each piece as measured, starts the pieces of every stream of every rank
    # in the order they ran, and both respect what the dependencies force across streams
    from tidal.sim.engine import simulate
    from tidal.sim.programs import (join_ranks, measured_durations, simulated_order,
                                    trace_order)

    programs = {r: out[1] for r, out in enumerate(two_ranks)}
    traces = {r: out[2] for r, out in enumerate(two_ranks)}
    for r, program in programs.items():
        assert [t.name for t in traces[r]] == [p.name for p in program.pieces]
        assert {p.stream for p in program.pieces} == {"tick", "tock", "comm"}
        assert all(p.nodes for p in program.pieces if p.name[-1] in "FB")  # captured segments
    assert simulated_order(programs, traces) == trace_order(traces)
    sim = simulate(join_ranks(programs, measured_durations(traces)))
    forced = (("tick F", "tock F"), ("tick B", "tock A"), ("tock B", "tock A"),
              ("tick A", "tick U"), ("tock A", "tock U"), ("tock F", "loss"))
    for r in programs:
        real = {t.name: (t.start_us, t.end_us) for t in traces[r]}
        modelled = {i.name: (i.start_us, i.end_us) for i in sim if i.gpu == r}
        for when in (real, modelled):
            for first, then in forced:
                assert when[first][1] <= when[then][0], (r, first, then, when)


def _bn_statistics(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(),
                                torch.nn.Linear(6, 3))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8 * world, 6, generator=g), torch.randint(0, 3, (8 * world,), generator=g)
    with torch.no_grad():  # what BatchNorm sees on each of the 2N shards
        seen = [model[0](xs) for xs in x.chunk(2 * world)]
    c = tidal.compile(model, (x,), passes=[TickTock(ranks=world)], example_targets=y,
                      loss_fn=torch.nn.functional.cross_entropy, optimizer=_opt)
    c.step((x,), y)
    tock_bn = c.executor.tock.get_submodule("1")
    return model[1].running_mean.clone(), tock_bn.running_mean.clone(), seen


def test_batchnorm_statistics_are_averaged_within_each_wave(two_rank_job):
    (tick0, tock0, seen), (tick1, tock1, _) = two_rank_job["_bn_statistics"]
    torch.testing.assert_close(tick0, tick1, rtol=0, atol=0)
    torch.testing.assert_close(tock0, tock1, rtol=0, atol=0)
    m = 0.1  # momentum: one update per rank and wave, then the wave's average over 2 ranks
    torch.testing.assert_close(tick0, m * (seen[0].mean(0) + seen[1].mean(0)) / 2)
    torch.testing.assert_close(tock0, m * (seen[2].mean(0) + seen[3].mean(0)) / 2)


def test_schedule_lanes_offset_and_round_trip():
    s = tick_tock_schedule(ranks=2, fwd_us=1.0, bwd_us=2.0, allreduce_us=0.5, steps=2)
    s.check()
    tick = s.for_rank(0, "T")
    tock = s.for_rank(0, "K")
    assert [a.label(False) for a in tick[:4]] == ["T:F0", "T:B0", "T:A0", "T:U0"]
    assert tock[0].start_us == pytest.approx(1.0)  # one forward behind
    # the tock forward overlaps the tick backward (two lanes)
    assert tock[0].start_us < tick[1].end_us and tock[0].end_us > tick[1].start_us
    assert Plan.from_json(s.to_json()) == s


def test_plan_artifacts_and_report():
    model = _model()
    x, y = _data(0)
    c = tidal.compile(model, x, passes=[TickTock(ranks=2)], example_targets=y,
                      loss_fn=torch.nn.functional.cross_entropy, optimizer=_opt)
    plan = c.plan.get("tick_tock")
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.wave_batch == BATCH // 4 and plan.offset_us > 0
    assert plan.offset_us < plan.iteration_us
    assert "T:F0 T:B0" in plan.table()
    record = next(r for r in c.records if r.name == "tick_tock")
    assert record.artifacts["tick_tock_memory.svg"].startswith("<svg")
    assert "rank 1" in record.artifacts["tick_tock_gantt.svg"]


def test_bad_input_is_named():
    model = _model()
    x, y = _data(0)
    with pytest.raises(tidal.PassError, match="batch size 8 is not divisible by 2 x ranks = 6"):
        tidal.compile(model, x, passes=[TickTock(ranks=3)], example_targets=y,
                      loss_fn=torch.nn.functional.cross_entropy, optimizer=_opt)
    with pytest.raises(ValueError, match="ranks=0"):
        TickTock(ranks=0)
    c = tidal.compile(model, x, passes=[TickTock(ranks=1)], example_targets=y,
                      loss_fn=torch.nn.functional.cross_entropy, optimizer=_opt)
    with pytest.raises(ValueError, match="batch size 5 is not divisible by 2"):
        c.step((torch.randn(5, 6),), torch.zeros(5, dtype=torch.long))
    copy.deepcopy(c.plan)


# --- the compression pass wraps the waves' gradient sync (runtime/comm/grad_sync.py) -------------

def _run_composed(rank, world):
    """tick_tock alone, and tick_tock + compression off / Top-K 100 % / PowerSGD rank 1."""
    from tidal.passes.compression import CompressionPass

    out = {}
    for tag, extra in (("plain", []), ("off", [CompressionPass(mode="off")]),
                       ("topk1", [CompressionPass(compressor="topk:1.0")]),
                       ("psgd1", [CompressionPass(compressor="powersgd:1")])):
        c, result = _train(world, extra)
        out[tag] = (result, {w: s.compressor.spec() for w, s in c.executor.syncs.items()})
    return out


def test_compression_wraps_tick_tock_sync_and_off_equals_all_reduce(two_rank_job):
    for r in two_rank_job["_run_composed"]:
        assert r["off"][1] == {"T": "none", "K": "none"}
        assert r["topk1"][1] == {"T": "topk:1", "K": "topk:1"}
        plain, off, topk, psgd = (_tensors(r[k][0]) for k in ("plain", "off", "topk1", "psgd1"))
        for step in range(STEPS):
            for wave in ("T", "K"):
                for k, g in plain[0][step][wave].items():
                    assert torch.equal(off[0][step][wave][k], g), (step, wave, k)  # bit for bit
                    torch.testing.assert_close(topk[0][step][wave][k], g, **TOL)
        for k, v in plain[1].items():                                   # parameters
            assert torch.equal(off[1][k], v) and torch.allclose(topk[1][k], v, **TOL)
        # and both match Lemma 1 simulated in one process (eager gradients, plain averages)
        _check(r["off"][0], 2)
        # PowerSGD rank 1 really runs: a 8x6 weight's gradient is not rank 1
        assert not torch.allclose(psgd[0][0]["T"]["0.weight"], plain[0][0]["T"]["0.weight"])


def test_compression_after_a_plan_it_does_not_wrap_trains_data_parallel():
    # layer_groups' weight-loading executor takes no gradient sync: a compression plan that
    # wraps nothing runs its own data-parallel program, as it did before plans composed
    from tidal.ir.plans.compression import CompressionPlan
    from tidal.runtime import executors

    class LayerGroupPlan:  # stands for the real plan: only its kind and weight store matter
        weight_store = "never-opened.tws"

    plan = CompressionPlan(compressor="topk:0.5", mode="on", enabled=True, bucket_bytes=1 << 20,
                           buckets=(("w",),), grad_bytes=4, payload_bytes=4)
    executor = executors.build(None, [LayerGroupPlan(), plan])
    assert type(executor.rank_program).__name__ == "DataParallelProgram"


STALL_TIMEOUT_S = 3.0


def _stalled_peer(rank, world, failed_flag):
    """Both ranks train one step; then rank 1 stalls and rank 0 steps alone. Rank 1 stalls
    until rank 0's step has failed (rank 0 then creates ``failed_flag``), at most
    ``10 * STALL_TIMEOUT_S``: the job then ends without waiting out the stall."""
    import os
    import time

    model = _model()
    x, y = _data(0)
    c = tidal.compile(model, x, passes=[TickTock(ranks=world)], example_targets=y,
                      loss_fn=torch.nn.functional.cross_entropy, optimizer=_opt)
    c.step(x, y)
    if rank == 1:
        give_up = time.monotonic() + 10 * STALL_TIMEOUT_S
        while not os.path.exists(failed_flag) and time.monotonic() < give_up:
            time.sleep(0.05)
        return None
    start = time.monotonic()
    try:
        c.step(x, y)
    except tidal.TidalError as e:  # the wave sync's own error (a note names the piece)
        raise RuntimeError(f"{e} [after {time.monotonic() - start:.1f} s]") from None
    finally:
        open(failed_flag, "w").close()  # rank 1 may stop stalling now
    return None


def test_a_stalled_peer_fails_the_wave_sync_within_the_world_timeout(tmp_path):
    """The wave groups take the world group's timeout; before, they had torch's 30-minute
    default and rank 0 blocked until its peer went away."""
    from tidal.runtime.distributed import RankError

    with pytest.raises(RankError) as info:
        spawn(_stalled_peer, 2, str(tmp_path / "rank0-failed"), pg_timeout_s=STALL_TIMEOUT_S,
              timeout_s=120)
    message = str(info.value)
    assert info.value.rank == 0 and "a peer rank stalled or died" in message, message
    elapsed = float(message.split("[after ")[1].split(" s]")[0])
    assert elapsed < 5 * STALL_TIMEOUT_S, message  # the world timeout, not the peer's return


def _two_groups(params):
    """SGD with momentum over two param groups (weights, biases), different rates."""
    params = list(params)
    return torch.optim.SGD([{"params": params[0::2], "lr": 0.1},
                            {"params": params[1::2], "lr": 0.05, "weight_decay": 0.01}],
                           lr=0.1, momentum=0.9)


def _halving(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def test_the_tock_wave_follows_the_users_groups_and_schedule_every_step():
    """A learning-rate schedule on ``compiled.optimizer`` (two param groups) drives both waves:
    Lemma 1's reference with the schedule stepping both waves' optimizers (was: the tock's
    clone kept the first step's rate)."""
    tick, tock = _model(), _model()
    opts = {"T": _two_groups(tick.parameters()), "K": _two_groups(tock.parameters())}
    scheds = [_halving(o) for o in opts.values()]
    model = _model()
    x, y = _data(0)
    c = tidal.compile(model, x, passes=[TickTock(ranks=1)], example_targets=y,
                      loss_fn=torch.nn.functional.cross_entropy, optimizer=_two_groups)
    sched = _halving(c.optimizer)
    prev_tock = None
    for step in range(STEPS):
        (x,), y = _data(step)
        c.step((x,), y)
        sched.step()
        n = BATCH // 2
        g_tick = _shard_grads(tick, x[:n], y[:n], 1)
        g_tock = _shard_grads(tock, x[n:], y[n:], 1)
        for m, G, w in ((tick, _mean(g_tick + (prev_tock or [])), "T"),
                        (tock, _mean(g_tock + g_tick), "K")):
            for k, p in m.named_parameters():
                p.grad = G[k].clone()
            opts[w].step()
        prev_tock = g_tock
        for s in scheds:
            s.step()
    for k, v in tock.state_dict().items():
        torch.testing.assert_close(c.executor.tock.state_dict()[k], v, **TOL, msg=f"tock {k}")
    for k, v in tick.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, **TOL, msg=f"tick {k}")


def test_a_checkpoint_resumes_both_waves_bit_for_bit(tmp_path):
    """model + optimizer + schedule + Compiled.runtime_state_dict() (the tock replica, its
    optimizer, the kept tock gradient) saved after 2 steps, loaded into a fresh compile: the
    next 2 steps equal the uninterrupted run's exactly."""
    def compiled():
        model = _model()
        x, y = _data(0)
        c = tidal.compile(model, x, passes=[TickTock(ranks=1)], example_targets=y,
                          loss_fn=torch.nn.functional.cross_entropy, optimizer=_two_groups)
        return model, c, _halving(c.optimizer)

    model, c, sched = compiled()
    for step in range(4):
        if step == 2:
            torch.save({"model": c.state_dict(), "optim": c.optimizer.state_dict(),
                        "sched": sched.state_dict(), "runtime": c.runtime_state_dict()},
                       tmp_path / "ckpt.pt")
        c.step(*_data(step))
        sched.step()
    model2, c2, sched2 = compiled()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    c2.load_state_dict(saved["model"])
    c2.optimizer.load_state_dict(saved["optim"])
    sched2.load_state_dict(saved["sched"])
    c2.load_runtime_state_dict(saved["runtime"])
    for step in (2, 3):
        c2.step(*_data(step))
        sched2.step()
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v), k
    for k, v in c.executor.tock.state_dict().items():
        assert torch.equal(c2.executor.tock.state_dict()[k], v), k

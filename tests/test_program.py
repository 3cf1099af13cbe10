"""Programs (``tidal.runtime.program``): a data-parallel step as pieces on a compute and a comm
stream. On 2 gloo ranks the step equals one single-process SGD step on the global batch, and the
gradient all-reduce of the first bucket runs while the compute stream is still in backward
(overlap is real); with ``overlap=False`` every all-reduce waits for the whole backward."""
import copy
import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tidal.ir.capture import capture_train_step
from tidal.runtime.program import COMM, COMPUTE, ProgramRunner, chrome_trace, data_parallel

from rank_parts import part, spawn_parts

BATCH = 64
WIDTH = 1024  # each hidden layer's backward takes milliseconds: the first all-reduce overlaps


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, WIDTH), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTH, 10))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 128, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def test_program_cuts_the_backward_where_each_bucket_is_ready():
    model, (x, y) = _model(), _data()
    step = capture_train_step(model, (x,), y, F.cross_entropy)
    p = data_parallel(step, world=2, bucket_bytes=1 << 20)
    names = [q.name for q in p.pieces]
    assert names[0] == "segment 0" and names[-1] == "optimizer"
    comm = [i for i, q in enumerate(p.pieces) if q.stream == COMM]
    assert len(comm) >= 2 and comm[0] < len(p.pieces) - 2  # an all-reduce before backward ends
    for i in comm:  # each waits for the segment just before it, which finishes its gradients
        assert p.pieces[i].deps == (i - 1,) and p.pieces[i - 1].stream == COMPUTE
    grads = sorted(g for i in comm for g in p.pieces[i].grads)
    assert grads == list(range(len(step.param_names)))  # every gradient in one bucket
    serial = data_parallel(step, world=2, bucket_bytes=1 << 20, overlap=False)
    first_comm = min(i for i, q in enumerate(serial.pieces) if q.stream == COMM)
    assert all(q.stream == COMM for q in serial.pieces[first_comm:-1])


def _dp_steps(rank, size):
    return {overlap: _dp_step(rank, size, overlap) for overlap in (True, False)}


def _dp_step(rank, size, overlap):
    torch.set_num_threads(1)
    model, (x, y) = _model(), _data()
    ref = copy.deepcopy(model)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    step = capture_train_step(model, (x[rows],), y[rows], F.cross_entropy)
    p = data_parallel(step, size, bucket_bytes=1 << 20, overlap=overlap)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    traces, losses = [], []
    with ProgramRunner() as run:
        for _ in range(2):
            opt.zero_grad()
            loss, _, trace = run(p, step, model, (x[rows],), y[rows], opt)
            losses.append(float(loss))
            traces.append(trace)
            ref_opt.zero_grad()
            want = F.cross_entropy(ref(x), y)
            want.backward()
            ref_opt.step()
            losses.append(float(want.detach()))
    err = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
    return losses, err, traces[-1]


def _collectives_per_step(rank, size):
    """The all-reduces one data-parallel step makes, and how many buckets its program has."""
    model, (x, y) = _model(), _data()
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    step = capture_train_step(model, (x[rows],), y[rows], F.cross_entropy)
    p = data_parallel(step, size, bucket_bytes=1 << 20, overlap=True)
    calls = []
    all_reduce = torch.distributed.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)
    with ProgramRunner() as run:
        run(p, step, model, (x[rows],), y[rows])
        torch.distributed.all_reduce = counted
        try:
            loss, _, _ = run(p, step, model, (x[rows],), y[rows])
        finally:
            torch.distributed.all_reduce = all_reduce
    return calls, sum(1 for q in p.pieces if q.stream == COMM), float(loss)


@pytest.fixture(scope="module")
def two_rank_job():
    """One 2-rank job for every 2-rank case of this module: {case: the ranks' results}."""
    return spawn_parts(2, [part(_dp_steps), part(_compiled_dp), part(_batchnorm_state),
                           part(_collectives_per_step)],
                       timeout_s=420)


def test_two_ranks_step_equals_one_process_and_overlap_is_real(two_rank_job):
    for overlap, (losses, err, trace) in [(o, r) for ranks in two_rank_job["_dp_steps"]
                                          for o, r in ranks.items()]:
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
        assert losses[2] == pytest.approx(losses[3], rel=1e-5)
        assert err < 1e-5
        backward_end = max(t.end_us for t in trace if t.name.startswith("segment"))
        first_reduce = min(t.start_us for t in trace if t.stream == COMM)
        if overlap:  # the first bucket's all-reduce starts while backward still runs
            assert first_reduce < backward_end, trace
        else:
            assert first_reduce >= backward_end, trace
        events = chrome_trace({0: trace})["traceEvents"]
        assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {COMPUTE, COMM}
        for t in trace:   # a sync piece issues its all-reduce; the trace says when it ended
            assert t.ready_us is not None and t.ready_us <= t.start_us <= t.end_us, t
            assert (t.done_us is not None) == (t.stream == COMM), t
            if t.stream == COMM:
                waiter = next(u for u in trace if u.name == "optimizer")
                assert t.start_us <= t.done_us <= waiter.end_us, (t, waiter)


def test_the_loss_rides_on_a_bucket_all_reduce(two_rank_job):
    """Was: one more all-reduce per step for the loss alone (a gloo round of its own)."""
    (calls, buckets, loss0), (calls1, _, loss1) = two_rank_job["_collectives_per_step"]
    assert len(calls) == buckets == len(calls1), (calls, buckets)
    assert loss0 == loss1   # every rank gets the same mean loss


def test_the_simulator_runs_the_same_program_in_the_same_order():
    # the executor's trace and the simulator's timeline of the same Program object, with the
    # measured durations: the same piece order on each stream, and the simulated all-reduce of
    # the first bucket overlaps backward too
    from tidal.sim.engine import simulate
    from tidal.sim.programs import join_ranks

    model, (x, y) = _model(), _data()
    step = capture_train_step(model, (x[:BATCH // 2],), y[:BATCH // 2], F.cross_entropy)
    p = data_parallel(step, world=2, bucket_bytes=1 << 20)
    with ProgramRunner() as run:
        run(p, step, model, (x[:BATCH // 2],), y[:BATCH // 2])
        _, _, trace = run(p, step, model, (x[:BATCH // 2],), y[:BATCH // 2])
    measured = {t.name: t.end_us - t.start_us for t in trace}
    sim = simulate(join_ranks(p, lambda rank, name: measured[name]))
    for stream, lane in ((COMPUTE, "compute"), (COMM, "link")):
        real = [t.name for t in sorted(trace, key=lambda t: t.start_us) if t.stream == stream]
        modelled = [i.name for i in sorted(sim, key=lambda i: i.start_us)
                    if i.gpu == 0 and i.lane == lane]
        assert real == modelled, (stream, real, modelled)
    backward_end = max(i.end_us for i in sim if i.name.startswith("segment"))
    assert min(i.start_us for i in sim if i.lane == "link") < backward_end


def _compiled_dp(rank, size):
    import tidal
    from tidal.passes.compression import CompressionPass

    out = {}
    for name, model, x, y in (
            ("mlp", _model(), *_data()),
            ("lstm", torch.nn.LSTM(8, 8, batch_first=True), torch.randn(BATCH, 3, 8),
             torch.randn(BATCH, 3, 8))):
        ref = copy.deepcopy(model)

        def loss_fn(out, target):
            return F.mse_loss(out[0], target) if isinstance(out, tuple) else \
                F.cross_entropy(out, target)

        c = tidal.compile(model, (x,), passes=[CompressionPass(mode="off")], loss_fn=loss_fn,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        loss = float(c.step((x,), y))
        want = loss_fn(ref(x), y)
        want.backward()
        torch.optim.SGD(ref.parameters(), lr=0.1).step()
        err = max(float((a - b).abs().max()) for a, b in zip(model.parameters(),
                                                             ref.parameters()))
        out[name] = (type(c.executor.rank_program).__name__, loss, float(want.detach()), err,
                     [t.stream for t in c.executor.last_trace], c.executor.fallback_reason,
                     [p.name for p in c.executor.last_program.pieces])
        out[name, "done"] = [(t.name, t.start_us <= t.done_us) for t in c.executor.last_trace
                             if t.done_us is not None]
        path = c.trace(Path(tempfile.mkdtemp()) / f"rank{rank}.json")
        events = json.loads(path.read_text())["traceEvents"]
        out[name, "trace"] = sorted({(e["pid"], e["args"]["name"]) for e in events
                                     if e["ph"] == "M"})
    return out


def test_compile_runs_plain_data_parallelism_as_a_program(two_rank_job):
    # compression off is plain data parallelism: Compiled.step runs the program (with its
    # trace); a step whose captured graph cannot run (the LSTM's fused kernel) falls back to
    # the eager data-parallel program (forward and backward pieces, then the syncs) and says
    # why, naming the node; both equal the one-process step
    spawn_results = two_rank_job["_compiled_dp"]
    for result in spawn_results:
        kind, loss, want, err, streams, why, pieces = result["mlp"]
        assert kind == "DataParallelProgram" and why == "" and COMM in streams
        assert pieces[:2] == ["broadcast", "segment 0"] and pieces[-1] == "optimizer"
        assert loss == pytest.approx(want, rel=1e-5) and err < 1e-5
        kind, loss, want, err, streams, why, pieces = result["lstm"]
        assert "failed to run: node " in why and COMM in streams
        assert pieces[:3] == ["broadcast", "forward", "backward"] and pieces[-1] == "optimizer"
        assert loss == pytest.approx(want, rel=1e-5) and err < 1e-5
    for name in ("mlp", "lstm"):
        assert [r[name, "trace"] for r in spawn_results] == [[(0, COMM), (0, COMPUTE)],
                                                             [(1, COMM), (1, COMPUTE)]]
        for result in spawn_results:   # each sync's trace says when its bucket's sync ended
            done = result[name, "done"]
            assert done and all(ok and n.startswith("sync") for n, ok in done), done


def _batchnorm_state(rank, size):
    # the captured program and the eager data-parallel program hold the same BatchNorm
    # statistics on every rank after two steps: both start each step from rank 0's buffers
    from tidal.ir.plans.compression import CompressionPlan
    from tidal.runtime.program import ProgramExecutor
    from tidal.runtime.programs.compression import from_plan
    from tidal.runtime.programs.data_parallel import DataParallelProgram

    x, y = _data()
    out = []
    for make in (lambda plan: ProgramExecutor(from_plan(None, plan)),
                 lambda plan: ProgramExecutor(DataParallelProgram(capture=False))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 32), torch.nn.BatchNorm1d(32),
                                    torch.nn.ReLU(), torch.nn.Linear(32, 10))
        gm = torch.fx.symbolic_trace(model)
        names = tuple(n for n, _ in model.named_parameters())
        plan = CompressionPlan(compressor="none", mode="off", enabled=False, bucket_bytes=1 << 20,
                               buckets=(names,), grad_bytes=0, payload_bytes=0)
        ex, opt = make(plan), torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            ex.step(gm, model, (x,), y, F.cross_entropy, opt)
        out.append([b.clone() for b in model.buffers()])
    return out


def test_the_program_keeps_batchnorm_statistics_as_eager_data_parallelism(two_rank_job):
    for program, eager in two_rank_job["_batchnorm_state"]:
        for a, b in zip(program, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_segments_are_captured_and_an_input_write_runs_uncaptured_once():
    """The joint graph is lowered: static runs are captured steps; a buffer written in place
    runs uncaptured, is named, and is written once per step (capture runs on copies)."""
    from tidal.ir.capture import capture_train_step
    from tidal.runtime import program

    from counting import Counting

    torch.manual_seed(0)
    model, x, y = Counting(), torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    step = capture_train_step(model, (x,), y, torch.nn.functional.cross_entropy)
    p = program.data_parallel(step, world=1)
    with program.ProgramRunner() as run:
        loss, grads, _ = run(p, step, model, (x,), y)
        (captured,) = run._captures.values()
    kinds = [info.kind for info in captured.lowered.report.steps]
    assert "captured" in kinds
    (node, reason), = captured.uncaptured()
    assert node.startswith("add_") and "in-place update" in reason
    assert float(model.seen) == 6.0
    eager = copy.deepcopy(model)
    torch.nn.functional.cross_entropy(eager(x), y).backward()
    for name, param in eager.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6)


def test_a_failing_piece_stops_the_program_and_is_named():
    """A program run alone stops at a failing piece: none of its dependents runs, nothing is
    launched after it, and its error is raised with a note naming it."""
    from tidal.ir.program import Piece, Program

    ran = []

    def work(index, piece):
        def run():
            ran.append(piece.name)
            if piece.name == "all_reduce 0":
                raise RuntimeError("peer gone")
        return run

    p = Program((Piece("segment 0", COMPUTE), Piece("all_reduce 0", COMM, (0,)),
                 Piece("optimizer", COMPUTE, (1,)), Piece("segment 1", COMPUTE, (2,))))
    with ProgramRunner() as run:
        with pytest.raises(RuntimeError, match="peer gone") as info:
            run.launch(p, work)
        assert ran == ["segment 0", "all_reduce 0"]
        assert info.value.__notes__ == ["in piece 'all_reduce 0' of the program"]
        ran.clear()
        trace = run.launch(p, lambda i, piece: lambda: ran.append(piece.name))
    assert ran == [q.name for q in p.pieces]  # the runner still runs the next program
    assert [(t.name, t.stream) for t in trace] == [(q.name, q.stream) for q in p.pieces]
    assert all(t.start_us <= t.end_us for t in trace)


def test_a_replaced_parameter_is_found_again():
    """The runner keeps the model's step tensors from step to step, and finds them again
    when a parameter object is replaced (the gradient goes to the new one)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    step = capture_train_step(model, (x,), y, F.cross_entropy)
    p = data_parallel(step, world=1)
    with ProgramRunner() as run:
        run(p, step, model, (x,), y)
        old = model[2].weight
        model[2].weight = torch.nn.Parameter(old.detach() * 2)
        _, grads, _ = run(p, step, model, (x,), y)
    eager = copy.deepcopy(model)
    for q in eager.parameters():
        q.grad = None
    F.cross_entropy(eager(x), y).backward()
    assert model[2].weight.grad is not None and model[2].weight is not old
    torch.testing.assert_close(grads["2.weight"], eager[2].weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[2].weight.grad, eager[2].weight.grad, rtol=1e-5,
                               atol=1e-6)

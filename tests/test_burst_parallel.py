"""burst_parallel: the rewritten graph and its program. In one process it is plain training;
on 2 and 4 gloo ranks, for a chain and an Inception-style model and several plans (searched and
hand-written), the loss and every parameter gradient equal the single-process global-batch run
(float64, rtol=1e-5, atol=1e-6) and the parameters stay identical on every rank. The step runs
as a program (``tidal.runtime.programs.burst``) whose pieces the simulator runs in the same
order."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tidal
from tidal.ir import collectives, cost, meta
from tidal.ir.errors import PassError
from tidal.ir.plans.burst import BurstPlan
from tidal.passes.burst_parallel import BurstParallel, build_problem
from tidal.passes.burst_planner import plan_from_counts
from tidal.runtime.distributed import spawn

BATCH = 8


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.c2(F.relu(self.c1(x))))
        x = torch.flatten(self.pool(x), 1)
        return self.fc2(F.relu(self.fc1(x)))


class Branchy(nn.Module):
    """Inception-style: a stem, a 3-branch block joined by cat, a residual block, a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.b0 = nn.Conv2d(8, 4, 1)
        self.b1_a = nn.Conv2d(8, 4, 1)
        self.b1_b = nn.Conv2d(4, 6, 3, padding=1)
        self.b2_pool = nn.MaxPool2d(3, stride=1, padding=1)
        self.b2_conv = nn.Conv2d(8, 6, 1)
        self.r = nn.Conv2d(16, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = torch.cat([self.b0(x), self.b1_b(F.relu(self.b1_a(x))),
                       self.b2_conv(self.b2_pool(x))], 1)
        x = x + F.relu(self.r(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class Flat(nn.Module):
    """Flattens with ``x.view(x.size(0), -1)``: the row count comes from the tensor itself."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc1 = nn.Linear(32, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.c1(x)))
        x = x.view(x.size(0), -1)
        return self.fc2(F.relu(self.fc1(x)))


class Normed(nn.Module):
    """Convolutions with BatchNorm: running statistics are buffers updated in training."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.c1(x)))
        x = F.relu(self.bn2(self.c2(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class Inplace(nn.Module):
    """In-place ReLUs and a residual add on values that cross the program's backward cuts."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.act(self.c1(x))
        x = x + self.act(self.c2(x))
        return self.fc(torch.flatten(self.pool(x), 1))


MODELS = {"chain": Chain, "branchy": Branchy, "flat": Flat, "normed": Normed,
          "inplace": Inplace}


def _data():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, 3, 6, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (BATCH,), generator=g))


def _cluster(gpus):
    """A slow device, so the tiny test models' layers cost more than moving their samples."""
    return tidal.Cluster(gpus=gpus, bandwidth_gbps=100, latency_us=5, peak_tflops=1e-4)


def _hand_plan(model, x, gpus, spec):
    """A plan written by hand: ``spec`` is ('cycle', counts) to give layers counts in turn,
    ('layers', {name: count}) for the named layers (the others on every GPU), or 'branches' to
    run the branches of every block on GPUs of their own."""
    gm = tidal.trace(model, (x,))
    cost.annotate(gm, (x,))
    problem = build_problem(gm, _cluster(gpus), BATCH)
    if spec == "branches":  # branch 0 on half the GPUs, the others on one GPU each
        counts = dict.fromkeys(problem.names, gpus)
        parallel = []
        for join, b in problem.branches():
            if join.startswith("cat"):
                for name in problem.branch_layers(join, b):
                    counts[name] = max(1, gpus // 2) if b == 0 else 1
                if 0 < b < gpus - gpus // 2 + 1:
                    parallel.append((join, b))
        return plan_from_counts(problem, counts, parallel)
    if spec[0] == "layers":
        return plan_from_counts(problem, {n: spec[1].get(n, gpus) for n in problem.names})
    cycle = [min(c, gpus) for c in spec[1]]
    return plan_from_counts(problem, [cycle[i % len(cycle)] for i in range(len(problem.names))])


def _compile(model, x, gpus, spec):
    if spec == "auto":
        p = BurstParallel(amp_limit=2.0, power_of_two=True)
    else:
        p = BurstParallel(plan=_hand_plan(model, x, gpus, spec).to_json())
    return tidal.compile(model, (x,), passes=[p], cluster=_cluster(gpus), loss_fn=F.cross_entropy,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))


def _equivalence(rank, size, cases):
    torch.set_default_dtype(torch.float64)
    out = []
    for model_name, spec in cases:
        torch.manual_seed(0)
        model = MODELS[model_name]().double()
        ref = copy.deepcopy(model)
        x, y = _data()
        compiled = _compile(model, x, size, spec)
        plan = compiled.plan.get("burst_parallel")
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        for it in range(3):
            loss = compiled.step((x,), y)
            ref_opt.zero_grad()
            ref_loss = F.cross_entropy(ref(x), y)
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6,
                                       msg=f"{model_name} {spec} step {it}: loss")
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                           msg=f"{model_name} {spec} step {it}: grad of {name}")
            ref_opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(flat, torch.cat([p.detach().reshape(-1)
                                                    for p in ref.parameters()]),
                                   rtol=1e-5, atol=1e-6)
        ex = compiled.executor
        out.append((flat.tolist(), [l.gpus for l in plan.layers], plan.parallel_branches,
                    (type(ex).__name__, ex.fallback_reason, ex.last_program, ex.last_trace)))
    return out


CASES = [("chain", "auto"), ("chain", ("cycle", [4, 1, 2])), ("chain", ("cycle", [1, 4])),
         ("branchy", "auto"), ("branchy", ("cycle", [2, 4, 1])), ("branchy", "branches")]


def _check_ranks(size, cases):
    results = spawn(_equivalence, size, cases, timeout_s=600)
    _check_results(cases, results)
    return results


def _check_results(cases, results):
    for k, (model_name, spec) in enumerate(cases):
        params = [r[k][0] for r in results]
        for other in params[1:]:  # identical on every rank after 3 optimizer steps
            assert other == params[0], (model_name, spec)
        gpus = results[0][k][1]
        if spec != "auto":  # hand-written plans really change the GPU count between layers
            assert len(set(gpus)) > 1, (model_name, spec, gpus)
        if spec == "branches":
            assert results[0][k][2], "the branch plan runs branches on GPUs of their own"


@pytest.mark.slow
def test_two_ranks_match_single_process():
    _check_ranks(2, [CASES[1], CASES[4], CASES[5]])


SKIP_CASES = [("flat", ("layers", {"view": 1, "fc1": 1})),
              ("flat", ("layers", {"pool": 1, "relu_1": 1})),
              ("inplace", ("layers", {"c1": 1}))]  # an in-place ReLU on a value cut for backward


@pytest.fixture(scope="module")
def skip_results():
    """One 2-rank job for the skip cases, read by the two tests below."""
    return spawn(_equivalence, 2, SKIP_CASES, timeout_s=600)


def test_ranks_outside_a_layers_set_skip_it(skip_results):
    # rank 1 holds none of view/fc1's rows (it skips them: view(0, -1) would fail), and
    # view's size(0) must count the rows view gets, not those of pool's GPU set
    _check_results(SKIP_CASES, skip_results)


def test_the_program_runs_on_two_ranks_and_in_the_simulator(skip_results):
    # the steps above ran as programs (ProgramExecutor through Compiled.step, equal to the
    # one-process step); the simulator runs the same Program objects with the measured
    # durations: per rank and stream the same piece order as the real trace, and every piece
    # after the pieces it depends on, in both
    from tidal.sim.engine import simulate
    from tidal.sim.programs import program_tasks

    lanes = {"compute": "compute", "comm": "link"}
    for k, case in enumerate(SKIP_CASES):
        runs = {rank: r[k][3] for rank, r in enumerate(skip_results)}
        programs, measured = {}, {}
        for rank, (kind, reason, program, trace) in runs.items():
            assert kind == "ProgramExecutor" and "scatter" in reason, (case, kind, reason)
            assert [t.name for t in trace] == [p.name for p in program.pieces], case
            assert any(p.stream == "comm" for p in program.pieces), case
            programs[rank] = program
            measured[rank] = {t.name: t.end_us - t.start_us for t in trace}
        sim = simulate(program_tasks(programs, lambda rank, name: measured[rank][name]))
        for rank, (_, _, program, trace) in runs.items():
            mine = [i for i in sim if i.gpu == rank]
            for stream, lane in lanes.items():
                real = [t.name for t in sorted(trace, key=lambda t: t.start_us)
                        if t.stream == stream]
                modelled = [i.name for i in sorted(mine, key=lambda i: i.start_us)
                            if i.lane == lane]
                assert real == modelled, (case, rank, stream, real, modelled)
            when = {i.name: (i.start_us, i.end_us) for i in mine}
            for piece, t in zip(program.pieces, trace):
                for d in piece.deps:
                    dep = program.pieces[d].name
                    assert trace[d].end_us <= t.start_us, (case, rank, piece.name, dep)
                    assert when[dep][1] <= when[piece.name][0] + 1e-6, (case, rank, piece.name)


def _buffers_after_one_step(rank, size):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = Normed().double()
    ref = copy.deepcopy(model)
    x, y = _data()
    compiled = _compile(model, x, size, ("layers", {"c1": 1, "bn1": 1}))
    compiled.step((x,), y)
    F.cross_entropy(ref(x), y).backward()  # the single-process run's statistics
    return ({n: b.clone() for n, b in model.named_buffers()},
            {n: b.clone() for n, b in ref.named_buffers()})


def test_batchnorm_buffers_are_the_same_on_every_rank():
    results = spawn(_buffers_after_one_step, 2, timeout_s=300)
    (b0, ref), (b1, _) = results
    for name in ref:
        torch.testing.assert_close(b0[name], b1[name], rtol=0, atol=0, msg=name)
    # bn1 ran on rank 0 alone, on the whole batch: exactly the single-process statistics,
    # broadcast to rank 1, which skipped the layer
    for name in ("bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"):
        torch.testing.assert_close(b1[name], ref[name], rtol=1e-9, atol=1e-12, msg=name)
    # bn2 ran on both ranks, 4 rows each: the mean of the shards' means is the batch mean
    torch.testing.assert_close(b1["bn2.running_mean"], ref["bn2.running_mean"],
                               rtol=1e-9, atol=1e-12)
    assert not torch.equal(b1["bn2.running_mean"], torch.zeros(8))


@pytest.mark.slow
def test_four_ranks_match_single_process():
    _check_ranks(4, [CASES[0], CASES[1], CASES[4], CASES[5]])


def test_one_process_is_plain_training_and_graph_is_rewritten():
    torch.manual_seed(0)
    model = Branchy().double()
    ref = copy.deepcopy(model)
    x, y = _data()
    compiled = _compile(model, x, 4, ("cycle", [2, 4, 1]))
    gm = compiled.graph_module
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert collectives.SCATTER in ops and collectives.GATHER in ops
    marked = [meta.get_pass_meta(n, "burst_parallel") for n in gm.graph.nodes]
    assert {m.gpus for m in marked if isinstance(m, meta.BurstPlacement)} == {1, 2, 4}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    assert out_node.args[0].target == collectives.GATHER  # output gathered to every rank
    exact = dict(rtol=1e-12, atol=1e-12)  # float64; the same ops, but not a kernel-exact claim
    torch.testing.assert_close(compiled(x), ref(x), **exact)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        loss = compiled.step((x,), y)
        opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), **exact)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **exact)


def test_backward_stages_give_the_gradients_of_one_backward():
    # the 2-rank layout of rank 0, its forward and backward pieces run in one process (the
    # collectives are the identity): the backward, cut after the collectives where a GPU set's
    # gradients become final, gives exactly the gradients of one eager backward
    from tidal.runtime.programs.burst import BurstStep

    for model_cls, spec in ((Inplace, ("layers", {"c1": 1})), (Branchy, ("cycle", [2, 1]))):
        torch.manual_seed(0)
        model = model_cls().double()
        ref = copy.deepcopy(model)
        x, y = _data()
        compiled = _compile(model, x, 2, spec)
        burst = compiled.executor.rank_program
        layout = burst.layout(compiled.graph_module, rank=0, size=2)
        assert layout.stages.cuts, (model_cls.__name__, layout.program.table())
        step = BurstStep(burst, layout, compiled.graph_module, compiled.graph_module, (x,), y,
                         F.cross_entropy, compiled.optimizer)
        for i, piece in enumerate(layout.program.pieces):
            if piece.name.startswith(("forward", "backward")):
                step.work(i, piece)()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(step.loss(), ref_loss.detach(), rtol=0, atol=0)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_report_artifacts_replay_and_fallback():
    torch.manual_seed(0)
    model = Chain().double()
    x, _ = _data()
    compiled = tidal.compile(model, (x,), passes=[BurstParallel(amp_limit=1.0)],
                             cluster=_cluster(4))  # forward-only compile still plans
    plan = compiled.plan.get("burst_parallel")
    assert isinstance(plan, BurstPlan) and plan.world == 4
    record = compiled.records[-1]
    assert record.artifacts["burst_plan.svg"].startswith("<svg")
    assert "predicted iteration" in record.artifacts["burst_plan.txt"]
    if plan.fallback:
        assert any("running data parallel" in n for n in record.notes)
    again = tidal.compile(model, (x,), passes=[BurstParallel(plan=plan)], cluster=_cluster(4))
    assert again.plan.get("burst_parallel") == plan
    with pytest.raises(PassError, match="saved plan is for 4 GPUs"):
        tidal.compile(model, (x,), passes=[BurstParallel(plan=plan)], cluster=_cluster(2))
    with pytest.raises(ValueError, match="amp_limit=0.5"):
        BurstParallel(amp_limit=0.5)
    with pytest.raises(PassError, match="not a power of two"):
        tidal.compile(model, (x,), passes=[BurstParallel()], cluster=_cluster(6))
    with pytest.raises(PassError, match="batch of 8.*smaller than the 16 GPUs|global batch"):
        tidal.compile(model, (x,), passes=[BurstParallel()], cluster=_cluster(16))


def _composed(rank, size):
    """burst_parallel alone, then with the compression pass off / Top-K 100 % / PowerSGD-1."""
    from tidal.passes.compression import CompressionPass

    torch.set_default_dtype(torch.float64)
    x, y = _data()
    out = {}
    for tag, extra in (("plain", []), ("off", [CompressionPass(mode="off")]),
                       ("topk1", [CompressionPass(compressor="topk:1.0")]),
                       ("psgd1", [CompressionPass(compressor="powersgd:1")])):
        torch.manual_seed(0)
        model = MODELS["chain"]().double()
        plan = _hand_plan(model, x, size, ("cycle", [1, 2])).to_json()
        compiled = tidal.compile(model, (x,), passes=[BurstParallel(plan=plan)] + extra,
                                 cluster=_cluster(size), loss_fn=F.cross_entropy,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05))
        grads = []
        for _ in range(2):
            compiled.step((x,), y)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        out[tag] = grads
    return out


def test_compression_wraps_the_burst_sync():
    results = spawn(_composed, 2, timeout_s=300)
    for r in results:
        for step, plain in enumerate(r["plain"]):
            for name, g in plain.items():
                # off is the same sum (averaged, then scaled back by the rank count)
                torch.testing.assert_close(r["off"][step][name], g, rtol=1e-12, atol=1e-12)
                # compressors send float32 on the wire: float32 rounding of float64 gradients
                torch.testing.assert_close(r["topk1"][step][name], g, rtol=1e-6, atol=1e-8)
        changed = [n for n, g in r["plain"][0].items()
                   if g.dim() == 2 and not torch.allclose(r["psgd1"][0][n], g)]
        assert changed, "PowerSGD rank 1 must change a matrix gradient"
    for name, g in results[0]["psgd1"][-1].items():  # every rank applies the same gradient
        torch.testing.assert_close(results[1]["psgd1"][-1][name], g, rtol=0, atol=0)

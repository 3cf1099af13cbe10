"""burst_parallel: the rewritten graph and its program. In one process it is plain training;
on 2 and 4 gloo ranks, for a chain and an Inception-style model and several plans (searched and
hand-written), the loss and the gradient of every parameter a rank owns equal the
single-process global-batch run (float64, rtol=1e-5, atol=1e-6), and so do the parameters after
3 steps. State is owner-only: a rank's optimizer holds exactly the parameters of the layers it
runs, it receives no gradient of the others, the owners of a parameter hold identical copies,
the ranks' checkpoints together are the whole model, and inference on every rank gives the
model's output. Gradients are synced in buckets of consecutive layers on the same ranks, each
issued when its layers' backward ends. The step runs as a program
(``tidal.runtime.programs.burst``) whose pieces the simulator runs in the same order."""
import copy
import io

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

from rank_parts import part, spawn_parts

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


def _compile(model, x, gpus, spec, bucket_bytes=None):
    if spec == "auto":
        p = BurstParallel(amp_limit=2.0, power_of_two=True)
    else:
        p = BurstParallel(plan=_hand_plan(model, x, gpus, spec).to_json())
    compiled = tidal.compile(model, (x,), passes=[p], cluster=_cluster(gpus),
                             loss_fn=F.cross_entropy,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    if bucket_bytes is not None:  # read when the first step builds its layout
        compiled.executor.rank_program.bucket_bytes = bucket_bytes
    return compiled


def owned_names(compiled, model):
    """The names of ``model``'s parameters that this rank owns under the burst program (by
    identity with the graph's tensors)."""
    mine = {id(t) for t in compiled.executor.owned(compiled.graph_module).values()}
    return [n for n, p in model.named_parameters() if id(p) in mine]


def _runs_layer(compiled, rank):
    """Per module name, whether ``rank`` runs the layer of the plan that calls it (from the
    plan, not from the program's ownership map)."""
    plan = compiled.plan.get("burst_parallel")
    out = {}
    for n in compiled.graph_module.graph.nodes:
        placed = meta.get_pass_meta(n, "burst_parallel")
        if n.op == "call_module" and isinstance(placed, meta.BurstPlacement):
            out[str(n.target)] = rank in plan.layer(placed.unit).ranks
    return out


def _equivalence(rank, size, cases):
    torch.set_default_dtype(torch.float64)
    out = []
    for model_name, spec, *cap in cases:
        torch.manual_seed(0)
        model = MODELS[model_name]().double()
        ref = copy.deepcopy(model)
        x, y = _data()
        compiled = _compile(model, x, size, spec, *cap)
        plan = compiled.plan.get("burst_parallel")
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        what = f"{model_name} {spec} rank {rank}"
        mine = owned_names(compiled, model)
        for it in range(3):
            loss = compiled.step((x,), y)
            ref_opt.zero_grad()
            ref_loss = F.cross_entropy(ref(x), y)
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6,
                                       msg=f"{what} step {it}: loss")
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                if name not in mine:  # never receives the gradients of others' layers
                    assert p.grad is None, f"{what} step {it}: a gradient of {name}"
                    continue
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                           msg=f"{what} step {it}: grad of {name}")
            ref_opt.step()
        want = dict(ref.named_parameters())
        params = dict(model.named_parameters())
        for name in mine:
            torch.testing.assert_close(params[name], want[name], rtol=1e-5, atol=1e-6,
                                       msg=f"{what}: {name} after 3 steps")
        # the optimizer holds exactly the parameters of the layers this rank runs
        held = {id(p) for g in compiled.optimizer.param_groups for p in g["params"]}
        assert held == {id(params[n]) for n in mine}, what
        for module, runs in _runs_layer(compiled, rank).items():
            for p in model.get_submodule(module).parameters():
                assert (id(p) in held) == runs, (what, module, runs)
        with torch.no_grad():  # inference: stale copies unused, the owners' rows gathered
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-6,
                                       msg=f"{what}: forward after training")
        ex = compiled.executor
        out.append(({n: params[n].detach().clone() for n in mine}, [l.gpus for l in plan.layers],
                    plan.parallel_branches,
                    (type(ex).__name__, ex.fallback_reason, ex.last_program, ex.last_trace),
                    ex.state_bytes(compiled.graph_module, compiled.optimizer)))
    return out


CASES = [("chain", "auto"), ("chain", ("cycle", [4, 1, 2])), ("chain", ("cycle", [1, 4])),
         ("branchy", "auto"), ("branchy", ("cycle", [2, 4, 1])), ("branchy", "branches")]


def _check_ranks(size, cases):
    results = spawn(_equivalence, size, cases, timeout_s=600)
    _check_results(cases, results)
    return results


def _check_results(cases, results):
    for k, (model_name, spec, *_) in enumerate(cases):
        owned = [r[k][0] for r in results]
        names = list(dict(MODELS[model_name]().named_parameters()))
        assert set().union(*owned) == set(names), (model_name, spec)  # every one has an owner
        for name in names:  # the owners hold identical copies after 3 optimizer steps
            copies = [o[name] for o in owned if name in o]
            for other in copies[1:]:
                assert torch.equal(other, copies[0]), (model_name, spec, name)
        gpus = results[0][k][1]
        if spec not in ("auto", ("cycle", [2])):  # hand-written plans change the GPU count
            assert len(set(gpus)) > 1, (model_name, spec, gpus)
        for r in results:  # a rank that owns less holds fewer bytes than data parallelism
            assert (r[k][4].total < r[k][4].dp_total) == (len(r[k][0]) < len(names)), \
                (model_name, spec, r[k][4])
        if spec == "branches":
            assert results[0][k][2], "the branch plan runs branches on GPUs of their own"
            assert any(len(o) < len(names) for o in owned), "branches own their parameters"


TWO_RANK_CASES = [CASES[1], CASES[4], CASES[5]]


def _current_state(rank, size):
    """Two steps with c1 and bn1 on rank 0 only: model.state_dict() on each rank, then
    compiled.state_dict() (a collective), then an eval forward traced again in eval mode."""
    from tidal.runtime.programs.burst_refresh import StaleStateError

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = Normed().double()
    x, y = _data()
    compiled = _compile(model, x, size, ("layers", {"c1": 1, "bn1": 1}))
    for _ in range(2):
        compiled.step((x,), y)
    try:
        model.state_dict()
        stale = None
    except StaleStateError as e:
        stale = str(e)
    state = {k: v.clone() for k, v in compiled.state_dict().items()}
    again = {k: v.clone() for k, v in model.state_dict().items()}  # current now: no raise
    return stale, state, again


def test_the_model_state_is_current_on_every_rank_or_refuses(two_rank_job):
    """Not the stale copy: model.state_dict() on the rank that skips c1/bn1 raises naming the
    way out; compiled.state_dict() (a collective) is the same current state on both ranks."""
    (stale0, state0, again0), (stale1, state1, again1) = two_rank_job["_current_state"]
    assert stale0 is None  # rank 0 runs every layer: nothing stale
    assert "rank 1" in stale1 and "'c1.weight'" in stale1 and "compiled.state_dict()" in stale1
    assert state0.keys() == state1.keys()
    for k in state0:
        assert torch.equal(state0[k], state1[k]), k
        assert torch.equal(again1[k], state1[k]), k


@pytest.mark.slow
def test_two_ranks_match_single_process(two_rank_job):
    _check_results(TWO_RANK_CASES, two_rank_job["equivalence"])


SKIP_CASES = [("flat", ("layers", {"view": 1, "fc1": 1})),
              ("flat", ("layers", {"pool": 1, "relu_1": 1})),
              ("inplace", ("layers", {"c1": 1})),  # an in-place ReLU on a value cut for backward
              ("chain", ("cycle", [2]), 1),  # data parallel, one bucket per parameter
              ("branchy", ("cycle", [2, 1]), 4096)]  # several buckets per run of layers


@pytest.fixture(scope="module")
def two_rank_job():
    """One 2-rank job for every 2-rank case of this module: {case: the ranks' results}."""
    return spawn_parts(2, [part(_equivalence, TWO_RANK_CASES, name="equivalence"),
                           part(_equivalence, SKIP_CASES, name="skip"), part(_owner_state),
                           part(_composed), part(_current_state)], timeout_s=900)


@pytest.fixture(scope="module")
def skip_results(two_rank_job):
    """The 2-rank run of the skip cases, read by the tests below."""
    return two_rank_job["skip"]


def test_ranks_outside_a_layers_set_skip_it(skip_results):
    # rank 1 holds none of view/fc1's rows (it skips them: view(0, -1) would fail), and
    # view's size(0) must count the rows view gets, not those of pool's GPU set
    _check_results(SKIP_CASES, skip_results)


def test_the_program_runs_on_two_ranks_and_in_the_simulator(skip_results):
    # the steps above ran as programs (ProgramExecutor through Compiled.step, equal to the
    # one-process step); the simulator runs the same Program objects with the measured
    # durations: per rank and stream the same piece order as the real trace, and every piece
    # after the pieces it depends on, in both
    from tidal.runtime.program import stream_kind
    from tidal.sim.engine import simulate
    from tidal.sim.programs import join_ranks

    lanes = {"compute": "compute", "comm": "link", "transfer": "peer"}
    for k, case in enumerate(SKIP_CASES):
        runs = {rank: r[k][3] for rank, r in enumerate(skip_results)}
        programs, measured = {}, {}
        for rank, (kind, reason, program, trace) in runs.items():
            assert kind == "ProgramExecutor" and "scatter" in reason, (case, kind, reason)
            assert [t.name for t in trace] == [p.name for p in program.pieces], case
            assert any(p.stream == "comm" for p in program.pieces), case
            programs[rank] = program
            measured[rank] = {t.name: t.end_us - t.start_us for t in trace}
        # every scatter/gather is a piece of its own on the transfer stream (the device is
        # idle while it waits for other ranks), forward and backward, the same on each rank
        moves = {rank: [p.name for p in program.pieces if p.stream == "transfer"]
                 for rank, program in programs.items()}
        assert moves[0] and moves[0] == moves[1], (case, moves)
        assert any(m.endswith(" backward") for m in moves[0]), (case, moves)
        assert all(not stream_kind("transfer")[1] for _ in moves[0])
        sim = simulate(join_ranks(programs, lambda rank, name: measured[rank][name]))
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


def test_buckets_are_issued_when_their_layers_backward_ends(skip_results):
    # data parallel with a 1-byte cap: one bucket per parameter, in backward order, each
    # issued after the backward stage that ends at its layer, before the rest of backward
    k = SKIP_CASES.index(("chain", ("cycle", [2]), 1))
    order = ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight",
             "c2.bias", "c2.weight", "c1.bias", "c1.weight"]
    for r in skip_results:
        program = r[k][3][2]
        syncs = [p for p in program.pieces if p.stream == "comm"]
        assert [p.name for p in syncs] == [f"all_reduce 0,1 {n}" for n in order]
        stages = [program.pieces[p.deps[0]].name for p in syncs]
        assert stages == [f"backward {s}" for s in (4, 4, 3, 3, 2, 2, 1, 1)], stages
        names = [p.name for p in program.pieces]
        last = names[max(d for d in program.pieces[-1].deps
                         if program.pieces[d].stream != "comm")]  # the last backward stage
        assert last.endswith("backward"), last  # the input's scatter: a transfer piece
        assert names.index(syncs[0].name) < names.index(last) < names.index("optimizer")


def test_sync_buckets_are_runs_of_one_rank_set_closed_at_the_cap():
    from tidal.runtime.programs.burst import sync_buckets

    torch.manual_seed(0)
    model = Branchy().double()
    x, _ = _data()
    compiled = _compile(model, x, 2, ("cycle", [2, 1]))
    burst, gm = compiled.executor.rank_program, compiled.graph_module
    size = {n: p.numel() * p.element_size() for n, p in gm.named_parameters()}
    synced = sorted(n for n in size if len(burst.param_ranks[n]) > 1)
    runs = sync_buckets(gm, burst.param_ranks, 2)  # 25 MiB: one bucket per run
    capped = sync_buckets(gm, burst.param_ranks, 2, bucket_bytes=64)
    for buckets in (runs, capped):
        assert sorted(n for b in buckets for n in b.names) == synced
        assert [b.ready for b in buckets] == sorted((b.ready for b in buckets), reverse=True)
    assert all(sum(size[n] for n in b.names[:-1]) < 64 for b in capped)   # as DDP closes
    assert len(capped) > len(runs) > 1
    # consecutive buckets of one run keep their order: the capped buckets, joined, are the runs
    joined = [n for b in capped for n in b.names]
    assert joined == [n for b in runs for n in b.names]


def _owner_state(rank, size):
    """Normed with bn1 (and c1) on rank 0 only: one step, a checkpoint of each rank's share,
    its byte count, inference in eval mode; then the checkpoint restored and the second step
    run twice from it."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = Normed().double()
    init = {n: b.clone() for n, b in model.named_buffers()}
    ref = copy.deepcopy(model)
    x, y = _data()
    compiled = _compile(model, x, size, ("layers", {"c1": 1, "bn1": 1}))
    burst, gm = compiled.executor, compiled.graph_module
    compiled.step((x,), y)
    F.cross_entropy(ref(x), y).backward()  # the single-process run's statistics
    saved = io.BytesIO()
    torch.save(burst.state_dict(gm, compiled.optimizer), saved)
    second = [compiled.step((x,), y)]
    second.append({n: t.clone() for n, t in burst.owned(gm).items()})
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    burst.load_state_dict(gm, state, compiled.optimizer)
    again = [compiled.step((x,), y), {n: t.clone() for n, t in burst.owned(gm).items()}]
    burst.load_state_dict(gm, state, compiled.optimizer)
    model.eval()
    with torch.no_grad():
        out = compiled(x)
    return ({n: b.clone() for n, b in model.named_buffers()},
            {n: b.clone() for n, b in ref.named_buffers()}, init, state, out, second, again,
            burst.state_bytes(gm, compiled.optimizer), compiled.report())


def test_owner_only_buffers_checkpoint_and_inference(two_rank_job):
    from tidal.runtime.programs.burst import state_table

    results = two_rank_job["_owner_state"]
    (b0, ref, init, state0, out0, second0, again0, bytes0, _), \
        (b1, _, _, state1, out1, second1, again1, bytes1, report1) = results
    # bn1 ran on rank 0 alone, on the whole batch: exactly the single-process statistics;
    # rank 1 skipped the layer and holds a stale copy it never reads nor saves
    for name in ("bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"):
        torch.testing.assert_close(state0["model"][name], ref[name], rtol=1e-9, atol=1e-12)
        assert name not in state1["model"] and torch.equal(b1[name], init[name]), name
    # bn2 ran on both ranks, 4 rows each: the mean of the shards' means is the batch mean
    torch.testing.assert_close(b0["bn2.running_mean"], b1["bn2.running_mean"], rtol=0, atol=0)
    torch.testing.assert_close(b1["bn2.running_mean"], ref["bn2.running_mean"],
                               rtol=1e-9, atol=1e-12)
    assert "c1.weight" in state0["model"] and "c1.weight" not in state1["model"]
    # the ranks' checkpoints together are the whole model; shared entries agree
    for name in set(state0["model"]) & set(state1["model"]):
        assert torch.equal(state0["model"][name], state1["model"][name]), name
    torch.manual_seed(0)
    whole = Normed().double()
    whole.load_state_dict({**state1["model"], **state0["model"]})
    with torch.no_grad():  # inference on either rank: the gathered output of the owners
        want = whole.eval()(_data()[0])
    torch.testing.assert_close(out0, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out1, want, rtol=1e-12, atol=1e-12)
    # restoring a rank's checkpoint (parameters, buffers, momentum) replays the next step
    for second, again in ((second0, again0), (second1, again1)):
        assert torch.equal(second[0], again[0])
        assert second[1].keys() == again[1].keys()
        for name in second[1]:
            assert torch.equal(second[1][name], again[1][name]), name
    # what each rank holds against data parallelism (rank 1 does not hold c1 and bn1)
    assert bytes1.total < bytes0.total == bytes0.dp_total == bytes1.dp_total
    assert 0 < bytes1.optimizer < bytes1.dp_optimizer == bytes0.optimizer  # SGD momentum
    assert "share" in state_table([bytes0, bytes1])
    # Compiled.report() says it after a step
    line = next(l for l in report1.splitlines() if "training state" in l)
    assert f"rank 1 holds {bytes1.total / 2**20:.2f} MiB" in line, line
    assert f"{bytes1.total / bytes1.dp_total:.0%} of data parallelism" in line, line


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
    # collectives are the identity): the backward, cut before the nodes where a bucket's
    # gradients become final, gives exactly the gradients of one eager backward
    from tidal.runtime.programs.burst import BurstStep

    for model_cls, spec, cap in ((Inplace, ("layers", {"c1": 1}), None),
                                 (Branchy, ("cycle", [2, 1]), None),
                                 (Branchy, ("cycle", [2]), 1)):  # a cut before every layer
        torch.manual_seed(0)
        model = model_cls().double()
        ref = copy.deepcopy(model)
        x, y = _data()
        compiled = _compile(model, x, 2, spec, cap)
        burst = compiled.executor.rank_program
        gm = compiled.graph_module
        layout = burst.layout(gm, rank=0, size=2, run=gm)
        assert layout.stages.cuts, (model_cls.__name__, layout.program.table())
        step = BurstStep(burst, layout, compiled.graph_module, compiled.graph_module, (x,), y,
                         F.cross_entropy, compiled.optimizer)
        for i, piece in enumerate(layout.program.pieces):  # forward, transfers, backward
            if piece.stream in ("compute", "transfer") and piece.name != "optimizer":
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
    """burst_parallel alone, then with the compression pass off / Top-K 100 % / PowerSGD-1
    (c1 on rank 0 alone, the other layers on both ranks)."""
    from tidal.passes.compression import CompressionPass

    torch.set_default_dtype(torch.float64)
    x, y = _data()
    out = {}
    for tag, extra in (("plain", []), ("off", [CompressionPass(mode="off")]),
                       ("topk1", [CompressionPass(compressor="topk:1.0")]),
                       ("psgd1", [CompressionPass(compressor="powersgd:1")])):
        torch.manual_seed(0)
        model = MODELS["chain"]().double()
        plan = _hand_plan(model, x, size, ("layers", {"c1": 1})).to_json()
        compiled = tidal.compile(model, (x,), passes=[BurstParallel(plan=plan)] + extra,
                                 cluster=_cluster(size), loss_fn=F.cross_entropy,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05))
        grads = []
        for _ in range(2):
            compiled.step((x,), y)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None})  # the owned ones
        out[tag] = grads
    return out


def test_compression_wraps_the_burst_sync(two_rank_job):
    results = two_rank_job["_composed"]
    for r in results:
        for step, plain in enumerate(r["plain"]):
            assert all(r[tag][step].keys() == plain.keys() for tag in ("off", "topk1", "psgd1"))
            for name, g in plain.items():
                # off is the same sum (averaged, then scaled back by the rank count)
                torch.testing.assert_close(r["off"][step][name], g, rtol=1e-12, atol=1e-12)
                # compressors send float32 on the wire: float32 rounding of float64 gradients
                torch.testing.assert_close(r["topk1"][step][name], g, rtol=1e-6, atol=1e-8)
        changed = [n for n, g in r["plain"][0].items()
                   if g.dim() == 2 and not torch.allclose(r["psgd1"][0][n], g)]
        assert changed, "PowerSGD rank 1 must change a matrix gradient"
    both = results[0]["psgd1"][-1].keys() & results[1]["psgd1"][-1].keys()
    assert both, "the plan has layers on both ranks"
    for name in both:  # every owner applies the same gradient
        torch.testing.assert_close(results[1]["psgd1"][-1][name],
                                   results[0]["psgd1"][-1][name], rtol=0, atol=0)

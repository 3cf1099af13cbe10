"""burst_parallel on models nobody here wrote: the units it places (``tidal.passes.burst_units``),
regions collapsed where the graph is not series-parallel, a reduction over samples pinned to one
GPU, hand-written plans that move values (folded ones included) between GPU sets on 2 gloo
ranks, and a per-layer plan that is more than "one count for everything" on a transformer."""
import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F

import tidal
from tidal.ir import cost
from tidal.ir.export_capture import reusing_exports
from tidal.ir.inputs import bind_inputs
from tidal.passes.burst_parallel import BurstParallel, analyse, build_problem
from tidal.passes.burst_planner import plan_burst, plan_from_counts

from rank_parts import part, run_parts
from background_jobs import Job

HF = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HF, reason="needs the hf extra")


class Centred(torch.nn.Module):
    """Subtracts the batch mean: a reduction over samples in the middle of the graph."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(6, 16), torch.nn.Linear(16, 16),
                                  torch.nn.Linear(16, 3))

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = h - h.mean(0, keepdim=True)
        return self.c(torch.relu(self.b(h)))


def _fast_cluster(gpus):
    """Compute-bound layers and a fast link: data parallelism pays for every layer it may split."""
    return tidal.Cluster(gpus=gpus, bandwidth_gbps=1e5, latency_us=0.1, peak_tflops=1e-5)


def test_a_reduction_over_samples_is_pinned_to_one_gpu():
    model, x = Centred(), torch.randn(8, 6)
    gm = tidal.trace(model, (x,))
    cost.annotate(gm, (x,))
    units = analyse(gm, (x,), 8)
    pinned = [u for u in units.units if u.pinned]
    assert len(pinned) == 1 and {"mean", "sub"} <= set(pinned[0].members), units.units
    assert "'mean' reduces over samples" in pinned[0].pinned
    plan = plan_burst(build_problem(gm, _fast_cluster(4), 8, units=units), 2.0)
    gpus = {l.layer: l.gpus for l in plan.layers}
    assert gpus[pinned[0].name] == 1 and max(gpus.values()) == 4, plan.table()


def _centred_step(rank, size):
    torch.manual_seed(0)
    model = Centred()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    c = tidal.compile(model, (x,), passes=[BurstParallel()], cluster=_fast_cluster(size),
                      loss_fn=F.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    loss = c.step((x,), y)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    want = F.cross_entropy(ref(x), y)
    want.backward()
    opt.step()
    gpus = sorted({l.gpus for l in c.plan.get("burst_parallel").layers})
    mine = {id(t) for t in c.executor.owned(c.graph_module).values()}  # owner-only state
    return float(loss), float(want), gpus, {n: p.detach().clone() for n, p in
                                            model.named_parameters() if id(p) in mine}, \
        dict(ref.named_parameters())


def _two_rank_parts() -> list:
    """Every 2-rank case of this module (the hand plans of Hugging Face models only with the
    hf extra), as ``rank_parts`` parts."""
    parts = [part(_centred_step), part(_written_step)]
    if HF:
        parts.append(part(_hand_plans, ("gpt2", "swin")))
    return parts


def _job() -> Job:
    return Job(run_parts, 2, (_two_rank_parts(),), {"timeout_s": 540})


def background_job(items):
    """The module's one 2-rank job, run in the background while other modules run
    (``tests/conftest.py``) when a collected test reads it."""
    if any("two_rank_job" in getattr(i, "fixturenames", ()) for i in items):
        return _job()
    return None


@pytest.fixture(scope="module")
def two_rank_job(request, background_jobs):
    """One 2-rank job for every 2-rank case of this module: {case: the ranks' results}."""
    job = _job()
    results = background_jobs.result(request.module.__name__, job)
    return {name: [r[name] for r in results] for name, _, _ in job.args[0]}


def test_a_pinned_unit_sees_the_whole_batch_on_two_ranks(two_rank_job):
    # the mean is over all 8 samples, as in one process (data parallelism would centre each
    # rank's 4 rows on their own mean: a different model)
    for loss, want, gpus, params, ref in two_rank_job["_centred_step"]:
        assert gpus == [1, 2]
        assert loss == pytest.approx(want, rel=1e-6)
        for n, p in params.items():
            torch.testing.assert_close(p, ref[n].detach(), rtol=1e-5, atol=1e-6, msg=n)


@needs_hf
def test_collapsed_regions_are_stated_in_the_plan_and_report():
    from tests.third_party.models import BUILDERS

    case = BUILDERS["vit"]()
    c = tidal.compile(case.model, case.inputs, passes=[BurstParallel(amp_limit=4.0)],
                      cluster=tidal.Cluster(gpus=2), loss_fn=case.loss_fn,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    plan = c.plan.get("burst_parallel")
    attention = [what for name, what in plan.composites if "attention_q_proj" in what]
    assert len(attention) == 2, plan.composites  # Q, K and V of each of the 2 layers
    assert "not series-parallel: branches from 'vit_layers_0_layernorm_before' meet " \
           "at 'matmul'" in attention[0]
    assert "not series-parallel" in plan.table() and "not series-parallel" in c.report()


def _hand_plans(rank, size, names):
    """Each model under a plan that alternates 1 and 2 GPUs over its units, so values move
    between GPU sets all through the graph (Swin's folded windows too): one step equals one
    eager SGD step on the global batch."""
    from tests.third_party.matrix import cluster, eager_step, sgd
    from tests.third_party.models import BUILDERS

    out = {}
    for name in names:
        case = BUILDERS[name]()
        want_loss, ref = eager_step(case)
        with reusing_exports():  # the plan's trace and the compile: one export of the model
            gm = tidal.trace(case.model, case.inputs)
            inputs = bind_inputs(gm, case.inputs)
            cost.annotate(gm, inputs)
            problem = build_problem(gm, cluster(size), 4, example_inputs=inputs)
            plan = plan_from_counts(problem, [1 + i % 2 for i in range(len(problem.names))])
            c = tidal.compile(case.model, case.inputs,
                              passes=[BurstParallel(plan=plan.to_json())],
                              cluster=cluster(size), loss_fn=case.loss_fn, optimizer=sgd)
        moves = sum(1 for n in c.graph_module.graph.nodes if "tidal" in str(n.target))
        loss = float(c.step(case.inputs, case.targets))
        w = dict(ref.named_parameters())
        mine = {id(t) for t in c.executor.owned(c.graph_module).values()}  # owner-only state
        err = max(float((p.detach() - w[n].detach()).abs().max()) for n, p in
                  case.model.named_parameters() if id(p) in mine)
        out[name] = (loss, float(want_loss), err, moves)
    return out


@needs_hf
def test_hand_plans_move_values_between_gpu_sets_on_two_ranks(two_rank_job):
    for result in two_rank_job["_hand_plans"]:
        for name, (loss, want, err, moves) in result.items():
            assert moves >= 10, (name, moves)
            assert loss == pytest.approx(want, rel=1e-5, abs=1e-6), name
            assert err < 1e-5, (name, err)


@needs_hf
def test_a_long_sequence_decoder_gets_a_per_layer_plan():
    # batch 8 of 4096 tokens on 8 A100s over DeepPool's link: the embeddings (many parameter
    # bytes, no compute) run on fewer GPUs than the attention and MLP layers (all of the compute)
    # when every sync follows its layers (sync="bucketed"); with syncs overlapping backward (the
    # default) data parallelism wins here: its one bucket (the whole model) and this plan's
    # bucket of 8-GPU layers are both issued with almost no backward left to hide behind, and
    # the plan adds a transfer
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=1000,
                                  n_positions=4096, use_cache=False, attn_implementation="eager")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
        ids = torch.zeros(8, 4096, dtype=torch.long)
    gm = tidal.trace(model, {"input_ids": ids})
    cost.annotate(gm, (ids,))
    cluster = tidal.Cluster(gpus=8, bandwidth_gbps=2.66e5 * 8 / 1e3, latency_us=40.0)
    problem = build_problem(gm, cluster, 8, example_inputs=(ids,), sync="bucketed")
    plan = plan_burst(problem, 2.0)
    gpus = {l.layer: l.gpus for l in plan.layers}
    assert not plan.fallback and plan.time_us < plan.dp_time_us, plan.summary()
    assert gpus["transformer_wte"] < 8 and gpus["matmul"] == gpus["addmm_2"] == 8, plan.table()
    heavy = max(range(len(problem.names)), key=lambda i: problem.comp[i, 0])
    assert gpus[problem.names[heavy]] == 8


class Written(torch.nn.Module):
    """A value read on another GPU set both before and after an in-place write into it."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(6, 6), torch.nn.Linear(6, 6),
                                  torch.nn.Linear(6, 3))
        self.register_buffer("drop", torch.arange(6) < 2)

    def forward(self, x):
        m = self.a(x).clone()
        y = self.b(m)           # reads m before the write
        m.masked_fill_(self.drop, 0.0)
        return self.c(m + y)    # reads m after it


def _written_step(rank, size):
    torch.manual_seed(0)
    model, x = Written(), torch.randn(4, 6)
    gm = tidal.trace(model, (x,))
    cost.annotate(gm, (x,))
    problem = build_problem(gm, _fast_cluster(size), 4, example_inputs=(x,))
    written = analyse(gm, (x,), 4).of("clone").name
    plan = plan_from_counts(problem, {n: 1 if n == written else 2 for n in problem.names})
    c = tidal.compile(model, (x,), passes=[BurstParallel(plan=plan.to_json())],
                      cluster=_fast_cluster(size))
    with torch.no_grad():
        return c(x), model(x)


def test_a_value_written_in_place_moves_again_for_a_later_reader(two_rank_job):
    for got, want in two_rank_job["_written_step"]:
        torch.testing.assert_close(got, want)


def test_auto_analyses_the_graph_once(monkeypatch):
    # auto asks burst_parallel why_not, then runs it on the same graph: one batch-dimension
    # analysis, not two (it is the slow part on a large model)
    from tidal.ir import batch_dim

    calls = []
    real = batch_dim.analyze
    monkeypatch.setattr(batch_dim, "analyze", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, x = Centred(), torch.randn(8, 6)
    c = tidal.compile(model, (x,), passes="auto", cluster=_fast_cluster(2),
                      loss_fn=lambda out, y: out.sum(), optimizer=lambda p: torch.optim.SGD(p, 0.1))
    assert c.plan.get("burst_parallel") is not None and len(calls) == 1


def test_every_rank_builds_its_program_from_the_graph_and_plan_alone():
    # the builder (graph, plan, rank) -> Program, in one process for each of 4 ranks: what the
    # executor would run there; every bucket's all-reduce on its ranks only, in the same order
    # on each of them (so the collectives match), each synced gradient in exactly one bucket
    from tidal.ir.burst_sync import sync_buckets
    from tidal.runtime.programs.burst import build_program

    model, x = Centred(), torch.randn(8, 6)
    c = tidal.compile(model, (x,), passes=[BurstParallel()], cluster=_fast_cluster(4),
                      loss_fn=F.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    gm, plan, burst = c.graph_module, c.plan.get("burst_parallel"), c.executor.rank_program
    assert sorted({l.gpus for l in plan.layers}) == [1, 4], plan.table()
    buckets = sync_buckets(gm, burst.param_ranks, 4)
    synced = sorted(n for n, p in gm.named_parameters()
                    if p.requires_grad and len(burst.param_ranks[n]) > 1)
    assert synced
    assert sorted(n for b in buckets for n in b.names) == synced
    programs = [build_program(gm, plan, rank) for rank in range(4)]
    for rank, program in enumerate(programs):
        assert program == burst.layout(gm, rank, 4).program
        assert program.pieces[-1].kind == "optimizer"
        syncs = [p for p in program.pieces if p.name.startswith("all_reduce")]
        assert [p.name for p in syncs] == [b.piece for b in buckets if rank in b.ranks]
        assert all(p.kind == "collective" and rank in p.ranks for p in syncs)
    for a in range(4):
        for b in range(a + 1, 4):
            shared = [[p.name for p in programs[r].pieces if p.kind == "collective" and
                       {a, b} <= set(p.ranks)] for r in (a, b)]
            assert shared[0] == shared[1], (a, b)

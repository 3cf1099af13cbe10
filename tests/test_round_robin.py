"""round_robin: the exact partition DP against brute force, Figure 10's schedule, each
partition's gradient after a step equal to N-micro-batch accumulation (in one process and on
2 and 4 gloo ranks), the per-rank programs (captured F/B segments, transfers and
all-reduces on the comm stream) replayed by the simulator in the order the runtime ran them,
and each partition's compressor state (Top-K error feedback) carried bit for bit through a
checkpoint and a re-capture after freezing."""
import copy
import random

import pytest
import torch

import tidal
from examples.models import ZOO
from tidal.ir.plan import Plan
from tidal.passes.round_robin import (RoundRobin, balanced_partition, brute_force_partition,
                                      partition_cost, round_robin_schedule)
from tidal.runtime.batch_data import BatchError
from tidal.runtime.distributed import spawn

from rank_parts import part, spawn_parts


# -- planner ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 10)
    parts = rng.randint(2, min(n, 5))
    costs = [rng.choice([rng.random(), float(rng.randint(1, 4))]) for _ in range(n)]
    allowed = sorted(rng.sample(range(1, n), rng.randint(parts - 1, n - 1)))
    cut_bytes = [float(rng.randint(0, 9)) for _ in range(n)]
    starts = balanced_partition(costs, parts, allowed, cut_bytes)
    assert len(starts) == parts and starts[0] == 0
    assert all(s in allowed for s in starts[1:]) and list(starts) == sorted(set(starts))
    got = partition_cost(costs, starts, cut_bytes)
    want = brute_force_partition(costs, parts, allowed, cut_bytes)
    assert got[0] == pytest.approx(want[0], rel=1e-9)
    assert got[1] == pytest.approx(want[1])


def test_dp_bad_input_names_the_value():
    with pytest.raises(ValueError, match="partitions=1"):
        balanced_partition([1.0, 2.0], 1)
    with pytest.raises(ValueError, match="3 layers, fewer than partitions=4"):
        balanced_partition([1.0, 2.0, 3.0], 4)
    with pytest.raises(ValueError, match="no way to cut"):
        balanced_partition([1.0, 2.0, 3.0, 4.0], 3, allowed_cuts=[2])


# -- schedule -----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_schedule_is_figure_10(n):
    s = round_robin_schedule([1.0 + p for p in range(n)], [2.0] * n, send_us=[0.5] * n,
                             switch_us=[0.25] * n, allreduce_us=[0.3] * n)
    s.check()  # no rank does two things at once, every (partition, batch) once, dependencies
    for i in range(n):
        fwd = [a for a in s.ranks[i] if a.kind == "F"]
        bwd = [a for a in s.ranks[i] if a.kind == "B"]
        assert [(a.partition, a.batch) for a in fwd] == [(c, (i - c) % n) for c in range(n)]
        assert [(a.partition, a.batch) for a in bwd] == [(p, (i - p) % n)
                                                         for p in reversed(range(n))]
    # at every cycle all ranks hold the same partition
    for k in range(len(s.ranks[0])):
        assert len({(r[k].kind, r[k].partition) for r in s.ranks}) == 1
    assert s.note("switches_per_rank") == 2 * n - 1
    assert Plan.from_json(s.to_json()) == s


# -- equivalence --------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, 3))


def _accumulated(model, inputs, targets, n, loss_fn):
    """Reference: N micro-batches, each loss / N, gradients accumulated in one process."""
    ref = copy.deepcopy(model)
    size = targets.shape[0] // n
    for b in range(n):
        xb = tuple(t[b * size:(b + 1) * size] for t in inputs)
        (loss_fn(ref(*xb), targets[b * size:(b + 1) * size]) / n).backward()
    return {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}


def _step_and_grads(model, inputs, targets, n, loss_fn):
    c = tidal.compile(model, inputs, passes=[RoundRobin(partitions=n)], loss_fn=loss_fn,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
    c.step(inputs, targets)
    return c, {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name,n", [("vgg16_small", 2), ("bert_small", 4)])
def test_one_process_equals_micro_batch_accumulation(name, n):
    torch.manual_seed(0)
    model = ZOO[name]().eval()  # eval: no dropout randomness, gradients still flow
    x, y = model.example_inputs(2 * n), model.example_targets(2 * n)
    want = _accumulated(model, x, y, n, model.default_loss)
    c, got = _step_and_grads(model, x, y, n, model.default_loss)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    plan = c.plan.get("round_robin")
    assert sum(plan.layers_per_partition) >= n and len(plan.first_layers) == n
    assert c.executor.stats["switches"] == 2 * n - 1
    assert c.executor.stats["switch_bytes"] == plan.switch_bytes_per_step()


def _run_rr(rank, world):
    model = _mlp()
    g = torch.Generator().manual_seed(7)
    x, y = (torch.randn(2 * world, 8, generator=g),), torch.randint(0, 3, (2 * world,), generator=g)
    loss_fn = torch.nn.functional.cross_entropy
    want = _accumulated(model, x, y, world, loss_fn)
    _, got = _step_and_grads(model, x, y, world, loss_fn)
    return {k: float((got[k] - want[k]).abs().max()) for k in want}, sorted(got) == sorted(want)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_equal_micro_batch_accumulation(world, request):
    ranks = request.getfixturevalue("two_rank_job")["_run_rr"] if world == 2 else \
        spawn(_run_rr, world)
    for errors, same_keys in ranks:
        assert same_keys
        assert max(errors.values()) < 1e-6, errors


def _bn_buffers(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(4 * world, 8, generator=g), torch.randint(0, 3, (4 * world,), generator=g)
    with torch.no_grad():  # what BatchNorm sees on each rank's micro-batch
        seen = [model[0](xb) for xb in x.chunk(world)]
    _step_and_grads(model, (x,), y, world, torch.nn.functional.cross_entropy)
    bn = model[1]
    return bn.running_mean.clone(), bn.running_var.clone(), seen


def test_batchnorm_statistics_are_averaged_over_ranks(two_rank_job):
    results = two_rank_job["_bn_buffers"]
    (mean0, var0, seen), (mean1, var1, _) = results
    torch.testing.assert_close(mean0, mean1, rtol=0, atol=0)
    torch.testing.assert_close(var0, var1, rtol=0, atol=0)
    m = 0.1  # BatchNorm1d's momentum; each rank updated the statistics once, then averaged
    want_mean = m * torch.stack([s.mean(0) for s in seen]).mean(0)
    want_var = (1 - m) + m * torch.stack([s.var(0, unbiased=True) for s in seen]).mean(0)
    torch.testing.assert_close(mean0, want_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(var0, want_var, rtol=1e-5, atol=1e-6)


# -- bad input ----------------------------------------------------------------------------
def test_bad_input_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    x = torch.randn(4, 4)
    kw = dict(loss_fn=torch.nn.functional.cross_entropy,
              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ValueError, match="partitions=1"):
        RoundRobin(partitions=1)
    with pytest.raises(tidal.PassError, match="2 layers, fewer than partitions=4"):
        tidal.compile(model, x, passes=[RoundRobin(partitions=4)], **kw)
    with pytest.raises(tidal.PassError, match="batch size 3 is not divisible by partitions=2"):
        tidal.compile(model, torch.randn(3, 4), passes=[RoundRobin(partitions=2)], **kw)
    with pytest.raises(tidal.PassError, match="partitions=1"):
        tidal.compile(model, x, passes=[RoundRobin()], cluster=tidal.Cluster(gpus=1), **kw)
    c = tidal.compile(model, x, passes=[RoundRobin(partitions=2)], **kw)
    # a batch that does not cut into equal micro-batches runs (tests/test_partial_batch.py
    # compares it with eager); one with no rows is refused by name
    assert torch.isfinite(c.step((torch.randn(5, 4),), torch.zeros(5, dtype=torch.long)))
    with pytest.raises(BatchError, match="the global batch is empty"):
        c.step((torch.randn(0, 4),), torch.zeros(0, dtype=torch.long))
    assert "partition 1" in c.plan.get("round_robin").table()


def _composed(rank, world):
    """round_robin alone and with compression off / Top-K 100 % / PowerSGD rank 1: the
    gradients of one step and each partition's compressor."""
    from tidal.passes.compression import CompressionPass

    model = _mlp()
    g = torch.Generator().manual_seed(7)
    x, y = (torch.randn(2 * world, 8, generator=g),), torch.randint(0, 3, (2 * world,), generator=g)
    out = {}
    for tag, extra in (("plain", []), ("off", [CompressionPass(mode="off")]),
                       ("topk1", [CompressionPass(compressor="topk:1.0")]),
                       ("psgd1", [CompressionPass(compressor="powersgd:1")])):
        m = copy.deepcopy(model)
        c = tidal.compile(m, x, passes=[RoundRobin(partitions=world), *extra],
                          loss_fn=torch.nn.functional.cross_entropy,
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
        c.step(x, y)
        out[tag] = ({k: p.grad.clone() for k, p in m.named_parameters()},
                    sorted({s.compressor.spec() for s in c.executor.syncs.values()}))
    return out


def test_compression_wraps_each_partitions_sync(two_rank_job):
    results = two_rank_job["_composed"]
    for r in results:
        plain = r["plain"][0]
        assert r["plain"][1] == [] and r["off"][1] == ["none"] and r["topk1"][1] == ["topk:1"]
        for k, g in plain.items():
            torch.testing.assert_close(r["off"][0][k], g, rtol=1e-6, atol=1e-7, msg=k)
            torch.testing.assert_close(r["topk1"][0][k], g, rtol=1e-6, atol=1e-7, msg=k)
        assert any(g.dim() == 2 and not torch.allclose(r["psgd1"][0][k], g, atol=1e-4)
                   for k, g in plain.items()), "PowerSGD rank 1 must change a matrix gradient"
    for k, g in results[0]["psgd1"][0].items():  # every rank applies the same gradient
        torch.testing.assert_close(results[1]["psgd1"][0][k], g, rtol=0, atol=0)


# -- compressor state: checkpoint and re-capture -------------------------------------------
def _topk(model, world, x):
    """``model`` under round_robin and Top-K 30 % (error feedback: state across steps)."""
    from tidal.passes.compression import CompressionPass

    return tidal.compile(model, x, passes=[RoundRobin(partitions=world),
                                           CompressionPass(compressor="topk:0.3")],
                         loss_fn=torch.nn.functional.cross_entropy,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))


def _batches(world, n):
    g = torch.Generator().manual_seed(11)
    return [((torch.randn(2 * world, 8, generator=g),), torch.randint(0, 3, (2 * world,),
                                                                       generator=g))
            for _ in range(n)]


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _resumed(world, saved, batches, runtime=None, change=None):
    """A fresh compile that loads the saved model and optimizer state, then ``runtime`` (a
    callable taking the compiled model) and ``change`` (taking the model), and steps
    ``batches``: its parameters."""
    torch.manual_seed(1)
    model = _mlp()
    c = _topk(model, world, batches[0][0])
    model.load_state_dict(saved[0])
    c.optimizer.load_state_dict(copy.deepcopy(saved[1]))   # it would share the momenta
    if runtime is not None:
        runtime(c)
    if change is not None:
        change(model)
    for b in batches:
        c.step(*b)
    return _flat(model)


def _saved(model, c):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(c.optimizer.state_dict()), \
        c.runtime_state_dict()


def _resume_topk(rank, world):
    """2 steps, a checkpoint (``runtime_state_dict``, and the DCP dict of
    ``tidal.checkpoint.get_runtime_state_dict``), 2 more; a fresh compile resumed from it with
    and without the runtime state."""
    from tidal.compiler import checkpoint

    batches = _batches(world, 4)
    model = _mlp()
    c = _topk(model, world, batches[0][0])
    for b in batches[:2]:
        c.step(*b)
    saved = _saved(model, c)
    dcp_dict = checkpoint.get_runtime_state_dict(c)   # a collective: every rank
    for b in batches[2:]:
        c.step(*b)
    out = {"uninterrupted": _flat(model), "sections": sorted(saved[2]),
           "partitions": sorted(saved[2]["syncs"]),
           "residuals": [sorted(s["errors"]) for s in saved[2]["syncs"].values()]}
    out["runtime"] = _resumed(world, saved, batches[2:],
                              lambda c2: c2.load_runtime_state_dict(saved[2]))
    out["dcp_dict"] = _resumed(world, saved, batches[2:],
                               lambda c2: checkpoint.set_runtime_state_dict(c2, dcp_dict))
    out["fresh"] = _resumed(world, saved, batches[2:])
    return out


def _freeze_b(m):
    m[2].weight.requires_grad_(False)


def _freeze_topk(rank, world):
    """A step, then ``model[2].weight`` frozen and 2 more steps (a re-capture carrying the
    compressor state), with stderr; the same resumed by a fresh compile frozen before its
    first step, with and without the runtime state saved after step 1."""
    import contextlib
    import io

    batches = _batches(world, 3)
    model = _mlp()
    c = _topk(model, world, batches[0][0])
    c.step(*batches[0])
    saved = _saved(model, c)
    _freeze_b(model)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        for b in batches[1:]:
            c.step(*b)
    return {"recaptured": _flat(model), "stderr": err.getvalue(),
            "carried": _resumed(world, saved, batches[1:],
                                lambda c2: c2.load_runtime_state_dict(saved[2]), _freeze_b),
            "fresh": _resumed(world, saved, batches[1:], change=_freeze_b)}


def test_a_checkpoint_resumes_each_partitions_compressor_bit_for_bit(two_rank_job):
    """Top-K's error feedback is per partition and per rank: a fresh compile loading the
    model, the optimizer and the runtime state (directly, or through the DCP dict) continues
    the uninterrupted run bit for bit; without the runtime state it differs."""
    ranks = two_rank_job["_resume_topk"]
    for r in ranks:
        assert r["sections"] == ["syncs"] and r["partitions"] == [0, 1]
        assert all(r["residuals"]), r["residuals"]   # each partition's residuals, by name
        assert torch.equal(r["runtime"], r["uninterrupted"])
        assert torch.equal(r["dcp_dict"], r["uninterrupted"])
        assert float((r["fresh"] - r["uninterrupted"]).abs().max()) > 1e-4
    assert torch.equal(ranks[0]["uninterrupted"], ranks[1]["uninterrupted"])


def test_freezing_after_a_step_keeps_each_partitions_compressor_state(two_rank_job):
    """The re-capture after freezing carries every partition's compressor state to the new
    program (no 'starts afresh' line): it equals a fresh compile that loads the state and is
    frozen before its first step, and differs from one that starts the compressors afresh."""
    for r in two_rank_job["_freeze_topk"]:
        assert "re-capturing the step" in r["stderr"], r["stderr"]
        assert "starts afresh" not in r["stderr"], r["stderr"]
        assert torch.equal(r["recaptured"], r["carried"])
        assert float((r["fresh"] - r["recaptured"]).abs().max()) > 1e-4


# -- parameters used through get_attr, non-contiguous boundaries ---------------------------
class _TokenModel(torch.nn.Module):
    """Parameters used directly by the graph (a positional embedding added to the input, a
    cls token), a transposed (non-contiguous) activation crossing a partition boundary."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 64)
        self.pos = torch.nn.Parameter(torch.randn(8, 64) * 0.1)
        self.cls = torch.nn.Parameter(torch.randn(1, 1, 64) * 0.1)
        self.mix = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(64, 3)

    def forward(self, x):                                   # x: [B, 8 tokens, 16]
        h = self.inp(x) + self.pos
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), h], 1)
        h = h.transpose(1, 2)[..., :4]                     # [B, 64, 4], not contiguous
        h = self.mix(h).transpose(1, 2)                    # token mixing
        return self.head(torch.tanh(h).mean(1))


def _sgd_reference(model, x, y, lr):
    """Parameters after one plain SGD step on the whole global batch in one process."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    opt.step()
    return dict(ref.named_parameters())


def _run_token_model(rank, world):
    torch.manual_seed(0)
    model = _TokenModel()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 * world, 8, 16, generator=g)
    y = torch.randint(0, 3, (2 * world,), generator=g)
    want = _sgd_reference(model, x, y, lr=0.5)
    c = tidal.compile(model, (x,), passes=[RoundRobin(partitions=world)],
                      loss_fn=torch.nn.functional.cross_entropy,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    c.step((x,), y)
    owners = [[k for k, _ in part] for part in c.executor.owned]
    crossing = c.plan.get("round_robin").first_layers
    run = (type(c.executor).__name__, c.executor.fallback_reason, c.executor.last_program,
           c.executor.last_trace)
    return {k: p.detach().clone() for k, p in model.named_parameters()}, want, owners, crossing, run


class _MixerBlock(torch.nn.Module):
    """MLP-Mixer's token mixing: a Linear over the tokens of the transposed activation, then
    back, then a Linear over the channels."""

    def __init__(self, tokens, channels):
        super().__init__()
        self.tokens = torch.nn.Linear(tokens, tokens)
        self.channels = torch.nn.Linear(channels, channels)

    def forward(self, x):                                   # x: [B, tokens, channels]
        h = self.tokens(x.transpose(1, 2)).transpose(1, 2)
        return torch.tanh(self.channels(torch.tanh(h)))


def _mixer():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[_MixerBlock(6, 8) for _ in range(3)])


def _mixer_step(rank, world, partitions=2):
    """One SGD step of a mean-pooled MLP-Mixer head under ``RoundRobin(partitions)``: the
    parameters, the plain SGD step of eager PyTorch on the whole batch, the partitions' first
    layers and the executor's fallback reason."""
    blocks, head = _mixer(), torch.nn.Linear(8, 3)
    model = torch.nn.Sequential(blocks, _MeanTokens(), head)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(4, 6, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    want = _sgd_reference(model, x, y, lr=0.5)
    c = tidal.compile(model, (x,), passes=[RoundRobin(partitions=partitions)],
                      loss_fn=torch.nn.functional.cross_entropy,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    c.step((x,), y)
    got = {k: p.detach().clone() for k, p in model.named_parameters()}
    return got, want, c.plan.get("round_robin").first_layers, c.executor.fallback_reason


class _MeanTokens(torch.nn.Module):
    def forward(self, x):
        return x.mean(1)


def _check_mixer(got, want, first_layers, reason):
    # a partition starts at a transpose: the gradient it sends back is a transposed view
    assert first_layers[1].startswith("transpose"), first_layers
    assert reason == "", reason
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-6, msg=k)


def test_one_process_mlp_mixer_equals_eager():
    """A model transposing its activations between layers (MLP-Mixer's token mixing) under
    round_robin in one process: one SGD step equals eager PyTorch's (1e-6)."""
    _check_mixer(*_mixer_step(0, 1))


def test_gloo_ranks_mlp_mixer_equals_eager(two_rank_job):
    """The same on 2 gloo ranks (issue 35 item 6: 'view size is not compatible with input
    tensor's size and stride' in piece B0,0); every rank holds the same parameters."""
    (p0, *rest0), (p1, *_) = two_rank_job["_mixer_step"]
    _check_mixer(p0, *rest0)
    for k, v in p0.items():
        torch.testing.assert_close(p1[k], v, rtol=0, atol=0, msg=k)


@pytest.fixture(scope="module")
def two_rank_job():
    """One 2-rank job for every 2-rank case of this module: {case: the ranks' results}."""
    return spawn_parts(2, [part(_run_rr), part(_bn_buffers), part(_composed),
                           part(_run_token_model), part(_resume_topk), part(_freeze_topk),
                        part(_mixer_step)])


@pytest.fixture(scope="module")
def token_model_ranks(two_rank_job):
    """The 2-rank run of the token model, shared by the tests that read it."""
    return two_rank_job["_run_token_model"]


def test_gloo_ranks_sync_get_attr_parameters_and_send_non_contiguous_activations(
        token_model_ranks):
    """Without the fix ``pos`` and ``cls`` were never all-reduced (the ranks drifted apart
    while the loss looked right), and the transposed boundary crashed ``batch_isend_irecv``
    with 'input tensor has to be contiguous'."""
    (p0, want, owners, crossing, _), (p1, *_) = token_model_ranks
    assert crossing[1] == "mix", crossing  # the boundary carries the transposed slice
    assert any("pos" in o for o in owners[0]) and any("cls" in o for o in owners[0])
    for k, w in want.items():
        torch.testing.assert_close(p0[k], w, rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(p1[k], p0[k], rtol=0, atol=0, msg=k)  # zero spread


def test_gloo_ranks_run_captured_programs_that_the_simulator_orders_as_the_trace(
        token_model_ranks):
    """Each rank's step is its own Program run by the one ProgramExecutor: F/B are segments
    of the partition's captured joint graph on the compute stream, transfers, all-reduces and
    the loss on comm, switches on load; the real trace respects every dependency, and the
    simulator, running the same Program objects with the measured durations, starts the pieces
    of every rank and stream in the trace's order."""
    from tidal.sim.programs import simulated_order, trace_order

    programs, traces = {}, {}
    for rank, (*_, (executor, reason, program, trace)) in enumerate(token_model_ranks):
        assert executor == "ProgramExecutor" and reason == "", reason
        programs[rank], traces[rank] = program, trace
        streams = {p.name: p.stream for p in program.pieces}
        assert [p.name for p in program.pieces] == [
            "S0", f"F0,{rank}", "X0 fwd", "S1", f"F1,{1 - rank}", "loss", f"B1,{1 - rank}",
            "X1 bwd", "A1", "S0 bwd", "U1", f"B0,{rank}", "A0", "U0", "restore"]
        # each partition is updated on its own stream before the switch that may evict it
        assert {k[0]: v for k, v in streams.items()} == {
            "S": "load", "F": "compute", "B": "compute", "X": "comm", "A": "comm",
            "l": "comm", "U": "update", "r": "load"}
        assert all(p.nodes for p in program.pieces if p.name[0] in "FB")
        # A1 waits only for B1: it overlaps partition 0's backward, which waits for X1 only
        a1, b0 = (next(p for p in program.pieces if p.name.startswith(k)) for k in ("A1", "B0"))
        assert [program.pieces[d].name for d in a1.deps] == [f"B1,{1 - rank}"]
        assert "A1" not in [program.pieces[d].name for d in b0.deps]
        assert [t.name for t in trace] == [p.name for p in program.pieces]
        for piece, t in zip(program.pieces, trace):
            for d in piece.deps:
                assert t.start_us >= trace[d].end_us, (piece.name, program.pieces[d].name)
    assert simulated_order(programs, traces) == trace_order(traces)


class _Gate(torch.nn.Module):
    """Data-dependent control flow: kept whole by the tracer, not capturable by ``make_fx``."""

    def forward(self, x):
        return x * 2 if float(x.detach().sum()) > 0 else x - 1


def test_a_partition_that_cannot_be_captured_runs_eagerly_and_is_named():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                _Gate(), torch.nn.Linear(8, 3))
    x, y = (torch.randn(8, 8),), torch.randint(0, 3, (8,))
    loss_fn = torch.nn.functional.cross_entropy
    want = _accumulated(model, x, y, 2, loss_fn)
    c = tidal.compile(model, x, passes=[RoundRobin(partitions=2)], leaf_modules=[_Gate],
                      loss_fn=loss_fn, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
    c.step(x, y)
    got = {k: p.grad for k, p in model.named_parameters()}
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    reason = c.executor.fallback_reason
    assert reason.startswith("partition 1") and "runs eagerly" in reason, reason
    assert 'getattr(self, "3")' in reason, reason  # the node that stopped the capture
    pieces = {p.name: p for p in c.executor.last_program.pieces}
    assert pieces["r0:F0,0"].nodes and not pieces["r0:F1,1"].nodes


def test_a_parameter_no_partition_owns_is_a_plan_error():
    from tidal.runtime.programs.round_robin import check_all_owned

    model = _TokenModel()
    owned = {id(p) for k, p in model.named_parameters() if k != "pos"}
    with pytest.raises(tidal.PlanError, match="'pos' belong to no partition"):
        check_all_owned(model, owned)
    check_all_owned(model, owned | {id(model.pos)})


def test_the_model_parameters_are_checked_and_unused_ones_named():
    """The ownership check runs against the traced graph's parameters, which are the model's
    own objects; parameters the forward never uses are named in the report."""
    model = _TokenModel()
    model.spare = torch.nn.Linear(2, 2)  # never used by forward
    c = tidal.compile(model, torch.randn(4, 8, 16), passes=[RoundRobin(partitions=2)],
                      loss_fn=torch.nn.functional.cross_entropy,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    owned = {id(p) for part in c.executor.owned for _, p in part}
    assert owned == {id(p) for k, p in model.named_parameters() if not k.startswith("spare")}
    assert any("spare.weight, spare.bias" in n for n in c.records[-1].notes)


# -- compute pieces lowered and captured ---------------------------------------------------
class _Counted(torch.nn.Module):
    """A buffer written in place in forward (a step counter), between two partitions' work."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.seen.add_(x.shape[0])
        return self.c(torch.tanh(self.b(h)))


def test_compute_pieces_run_captured_and_uncaptured_nodes_are_named():
    """F/B run the lowered, captured joint graph (a copy per rank: in one process the N runs
    of a partition are alive at once, and on a GPU a copy's buffers are static), equal to
    eager micro-batch accumulation; a model writing a buffer in place is refused."""
    loss_fn = torch.nn.functional.cross_entropy
    x, y = (torch.randn(8, 8),), torch.randint(0, 3, (8,))
    model = _mlp()
    want = _accumulated(model, x, y, 2, loss_fn)
    c, got = _step_and_grads(model, x, y, 2, loss_fn)
    assert c.executor.fallback_reason == "" and c.executor.uncaptured() == []
    for graphs in c.executor.graphs.values():
        assert all(len({id(g.captured(r)) for r in range(2)}) == 2 for g in graphs)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)

    # a buffer written in place: each partition runs once per micro-batch, so a counter
    # would count N times a step (eager: once); the pass refuses, naming the buffer
    from tidal.ir.capture import BufferUpdateError

    with pytest.raises(BufferUpdateError, match=r"'seen'.*round_robin"):
        _step_and_grads(_Counted(), x, y, 2, loss_fn)

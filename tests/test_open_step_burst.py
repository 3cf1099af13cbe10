"""The open step under ``burst_parallel`` (``Compiled.backward``, ``no_sync``,
``clip_grad_norm_``) on two gloo ranks, with layer ``c1`` on rank 0 only: the loop a user writes
around DDP (AdamW with two param groups, a warm-up ``LambdaLR``, clipping by the global norm,
accumulation of 2 micro-batches with ``scale=0.5``, the first inside ``no_sync``) equals the
same loop in plain PyTorch on one process (float64: max |Δparam| ≤ 1e-9 on the parameters each
rank owns; ``compiled.state_dict()`` equal to the reference's on both ranks; the clip norm
equal on both ranks and to the reference's). Non-owned parameters get no gradient and are
never stepped by the user's optimizer. Non-finite gradients on one rank only (rank 0's ``c1``)
make the clip norm non-finite on both, and a ``ShardedGradScaler`` skips that step on both
ranks and keeps their scales equal. Under bf16 autocast (float32 model, each step in its own
``torch.autocast``), the closed step and the open step equal DDP under the same autocast
(max |Δparam| ≤ 1e-4 after 2 SGD steps, and
> 1e-5 from a float32 run): a rank that skips c1 hands the transfers bf16 rows as
c1's rank does; ranks under different autocast states get ``TransferMismatchError`` on both
before any transfer, not a process abort. A last, smaller batch: steps on 8, 7, 5 and 1 rows
under the plan for 8 (each layer's ranks split the batch as ``torch.tensor_split``; with 1 row
rank 1 skips the layers on both ranks) equal plain SGD on each batch's mean loss, closed and
open, on two ranks and in one process (≤ 1e-9), and the forward on 5 rows equals the model's;
such a batch on a BatchNorm layer is refused by name (``BatchError``) on both ranks. Under
``compile(batch="local")`` the forward (``BurstProgram.forward_local``) returns this rank's
rows of the output on the joined batch (4 + 4 and 4 + 3 rows), equal to the model on them; a
forward given different global batches on the ranks raises ``BatchError`` on both. With
``CompressionPass("topk:0.3")`` the runtime state (each set's compressor) saved after 2 steps
through ``tidal.checkpoint`` and loaded into a fresh compile resumes bit for bit; without it
the run differs. One spawned job for every case."""
import contextlib
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel as DDP

import tidal
from tidal.ir import cost
from tidal.passes.burst_parallel import BurstParallel, build_problem
from tidal.passes.burst_planner import plan_from_counts
from tidal.runtime.programs.burst_transfers import TransferMismatchError

from rank_parts import part, spawn_parts
from test_burst_parallel import BATCH, Chain, owned_names

STEPS, MICRO = 3, 2
MAX_NORM = 0.2                  # below the gradients' norm here: clipping changes them
PARAM_TOL = 1e-9                # float64
AUTOCAST_TOL = 1e-4             # bf16 autocast against DDP: the same casts (each step in its own
                                # autocast: no cast cache across steps), other sums (seen: 3e-6)
BF16_EFFECT = 1e-5              # bf16 against a float32 run (seen: 8e-5): autocast really ran
CLUSTER = tidal.Cluster(gpus=2, bandwidth_gbps=100, latency_us=5, peak_tflops=1e-4)


def _data(step, k):
    g = torch.Generator().manual_seed(100 + 10 * step + k)
    return (torch.randn(BATCH, 3, 6, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (BATCH,), generator=g))


def _model():
    """The model, made in float64 (the ranks' default dtype, so their initial weights are the
    reference's)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        return Chain()
    finally:
        torch.set_default_dtype(before)


def _compile(model, x=None, example=None, passes=(), **options):
    """``model`` under a burst plan with c1 on rank 0 only, every other layer on both ranks
    (traced on ``x``, default: the float64 batch of step 0; compiled on ``example``, default
    ``x``), then ``passes``."""
    x = _data(0, 0)[0] if x is None else x
    gm = tidal.trace(model, (x,))
    cost.annotate(gm, (x,))
    problem = build_problem(gm, CLUSTER, BATCH)
    plan = plan_from_counts(problem, {n: 1 if n == "c1" else 2 for n in problem.names})
    return tidal.compile(model, (x if example is None else example,),
                         passes=[BurstParallel(plan=plan.to_json()), *passes],
                         cluster=CLUSTER, loss_fn=F.cross_entropy, **options)


def _adamw(model):
    """AdamW with two param groups (no decay on c1) and a warm-up LambdaLR."""
    first = list(model.c1.parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    opt = torch.optim.AdamW([{"params": first, "weight_decay": 0.0},
                             {"params": rest, "weight_decay": 0.1}], lr=1e-2)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))


def _loop(model, backward, no_sync, clip, after_first=None):
    """3 steps of AdamW + warm-up + clip over 2 micro-batches (scale 0.5, the first inside
    ``no_sync``); returns the losses, the clip norms and the optimizer. ``after_first(model)``
    runs after each step's first micro-batch."""
    opt, sched = _adamw(model)
    losses, norms = [], []
    for step in range(STEPS):
        for k in range(MICRO):
            x, y = _data(step, k)
            with no_sync() if k < MICRO - 1 else contextlib.nullcontext():
                losses.append(backward(x, y))
            if k == 0 and after_first is not None:
                after_first(model)
        norms.append(clip(MAX_NORM))
        opt.step()
        sched.step()
        opt.zero_grad()
    return torch.stack(losses), torch.stack(norms), opt


def _reference():
    """The loop in plain PyTorch on one process, every micro-batch whole."""
    model = _model()

    def backward(x, y):
        loss = F.cross_entropy(model(x), y)
        (loss * 0.5).backward()
        return loss.detach()

    losses, norms, _ = _loop(model, backward, contextlib.nullcontext,
                             lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m))
    return model, losses, norms


def _accumulating_loop(rank, size):
    """The loop under the burst plan; inside no_sync nothing reaches .grad, and the
    parameters this rank does not own never get a gradient (so AdamW never steps them)."""
    torch.set_default_dtype(torch.float64)
    model = _model()
    initial = copy.deepcopy(model)
    compiled = _compile(model)
    mine = owned_names(compiled, model)
    seen = {"grad_inside_no_sync": [], "foreign_grads": []}

    def after_first(m):
        seen["grad_inside_no_sync"].append(any(p.grad is not None for p in m.parameters()))

    def clip(max_norm):
        seen["foreign_grads"].append(sorted(n for n, p in model.named_parameters()
                                            if n not in mine and p.grad is not None))
        return compiled.clip_grad_norm_(max_norm)

    losses, norms, opt = _loop(model, lambda x, y: compiled.backward((x,), y, scale=0.5),
                               compiled.no_sync, clip, after_first)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    untouched = [n for n, p in initial.named_parameters() if n not in mine
                 and torch.equal(p, params[n])]
    state = {k: v.clone() for k, v in compiled.state_dict().items()}
    return (mine, {n: params[n].detach().clone() for n in mine}, losses, norms, state, seen,
            untouched, len(held) == len(params))


def _non_finite_on_one_rank(rank, size):
    """An inf in rank 0's c1 gradient only (c1 runs on rank 0 alone): the clip norm is inf on
    both ranks; a ShardedGradScaler skips that step on both and backs off both scales; the
    next step (finite) equals plain SGD on the unscaled gradient."""
    torch.set_default_dtype(torch.float64)
    model = _model()
    compiled = _compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    norms, scales = [], []
    for step in range(2):
        x, y = _data(step, 0)
        compiled.backward((x,), y, scale=scaler.scale(torch.ones(())))
        if step == 0 and rank == 0:
            model.c1.weight.grad[0, 0, 0, 0] = float("inf")
        scaler.unscale_(opt)
        norms.append(compiled.clip_grad_norm_(1e3))       # large: no clipping
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
        if step == 0:
            skipped = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    mine = owned_names(compiled, model)
    return skipped, torch.stack(norms), scales, mine, {
        n: p.detach().clone() for n, p in model.named_parameters() if n in mine}


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _float32_data(step):
    x, y = _data(step, 0)
    return x.float(), y


def _under_autocast(rank, size):
    """2 SGD steps of a float32 Chain, each under bf16 autocast: the closed step
    (``compiled.step``) and the open step (``compiled.backward``, the optimizer outside
    autocast), each beside DDP on the rank's half batch under the same autocast; returns per
    kind this rank's parameters and DDP's (the whole model: ``compiled.state_dict()``)."""
    out = {}
    for kind in ("closed", "open"):
        torch.manual_seed(0)
        model = Chain()
        ref = copy.deepcopy(model)
        ddp, ref_opt = DDP(ref), torch.optim.SGD(ref.parameters(), lr=0.1)
        sgd = functools.partial(torch.optim.SGD, lr=0.1)
        compiled = (_compile(model, _float32_data(0)[0], optimizer=sgd) if kind == "closed"
                    else _compile(model, _float32_data(0)[0]))
        opt = None if kind == "closed" else sgd(model.parameters())
        for step in range(2):
            x, y = _float32_data(step)
            with _bf16():
                if kind == "closed":
                    compiled.step((x,), y)
                else:
                    compiled.backward((x,), y)
                ref_loss = F.cross_entropy(ddp(x.tensor_split(size)[rank]),
                                           y.tensor_split(size)[rank])
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            if opt is not None:
                opt.step()
                opt.zero_grad()
        state = {k: v.clone() for k, v in compiled.state_dict().items()}
        out[kind] = (state, {k: v.detach().clone() for k, v in ref.state_dict().items()})
    return out


def _autocast_on_one_rank(rank, size):
    """Rank 0 steps under bf16 autocast, rank 1 without: the error each rank raises (type,
    message), before any transfer."""
    torch.manual_seed(0)
    compiled = _compile(Chain(), _float32_data(0)[0],
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    x, y = _float32_data(0)
    try:
        with _bf16() if rank == 0 else contextlib.nullcontext():
            compiled.step((x,), y)
    except TransferMismatchError as e:
        return type(e).__name__, str(e)
    return "no error", ""


UNEVEN = (8, 7, 5, 1)       # global batches: the plan's, then smaller; 1 row leaves rank 1 no
                            # rows of the layers on both ranks (it skips them for that batch)
UNEVEN_TOL = 1e-9           # float64


def _rows_data(rows, seed):
    g = torch.Generator().manual_seed(300 + seed)
    return (torch.randn(rows, 3, 6, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (rows,), generator=g))


def _uneven_batches(rank, size):
    """SGD steps on global batches of ``UNEVEN`` rows under the plan for 8 (one process too:
    rank 0 of 1): per kind (the closed step, the open step with the user's optimizer), the
    losses, ``compiled.state_dict()`` after them and the forward on the last batch of 5+ rows
    (``compiled(x)``: the whole output on every rank)."""
    torch.set_default_dtype(torch.float64)
    out = {}
    for kind in ("closed", "open"):
        model = _model()
        sgd = functools.partial(torch.optim.SGD, lr=0.1)
        compiled = _compile(model, optimizer=sgd) if kind == "closed" else _compile(model)
        opt = None if kind == "closed" else sgd(model.parameters())
        losses = []
        for i, rows in enumerate(UNEVEN):
            x, y = _rows_data(rows, i)
            if opt is None:
                losses.append(compiled.step((x,), y))
            else:
                losses.append(compiled.backward((x,), y))
                opt.step()
                opt.zero_grad()
        state = {k: v.clone() for k, v in compiled.state_dict().items()}
        out[kind] = (torch.stack(losses), state, compiled(_rows_data(5, 9)[0]).detach())
    return out


def _uneven_reference():
    """``_uneven_batches``' steps in plain PyTorch on one process (float64)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i, rows in enumerate(UNEVEN):
        x, y = _rows_data(rows, i)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), model.state_dict(), model(_rows_data(5, 9)[0]).detach()


def _batch_norm_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 3))


def _too_few_rows_for_batch_norm(rank, size):
    """A BatchNorm layer on both ranks and a global batch of 1 row (rank 1 would hold none of
    it, and its running statistics count in the layer's average): the error each rank
    raises (type, message); then a step on 4 rows runs."""
    model = _batch_norm_model()
    x = torch.randn(BATCH, 6)
    gm = tidal.trace(model, (x,))
    cost.annotate(gm, (x,))
    problem = build_problem(gm, CLUSTER, BATCH)
    plan = plan_from_counts(problem, {n: 2 for n in problem.names})
    compiled = tidal.compile(model, (x,), passes=[BurstParallel(plan=plan.to_json())],
                             cluster=CLUSTER, loss_fn=F.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    try:
        compiled.step((x[:1],), torch.zeros(1, dtype=torch.long))
        raised = ("no error", "")
    except tidal.TidalError as e:
        raised = (type(e).__name__, str(e))
    loss = compiled.step((x[:4],), torch.zeros(4, dtype=torch.long))  # 2 rows per rank
    return raised, bool(torch.isfinite(loss))


def _ranks_own_rows():
    """Each rank's own rows under ``compile(batch="local")``: 4 + 4 (the plan's global 8),
    then 4 + 3 (a global 7)."""
    x = _rows_data(8, 20)[0]
    return [(x[:4], x[4:]), (x[:4], x[4:7])]


def _local_forward(rank, size):
    """``compile(batch="local")`` (each rank passes its own 4 rows; the plan for the global
    8): the forward on this rank's rows (``BurstProgram.forward_local``, which
    ``Compiled.__call__`` runs under ``batch="local"``) for each of ``_ranks_own_rows``; and a
    forward under the global convention given different batches on the ranks: the error each
    rank raises."""
    torch.set_default_dtype(torch.float64)
    x = _rows_data(8, 20)[0]
    compiled = _compile(_model(), x, example=x.tensor_split(size)[rank], batch="local")
    program = compiled.executor.rank_program
    outs = [compiled(pair[rank]).detach() for pair in _ranks_own_rows()]
    try:
        program.forward(compiled.graph_module, x + rank)
        raised = ("no error", "")
    except tidal.TidalError as e:
        raised = (type(e).__name__, str(e))
    return outs, raised


def _topk_run(rank, resume):
    """4 SGD steps of the burst plan + Top-K 30 % (error feedback): uninterrupted
    (``resume=None``), or 2 steps, then a fresh model and compile given the model's state and
    (``resume="runtime"``) the runtime state through ``tidal.checkpoint``, then 2 more.
    Returns ``compiled.state_dict()`` after the 4 steps and the runtime state's sections."""
    from tidal.passes.compression import CompressionPass

    def fresh():
        return _compile(_model(), passes=[CompressionPass("topk:0.3")],
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1))

    compiled = fresh()
    saved = {}
    for step in range(4):
        if step == 2 and resume is not None:
            model_state = {k: v.clone() for k, v in compiled.state_dict().items()}
            runtime = copy.deepcopy(tidal.checkpoint.get_runtime_state_dict(compiled))
            saved = compiled.runtime_state_dict()
            compiled = fresh()
            compiled.load_state_dict(model_state)
            if resume == "runtime":
                tidal.checkpoint.set_runtime_state_dict(compiled, runtime)
        x, y = _data(step, 0)
        compiled.step((x,), y)
    return {k: v.clone() for k, v in compiled.state_dict().items()}, sorted(saved)


def _topk_runtime_state(rank, size):
    torch.set_default_dtype(torch.float64)
    return {resume: _topk_run(rank, resume) for resume in (None, "runtime", "model only")}


@pytest.fixture(scope="module")
def two_rank_job():
    return spawn_parts(2, [part(_accumulating_loop), part(_non_finite_on_one_rank),
                           part(_under_autocast), part(_autocast_on_one_rank),
                           part(_uneven_batches), part(_too_few_rows_for_batch_norm),
                           part(_local_forward), part(_topk_runtime_state)],
                       timeout_s=600)


def _float32_one_process():
    """The 2 SGD steps of ``_under_autocast`` in float32, one process, the global batch."""
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        F.cross_entropy(model(_float32_data(step)[0]), _float32_data(step)[1]).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_bf16_autocast_steps_equal_ddp_under_the_same_autocast(two_rank_job):
    float32 = _float32_one_process()
    for rank, result in enumerate(two_rank_job["_under_autocast"]):
        for kind, (state, ddp) in result.items():
            assert state.keys() == ddp.keys()
            worst = max((state[k] - ddp[k]).abs().max().item() for k in ddp)
            assert worst <= AUTOCAST_TOL, f"rank {rank}, {kind} step: off DDP by {worst:.2e}"
            # bf16 really ran: far from the float32 run, as DDP under autocast is
            cast = max((state[k] - float32[k]).abs().max().item() for k in ddp)
            assert cast > BF16_EFFECT, f"rank {rank}, {kind} step: {cast:.2e} off float32"


def test_ranks_under_different_autocast_states_raise_not_abort(two_rank_job):
    for rank, (kind, message) in enumerate(two_rank_job["_autocast_on_one_rank"]):
        assert kind == "TransferMismatchError", (rank, kind)
        assert "differ in input shapes or autocast state" in message
        assert f"rank {rank}" in message and "torch.autocast" in message


def test_accumulating_loop_equals_one_process_pytorch(two_rank_job):
    ref, ref_losses, ref_norms = _reference()
    assert (ref_norms > MAX_NORM).all(), ref_norms      # every step was clipped
    want = dict(ref.named_parameters())
    initial = dict(_model().named_parameters())
    results = two_rank_job["_accumulating_loop"]
    owners = [set(r[0]) for r in results]
    assert "c1.weight" in owners[0] - owners[1] and owners[0] | owners[1] == set(want)
    for rank, (mine, params, losses, norms, state, seen, untouched, all_held) in \
            enumerate(results):
        torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=1e-12)
        for name in mine:
            diff = (params[name] - want[name]).abs().max().item()
            assert diff <= PARAM_TOL, f"rank {rank}: {name} off by {diff:.2e}"
            assert (params[name] - initial[name]).abs().max() > 1e-3, (rank, name)  # trained
        assert state.keys() == ref.state_dict().keys()
        for k, v in ref.state_dict().items():      # the whole model, current on every rank
            torch.testing.assert_close(state[k], v, rtol=0, atol=PARAM_TOL,
                                       msg=f"rank {rank}: state_dict()[{k!r}]")
        assert seen["grad_inside_no_sync"] == [False] * STEPS, (rank, seen)
        assert seen["foreign_grads"] == [[]] * STEPS, (rank, seen)
        assert untouched == [n for n in want if n not in mine], rank  # never stepped here
        assert all_held, "the user's optimizer keeps every parameter"
    assert torch.equal(results[0][3], results[1][3])    # the same norm on both ranks


def test_non_finite_gradients_on_one_rank_skip_the_step_on_both(two_rank_job):
    (skip0, norms0, scales0, mine0, params0), (skip1, norms1, scales1, mine1, params1) = \
        two_rank_job["_non_finite_on_one_rank"]
    assert skip0 and skip1                              # both ranks skipped the inf step
    assert torch.isinf(norms0[0]) and torch.isinf(norms1[0])
    assert torch.isfinite(norms0[1]) and torch.equal(norms0[1], norms1[1])
    assert scales0 == scales1 == [8.0, 8.0]             # backed off once, on both ranks
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = _data(1, 0)
    F.cross_entropy(ref(x), y).backward()
    opt.step()
    want = dict(ref.named_parameters())
    for mine, params in ((mine0, params0), (mine1, params1)):
        for name in mine:
            torch.testing.assert_close(params[name], want[name], rtol=0, atol=PARAM_TOL)
    for name in set(mine0) & set(mine1):                # the owners' copies stay identical
        assert torch.equal(params0[name], params1[name]), name


def _assert_uneven_equal(result, where):
    ref_losses, ref_state, ref_out = _uneven_reference()
    for kind, (losses, state, out) in result.items():
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=UNEVEN_TOL,
                                   msg=f"{where}, {kind} step: losses")
        assert state.keys() == ref_state.keys()
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=UNEVEN_TOL,
                                       msg=f"{where}, {kind} step: {k}")
        torch.testing.assert_close(out, ref_out, rtol=0, atol=UNEVEN_TOL,
                                   msg=f"{where}, {kind} step: forward on 5 rows")


def test_smaller_batches_equal_eager_on_two_ranks(two_rank_job):
    """Steps on 8, 7, 5, 1 rows under the plan for 8 equal plain SGD on each batch's mean
    loss (≤ 1e-9, float64), closed and open, on both ranks; so does the forward on 5 rows."""
    for rank, result in enumerate(two_rank_job["_uneven_batches"]):
        _assert_uneven_equal(result, f"rank {rank}")


def test_smaller_batches_equal_eager_in_one_process():
    before = torch.get_default_dtype()
    try:
        _assert_uneven_equal(_uneven_batches(0, 1), "one process")
    finally:
        torch.set_default_dtype(before)


def test_a_batch_leaving_a_rank_no_rows_of_a_batch_norm_layer_is_refused(two_rank_job):
    for rank, ((kind, message), finite) in enumerate(
            two_rank_job["_too_few_rows_for_batch_norm"]):
        assert kind == "BatchError", (rank, kind, message)
        assert "1 rows leaves rank 1 no rows of layer" in message and "'1.running_mean'" in \
            message, message
        assert finite, f"rank {rank}: the step on 4 rows after the refusal"


def test_local_forward_gives_this_ranks_rows(two_rank_job):
    model = _model()
    for rank, (outs, (kind, message)) in enumerate(two_rank_job["_local_forward"]):
        for pair, out in zip(_ranks_own_rows(), outs):
            want = model(pair[rank]).detach()
            assert out.shape == want.shape, (rank, out.shape, want.shape)
            torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
        assert kind == "BatchError" and "ranks" in message, (rank, kind, message)


def test_topk_runtime_state_resumes_bit_for_bit(two_rank_job):
    for rank, runs in enumerate(two_rank_job["_topk_runtime_state"]):
        whole, _ = runs[None]
        resumed, sections = runs["runtime"]
        fresh, _ = runs["model only"]
        assert "grad_sync" in sections, (rank, sections)
        for k, v in whole.items():
            assert torch.equal(resumed[k], v), f"rank {rank}: {k} after resuming"
        assert any(not torch.equal(fresh[k], v) for k, v in whole.items()), \
            f"rank {rank}: the compressor state made no difference"

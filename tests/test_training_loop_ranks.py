"""Issue 34's table on two gloo ranks: every row of what a real training loop does, under every
training pass and no pass, against plain PyTorch — DDP on the same two ranks where DDP can run
the row, one process on the global batch's mean loss where it cannot (a layer frozen after DDP
was built, a last smaller batch: DDP weights ranks equally), and for ``tick_tock`` Lemma 1's
reference (two replicas, each wave applying the mean of the 2N shard gradients of iterations
m−1 and m with its own optimizer). ONE spawned job runs every cell; each cell returns the
largest difference it saw, or the refusal it met (type and message). A cell is equal
(float64: ≤ TOL; bf16 autocast: ≤ AUTOCAST_TOL) or a refusal listed in ``REFUSALS`` whose
message names what it refuses (README, Training loops); anything else fails, naming the cell.
The one-process cells are tests/test_training_loop_matrix.py.
"""
from __future__ import annotations

import contextlib
import copy
import re
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import tidal
from tidal.ir import cost
from tidal.passes.burst_parallel import BurstParallel, build_problem
from tidal.passes.burst_planner import plan_from_counts
from tidal.passes.compression import CompressionPass
from tidal.passes.round_robin import RoundRobin
from tidal.passes.tick_tock import TickTock
from tidal.runtime.distributed import spawn

from tick_tock_reference import Eq1Reference
from training_passes import LoopNet

WORLD, BATCH, STEPS = 2, 8, 3
TOL = 1e-9                       # float64
AUTOCAST_TOL = 1e-5              # float32 under bf16 autocast (bf16 vs float32: ~1.2e-4)
AUTOCAST_BURST_TOL = 5e-5        # layer a on rank 0 sums 8 rows in bf16, DDP two sums of 4
CLUSTER = tidal.Cluster(gpus=WORLD, bandwidth_gbps=100, latency_us=5, peak_tflops=1e-4)
PASSES = {
    "none": lambda: [],
    "compression": lambda: [CompressionPass("none")],
    "burst_parallel": None,     # a plan with layer a on rank 0 only: see _compile
    "tick_tock": lambda: [TickTock(ranks=WORLD)],
    "round_robin": lambda: [RoundRobin(partitions=WORLD)],
}
PROGRAMS = ("compression", "burst_parallel", "tick_tock", "round_robin")

REFUSALS = {
    # (pass, row): what the refusal's message must say (README: Training loops)
    ("tick_tock", "GradScaler"): r"OpenStepError: .*not available under TickTockPlan",
    **{(p, "loss_fn reads a changing value"): r"StepGuardError: .*loss_fn reads global 'W'"
       for p in PROGRAMS},
    ("tick_tock", "last smaller batch"): r"BatchError: .*tick_tock",
    ("tick_tock", "buffer updated in place"): r"BufferUpdateError: .*'(count|ema)'",
    ("round_robin", "buffer updated in place"): r"BufferUpdateError: .*'(count|ema)'",
}

W = {"w": 1.0}
"""A value ``_weighted_loss`` reads from outside its arguments (changed by one row)."""


def _weighted_loss(out, y):
    return F.cross_entropy(out, y) * W["w"]


def _Net(drop: float = 0.0, buffer: bool = False):
    """The table's model, without dropout unless asked (so DDP's run is deterministic)."""
    return LoopNet(drop, buffer)


def _batch(i, rows=BATCH):
    g = torch.Generator().manual_seed(10 + i)
    x = torch.randn(rows, 8, generator=g, dtype=torch.float64)
    return x.to(torch.get_default_dtype()), torch.randint(0, 3, (rows,), generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _groups(params):
    params = list(params)
    return torch.optim.AdamW([{"params": params[0::2], "weight_decay": 0.1},
                              {"params": params[1::2], "weight_decay": 0.0}], lr=1e-2)


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))


def _compile(name, model, optimizer=None, loss_fn=F.cross_entropy, batch="global", **kw):
    x = _batch(0)[0]
    if name == "burst_parallel":   # layer a on rank 0 only, every other layer on both ranks
        gm = tidal.trace(model, (x,))
        cost.annotate(gm, (x,))
        problem = build_problem(gm, CLUSTER, BATCH)
        plan = plan_from_counts(problem, {n: 1 if n == "a" else WORLD for n in problem.names})
        passes = [BurstParallel(plan=plan.to_json())]
    else:
        passes = PASSES[name]()
    if batch == "local":           # the example is what one rank passes
        x = _half(x, 0)
    return tidal.compile(model, (x,), passes=passes, loss_fn=loss_fn, optimizer=optimizer,
                         cluster=CLUSTER, batch=batch, **kw)


def _diff(got: dict, want: dict) -> float:
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def _half(t, rank):
    return t.tensor_split(WORLD)[rank]


# --- references ------------------------------------------------------------------------------

def _bf16(on=True):
    """Autocast as a loop enters it: around one step's forward and loss."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def _ddp_steps(rank, model, opt, batches, sched=None, between=None, local=False, amp=False):
    """The closed step under DDP: each rank its half of each global batch (``local``: the
    batch given is already this rank's; ``amp``: forward and loss under bf16 autocast)."""
    ddp = DDP(model)
    for step, (x, y) in enumerate(batches):
        xs, ys = (x, y) if local else (_half(x, rank), _half(y, rank))
        with _bf16(amp):
            loss = F.cross_entropy(ddp(xs), ys)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if between is not None:
            between(step, model)
    return model


def _global_steps(model, opt, batches, between=None, loss_fn=F.cross_entropy, amp=False):
    """The closed step on one process, on the global batch's mean loss."""
    for step, (x, y) in enumerate(batches):
        with _bf16(amp):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if between is not None:
            between(step, model)
    return model


def _tick_tock_diff(c, model, opt_fn, batches, sched_fn=None, change=None, amp=False):
    """tick_tock after closed steps on ``batches`` against Eq. 1 over two copies (each with
    ``opt_fn``'s optimizer and ``sched_fn``'s schedule; ``change(step, copy)`` after each
    step): the model against the tick copy, the tock replica against the tock copy."""
    eq1 = Eq1Reference(_Net(), F.cross_entropy, shards=WORLD)
    opts = eq1.both(lambda ps: [opt_fn(ps)])
    scheds = [sched_fn(o) for o in opts] if sched_fn is not None else []
    for step, (x, y) in enumerate(batches):
        with _bf16(amp):
            eq1.backward(x, y)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for sched in scheds:
            sched.step()
        if change is not None:
            eq1.change(lambda m: change(step, m))
    return max(_diff(model.state_dict(), eq1.tick.state_dict()),
               _diff(c.executor.rank_program.tock.state_dict(), eq1.tock.state_dict()))


# --- the rows: each returns the largest difference from its reference -----------------------

def _closed_adamw_groups_and_schedule(rank, name):
    model = _Net()
    c = _compile(name, model, optimizer=_groups)
    sched = _schedule(c.optimizer)
    batches = [_batch(i) for i in range(STEPS)]
    for x, y in batches:
        c.step((x,), y)
        sched.step()
    if name == "tick_tock":
        return _tick_tock_diff(c, model, _groups, batches, _schedule)
    ref = _Net()
    opt = _groups(ref.parameters())
    _ddp_steps(rank, ref, opt, batches, sched=_schedule(opt))
    return _diff(c.state_dict(), ref.state_dict())


def _open_loop_run(nets, backward, no_sync, clip, micro=2):
    """Two optimizers on each of ``nets`` (AdamW with two groups and a schedule; SGD),
    accumulation over ``micro`` micro-batches (all but the last inside ``no_sync``), clipping
    by the global norm."""
    opts, scheds = [], []
    for net in nets:
        params = list(net.parameters())
        opts += [_groups(params[:2]), torch.optim.SGD(params[2:], lr=0.1)]
        scheds.append(_schedule(opts[-2]))
    for step in range(STEPS):
        for i in range(micro):
            x, y = _batch(step * micro + i)
            with no_sync() if i < micro - 1 else contextlib.nullcontext():
                backward(x, y, 1 / micro)
        clip(0.05)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for sched in scheds:
            sched.step()


def _open_loop(rank, name):
    model = _Net()
    c = _compile(name, model)
    _open_loop_run([model], lambda x, y, s: c.backward((x,), y, scale=s), c.no_sync,
                   c.clip_grad_norm_)
    if name == "tick_tock":    # Eq. 1 over two copies, each with the loop's optimizers
        eq1 = Eq1Reference(_Net(), F.cross_entropy, shards=WORLD)
        _open_loop_run([eq1.tick, eq1.tock], eq1.backward, eq1.no_sync, eq1.clip_grad_norm_)
        return max(_diff(model.state_dict(), eq1.tick.state_dict()),
                   _diff(c.executor.rank_program.tock.state_dict(), eq1.tock.state_dict()))
    ref = _Net()
    ddp = DDP(ref)
    _open_loop_run([ref], lambda x, y, s: (F.cross_entropy(ddp(_half(x, rank)), _half(y, rank))
                                         * s).backward(),
                   ddp.no_sync, lambda m: torch.nn.utils.clip_grad_norm_(ref.parameters(), m))
    return _diff(c.state_dict(), ref.state_dict())


def _grad_scaler(rank, name):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    model, ref = _Net(), _Net()
    c = _compile(name, model)
    ddp = DDP(ref)
    runs = [(model, lambda x, y, s: c.backward((x,), y, scale=s)),
            (ref, lambda x, y, s: s.scale(F.cross_entropy(ddp(_half(x, rank)),
                                                          _half(y, rank))).backward())]
    for net, backward in runs:
        opt = _sgd(net.parameters())
        scaler = (ShardedGradScaler if name == "burst_parallel" and net is model
                  else torch.amp.GradScaler)("cpu", init_scale=2.0 ** 6)
        for step in range(2):
            backward(*_batch(step), scaler)
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return _diff(c.state_dict(), ref.state_dict())


def _autocast_bf16(rank, name):
    torch.set_default_dtype(torch.float32)
    model = _Net()
    c = _compile(name, model, optimizer=_sgd)
    batches = [_batch(i) for i in range(2)]
    for x, y in batches:
        with _bf16():
            c.step((x,), y)
    tol = AUTOCAST_BURST_TOL if name == "burst_parallel" else AUTOCAST_TOL
    diffs = {}
    for amp in (True, False):   # autocast must be in effect: the float32 reference is far
        if name == "tick_tock":
            diffs[amp] = _tick_tock_diff(c, model, _sgd, batches, amp=amp)
            continue
        ref = _Net()
        if name == "none":      # every rank runs the whole batch
            _global_steps(ref, _sgd(ref.parameters()), batches, amp=amp)
        else:
            _ddp_steps(rank, ref, _sgd(ref.parameters()), batches, amp=amp)
        diffs[amp] = _diff(c.state_dict(), ref.state_dict())
    assert diffs[False] > max(3 * diffs[True], 2 * AUTOCAST_TOL), f"as if in float32: {diffs}"
    return diffs[True], tol


def _freeze_after_step_1(rank, name):
    def freeze(step, net):
        if step == 0:
            net.a.weight.requires_grad_(False)
    model = _Net()
    c = _compile(name, model, optimizer=_sgd)
    batches = [_batch(i) for i in range(STEPS)]
    for step, (x, y) in enumerate(batches):
        c.step((x,), y)
        freeze(step, model)
    if name == "tick_tock":   # Eq. 1 over two copies, frozen in both
        return _tick_tock_diff(c, model, _sgd, batches, change=freeze)
    ref = _Net()
    _global_steps(ref, _sgd(ref.parameters()), batches, between=freeze)
    return _diff(c.state_dict(), ref.state_dict())


def _eval_then_step(rank, name):
    """Step 1 in training mode with dropout (random: not compared), then ``model.eval()``:
    step 2's loss is the eval-mode loss of the parameters it started from (no dropout), and
    its update that of plain SGD from them (tick_tock: its loss, of both replicas)."""
    model = _Net(drop=0.5)
    c = _compile(name, model, optimizer=_sgd)
    x0, y0 = _batch(0)
    c.step((x0,), y0)
    model.eval()
    c.state_dict()                      # burst_parallel: the stale copies made current
    start = copy.deepcopy(model)
    x, y = _batch(1)
    if name == "tick_tock":
        tock = copy.deepcopy(c.executor.rank_program.tock).eval()
        n = BATCH // 2
        want = (F.cross_entropy(start(x[:n]), y[:n]) + F.cross_entropy(tock(x[n:]), y[n:])) / 2
        return abs(c.step((x,), y).item() - want.item())
    want = F.cross_entropy(start(x), y)
    loss = c.step((x,), y)
    _global_steps(start, _sgd(start.parameters()), [(x, y)])
    return max(abs(loss.item() - want.item()), _diff(c.state_dict(), start.state_dict()))


def _state_dict_current(rank, name):
    model = _Net()
    c = _compile(name, model, optimizer=_sgd)
    batches = [_batch(i) for i in range(2)]
    for x, y in batches:
        c.step((x,), y)
    if name == "tick_tock":
        return _tick_tock_diff(c, model, _sgd, batches)
    ref = _Net()
    _ddp_steps(rank, ref, _sgd(ref.parameters()), batches)
    sd, _ = tidal.checkpoint.get_state_dict(c, c.optimizer)
    return max(_diff(c.state_dict(), ref.state_dict()), _diff(sd, ref.state_dict()))


def _last_smaller_batch(rank, name):
    model = _Net()
    c = _compile(name, model, optimizer=_sgd)
    batches = [_batch(0), _batch(1, rows=7)]
    for x, y in batches:
        c.step((x,), y)
    ref = _Net()
    _global_steps(ref, _sgd(ref.parameters()), batches)
    return _diff(c.state_dict(), ref.state_dict())


def _local_batches(rank, name):
    """``batch="local"``: each rank passes its own half (a ``DistributedSampler``'s), as
    with DDP."""
    model = _Net()
    c = _compile(name, model, optimizer=_sgd, batch="local")
    batches = [_batch(i) for i in range(2)]
    for x, y in batches:
        c.step((_half(x, rank),), _half(y, rank))
    if name == "tick_tock":
        return _tick_tock_diff(c, model, _sgd, batches)
    ref = _Net()
    _ddp_steps(rank, ref, _sgd(ref.parameters()),
               [(_half(x, rank), _half(y, rank)) for x, y in batches], local=True)
    return _diff(c.state_dict(), ref.state_dict())


def _buffer_updated_in_place(rank, name):
    """Data parallelism keeps DDP's buffers (rank 0's broadcast before each forward, then each
    rank's own update); burst_parallel and no pass those of the global batch."""
    model = _Net(buffer=True)
    c = _compile(name, model, optimizer=_sgd)
    batches = [_batch(i) for i in range(STEPS)]
    for x, y in batches:
        c.step((x,), y)
    ref = _Net(buffer=True)
    if name == "compression":
        _ddp_steps(rank, ref, _sgd(ref.parameters()), batches)
    else:
        _global_steps(ref, _sgd(ref.parameters()), batches)
    return _diff(c.state_dict(), ref.state_dict())


def _loss_fn_reads_a_changing_value(rank, name):
    def between(step, _):
        if step == 0:
            W["w"] = 2.0
    W["w"] = 1.0
    try:
        model = _Net()
        c = _compile(name, model, optimizer=_sgd, loss_fn=_weighted_loss)
        batches = [_batch(i) for i in range(2)]
        for step, (x, y) in enumerate(batches):
            c.step((x,), y)
            between(step, model)
        W["w"] = 1.0
        ref = _Net()
        _global_steps(ref, _sgd(ref.parameters()), batches, between, loss_fn=_weighted_loss)
        return _diff(c.state_dict(), ref.state_dict())
    finally:
        W["w"] = 1.0


ROWS = {
    "AdamW groups + LR schedule": _closed_adamw_groups_and_schedule,
    "open loop": _open_loop,
    "GradScaler": _grad_scaler,
    "bf16 autocast": _autocast_bf16,
    "freeze after step 1": _freeze_after_step_1,
    "eval then step": _eval_then_step,
    "state_dict / DCP current": _state_dict_current,
    "last smaller batch": _last_smaller_batch,
    "each rank its own batch": _local_batches,
    "buffer updated in place": _buffer_updated_in_place,
    "loss_fn reads a changing value": _loss_fn_reads_a_changing_value,
}


def _cells(rank, world):
    """Every (pass, row) cell on this rank: ("equal", difference) or ("refused"/"error",
    message)."""
    out = {}
    for name in PASSES:
        for row, fn in ROWS.items():
            torch.set_default_dtype(torch.float64)
            try:
                diff = fn(rank, name)
                out[name, row] = ("equal", diff if isinstance(diff, tuple) else (diff, TOL))
            except tidal.TidalError as e:
                out[name, row] = ("refused", f"{type(e).__name__}: {e}")
            except Exception as e:  # a crash: reported by the cell's test, not the job
                out[name, row] = ("error", f"{type(e).__name__}: {e}\n"
                                           f"{traceback.format_exc(limit=-4)}")
    return out


@pytest.fixture(scope="module")
def cells():
    return spawn(_cells, WORLD, timeout_s=900)


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("name", list(PASSES))
def test_cell(cells, name, row):
    for rank, ranks_cells in enumerate(cells):
        kind, value = ranks_cells[name, row]
        where = f"{name} / {row} on rank {rank}"
        if kind == "equal":
            diff, tol = value
            assert diff <= tol, f"{where}: max |Δ| {diff:.3e} > {tol}"
        elif kind == "refused" and (name, row) in REFUSALS:
            assert re.search(REFUSALS[name, row], value, re.S), f"{where}: {value}"
        else:
            pytest.fail(f"{where}: {kind}: {value}")

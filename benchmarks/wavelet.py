"""Wavelet on gloo ranks: round_robin against torch.distributed.pipelining (GPipe, 1F1B, the
zero-bubble schedules) and hand-written pipelines; tick_tock against data parallelism at the
memory-bound batch; the predicted peak-memory interleaving of VGG-19 and BERT-base.

These are CPU figures, not GPU figures: gloo ranks share a few cores, so the step times say
how the schedules' work and communication add up on a CPU, not what a GPU would gain (the
paper reports up to 1.88x for data parallelism and 6.7x for model parallelism on V100s, where
the gains come from idle GPU memory and compute that a CPU run does not have). Every ratio is
computed from figures measured in the same run; no timing is asserted.

    python benchmarks/wavelet.py                 # 4 ranks: both tables + VGG-19/BERT memory
    python benchmarks/wavelet.py --ranks 2 --steps 3 --no-memory

Table 1, pipelines: one MLP chain (``--depth`` x ``--width``, ``--batch`` global samples), N
ranks (``--ranks``), N micro-batches of the global batch, SGD, loss ``cross_entropy`` averaged
over the global batch. Rows: tidal ``round_robin`` (``RoundRobin(partitions=N)``); the
hand-written GPipe-style pipeline and vanilla model parallelism (one micro-batch) on the same
split (partition r on rank r); ``torch.distributed.pipelining`` ``ScheduleGPipe`` and
``Schedule1F1B`` with one ``PipelineStage`` per rank, a deep copy of round_robin's
``submod_<rank>``; the zero-bubble schedules (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``:
two stages per rank in a V; ``ScheduleInterleavedZeroBubble``: two per rank, looped), whose
2N stages are the halves of the same N partitions; a schedule torch refuses prints
``not supported:`` and torch's reason. Columns:

- ``step ms``: the median over ``--steps`` timed steps (after one warm-up step) of the wall
  time of one step, from a barrier before it to a barrier after it (so the slowest rank's);
  the larger median of the ranks.
- ``/rr``: ``step ms`` over round_robin's (above 1: slower than round_robin).
- ``act MiB``: the peak of the activation bytes autograd keeps for backward during one step
  (``tidal.runtime.weights.memory_probe.MemoryProbe``: each saved storage once, freed when autograd
  frees it; parameters excluded; inputs a layer saves count, on rank 0 the global batch whose
  slices the micro-batches are), the max over the ranks. ``-``: the schedule saves nothing the
  probe sees (round_robin runs captured joint graphs on tidal's stream threads, no autograd).
- ``act+state MiB`` and ``per rank``: that peak plus the rank's training state after the step
  (``state_bytes``: parameters, gradients, optimizer state, each storage once); the max over
  the ranks, then ranks 0..N-1. round_robin's state is the whole model: every rank runs every
  partition.
- ``heap+state MiB`` and ``per rank``: the highest rise of the process's C heap in use during
  one step above its level at entry (glibc ``mallinfo2``, sampled every 0.2 ms on a thread and
  at each tensor autograd saves:
  every thread's tensors, activations and their gradients, received buffers, temporaries) plus
  the state at entry (which that level holds, so the sum is the step's peak of tensor memory);
  max, then each rank. The one memory figure measured the same way for every row.
- ``grad rel diff``: after the first step on the fixed global batch (before any update), the
  largest ``max|g - g_ref| / max|g_ref|`` over the parameters a rank holds and over the ranks,
  ``g_ref`` being the gradient of the whole model on the whole global batch in one process
  (``loss.backward()`` once): micro-batch accumulation must match it to float tolerance.

Below the table: round_robin's weight bytes switched per rank per step, the reasons torch gave
for what it refused, and the tidal schedule objects of these runs (:func:`schedules_for`).

Table 2, tick_tock vs data parallelism at the memory-bound batch (``--no-fit`` skips it):
``--memory-gb`` per rank, an MLP of ``--fit-width`` (same depth; narrow, so that the
activations and not the weights fill the budget). ``tidal.ir.memory_fit.fit_batches`` (memory
timeline of the captured step at each batch it tries, ``predicted_state_bytes``) gives data
parallelism's largest per-rank batch (``dp_batch``) and tick-tock's per-wave batch
(``wave_batch``); data parallelism (hand-written: all-reduce of the averaged gradients, SGD)
then runs N x dp_batch global samples per step and tick_tock (``TickTock``) 2N x wave_batch.
Columns: ``batch/rank`` (samples per rank per step), ``samples/s`` (global samples per second:
data parallelism from its median step as in table 1, tick_tock from one ``Compiled.train_scheduled``
call over ``--steps`` steps, whose waves run on persistently from step to step), ``ratio`` (to
data parallelism), ``predicted MiB`` (the fit's peak per rank: one replica's state plus the
timeline's activation peak; tick-tock two replicas plus the two waves' interleaved peak),
``act+state MiB`` and ``heap+state MiB`` (measured as in table 1 over one ``step``, the max
over ranks; tick_tock's state is both replicas'; its act is ``-`` for round_robin's reason).
Below it, data parallelism's gradient difference to one process (as in table 1).

Table 3 (``--no-memory`` skips it), predicted activation memory of VGG-19 and BERT-base from
the memory timeline: ``saved MiB`` (activations the forward leaves for the backward), ``peak
MiB`` (highest live activation bytes), ``tick+tock`` (peak of a tick and a tock wave offset
by the forward time), ``gang 2x`` (two waves in lockstep: twice the peak), ``ratio``
(tick+tock over gang), ``fwd/iter`` (forward time over iteration time).
"""
from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.fx as fx  # noqa: E402

import tidal  # noqa: E402
from tidal.ir.schedule import split_batch  # noqa: E402
from tidal.passes.round_robin import RoundRobin  # noqa: E402
from tidal.passes.tick_tock import TickTock  # noqa: E402
from tidal.runtime.distributed import spawn  # noqa: E402
from tidal.runtime.weights.memory_probe import MemoryProbe, heap_bytes, state_bytes  # noqa: E402

MIB = 2 ** 20
LOSS = torch.nn.functional.cross_entropy
HEAP_INTERVAL_S = 2e-4


def schedules_for(n: int, m: int) -> dict[str, Any]:
    """The tidal schedules (``tidal.ir.pipeline_schedules``, one action vocabulary with
    torch's) of what table 1 runs on ``n`` ranks and ``m`` micro-batches: ``GPipe``, ``1F1B``
    and ``round_robin`` (Wavelet Fig. 10, ``n`` micro-batches), and ``tick_tock`` (one step, Fig.
    9) for table 2; empty when that module is not there."""
    try:
        from tidal.ir.pipeline_schedules import gpipe, one_f_one_b, round_robin, tick_tock
    except ImportError:
        return {}
    return {"GPipe": gpipe(n, m), "1F1B": one_f_one_b(n, m), "round_robin": round_robin(n),
            "tick_tock": tick_tock(n)}


# -- model, data, measurement ------------------------------------------------------------------
def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _data(batch: int, width: int):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, width, generator=g),), torch.randint(0, 10, (batch,), generator=g)


def _opt(params):
    return torch.optim.SGD(params, lr=0.01)


def _reference_grads(width: int, depth: int, x: tuple, y: torch.Tensor) -> dict:
    """The whole model on the whole global batch, one backward."""
    ref = _model(width, depth)
    LOSS(ref(*x), y).backward()
    return {k: p.grad.clone() for k, p in ref.named_parameters()}


def _grad_diff(named: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|g - ref| / max|ref| (inf when a gradient is missing)."""
    worst = 0.0
    for k, g in named.items():
        if g is None:
            return float("inf")
        r = ref[k]
        worst = max(worst, float((g - r).abs().max()) / max(float(r.abs().max()), 1e-30))
    return worst


def _timed(step: Callable[[], Any], steps: int) -> list[float]:
    """Wall seconds of each of ``steps`` steps, barrier to barrier."""
    out = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        out.append(time.perf_counter() - t0)
    return out


def _probed(step: Callable[[], Any], exclude: tuple, state: Callable[[], int]) -> dict:
    """One step under the memory probe: the saved-activation peak, the heap's highest rise,
    the state at entry (what the heap rise adds to: the heap's level at entry holds it) and
    after the step."""
    gc.collect()
    dist.barrier()
    entry = state()
    with MemoryProbe(*exclude, host=True, interval_s=HEAP_INTERVAL_S) as probe:
        step()
    dist.barrier()
    return {"act": probe.peak_bytes, "saves": probe.saves, "heap": probe.heap_peak_bytes,
            "state_entry": entry, "state": state()}


def _measure(step: Callable[[], Any], grads: Optional[Callable[[], dict]], ref: Optional[dict],
             exclude: tuple, state: Callable[[], int], steps: int) -> dict:
    """One warm-up step on the fixed batch (its gradients checked against ``ref``), the timed
    steps, then one step under the memory probe."""
    step()
    diff = _grad_diff(grads(), ref) if grads is not None else None
    times = _timed(step, steps)
    return {"ms": 1e3 * statistics.median(times), "grad": diff, **_probed(step, exclude, state)}


# -- the hand-written pipelines -----------------------------------------------------------------
def _hand_pipeline(stage: torch.nn.Module, shape: torch.Size, x, y, rank, world, micro):
    """Model parallelism on a chain split: this rank holds ``stage`` (partition ``rank``);
    ``micro`` micro-batches fill and drain the pipeline (GPipe: all forwards, then all
    backwards); micro = 1 is vanilla model parallelism. ``shape``: a micro-batch's input to
    this stage."""
    opt = _opt(stage.parameters())
    xs, ys = split_batch(x, micro), split_batch(y, micro)

    def step():
        opt.zero_grad()
        saved = []
        for m in range(micro):
            if rank == 0:
                inp = xs[m][0]
            else:
                inp = torch.empty(shape)
                dist.recv(inp, rank - 1)
                inp.requires_grad_(True)
            out = stage(inp)[0]
            if rank < world - 1:
                dist.send(out.detach().contiguous(), rank + 1)
            saved.append((inp, out))
        for m in reversed(range(micro)):
            inp, out = saved[m]
            if rank == world - 1:
                (LOSS(out, ys[m]) / micro).backward()
            else:
                g = torch.empty_like(out)
                dist.recv(g, rank + 1)
                out.backward(g)
            if rank > 0:
                dist.send(inp.grad.contiguous(), rank - 1)
        opt.step()
    return step, opt


def _stage_input_shape(split: fx.GraphModule, rank: int, x: tuple, micro: int) -> torch.Size:
    probe = tuple(t[: t.shape[0] // micro] for t in x)
    with torch.no_grad():
        for p in range(rank):
            probe = getattr(split, f"submod_{p}")(*probe)
    return probe[0].shape


# -- torch.distributed.pipelining --------------------------------------------------------------
class _Unwrap(torch.nn.Module):
    """A split partition (returns a 1-tuple) as a pipeline stage module (returns the tensor)."""

    def __init__(self, mod: torch.nn.Module):
        super().__init__()
        self.mod = mod

    def forward(self, *args):
        out = self.mod(*args)
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out


def _chain(part: fx.GraphModule, index: int) -> list[tuple[str, torch.nn.Module]]:
    """The (name, module) calls of a partition that is a plain chain of modules."""
    calls, prev = [], None
    for n in part.graph.nodes:
        if n.op == "placeholder":
            prev = n
        elif n.op == "call_module" and n.args == (prev,) and not n.kwargs:
            calls.append((str(n.target), part.get_submodule(str(n.target))))
            prev = n
        elif n.op == "output" and n.args[0] in ((prev,), [prev], prev):
            break
        else:
            raise ValueError(f"partition {index} is not a chain of modules (node {n.name}: "
                             f"{n.op} {n.target}), so it cannot be halved into two stages")
    return calls


def _half_stages(split: fx.GraphModule, world: int) -> list[torch.nn.Module]:
    """2N stages: each of the N partitions cut in two halves (deep copies, parameter names as
    in the model)."""
    stages = []
    for r in range(world):
        calls = _chain(getattr(split, f"submod_{r}"), r)
        if len(calls) < 2:
            raise ValueError(f"partition {r} has {len(calls)} module(s): cannot halve it")
        k = (len(calls) + 1) // 2
        for half in (calls[:k], calls[k:]):
            stages.append(torch.nn.Sequential(OrderedDict(
                (name, copy.deepcopy(mod)) for name, mod in half)))
    return stages


def _torch_schedule(kind: str, split: fx.GraphModule, x, y, rank: int, world: int):
    """(step, optimizers, local stage modules, grads) for one torch.distributed.pipelining
    schedule on the split; raises what torch raises when it refuses the configuration."""
    from torch.distributed import pipelining as pp

    cpu = torch.device("cpu")
    if kind in ("GPipe", "1F1B"):
        mods = {rank: _Unwrap(copy.deepcopy(getattr(split, f"submod_{rank}")))}
        stages = [pp.PipelineStage(mods[rank], rank, world, cpu)]
        cls = pp.ScheduleGPipe if kind == "GPipe" else pp.Schedule1F1B
        sched = cls(stages[0], n_microbatches=world, loss_fn=LOSS)
    else:
        halves = _half_stages(split, world)
        n = len(halves)
        if kind == "InterleavedZeroBubble":
            local = [rank, rank + world]                       # looped: stage s on s mod N
            cls = pp.ScheduleInterleavedZeroBubble
        else:
            local = [rank, n - 1 - rank]                       # V: down, then back up
            cls = pp.ScheduleZBVZeroBubble if kind == "ZBVZeroBubble" else pp.ScheduleDualPipeV
        mods = {s: halves[s] for s in local}
        stages = [pp.PipelineStage(mods[s], s, n, cpu) for s in local]
        sched = cls(stages, n_microbatches=world, loss_fn=LOSS)
    first = 0 in mods
    last = max(s.stage_index for s in stages) == stages[0].num_stages - 1
    opts = [_opt(m.parameters()) for m in mods.values()]

    def step():
        for o in opts:
            o.zero_grad()
        sched.step(*(x if first else ()), target=y if last else None, return_outputs=False)
        for o in opts:
            o.step()

    def grads():
        out = {}
        for m in mods.values():
            for k, p in m.named_parameters():
                out[k.removeprefix("mod.")] = p.grad
        return out

    return step, opts, tuple(mods.values()), grads


# -- the worker ---------------------------------------------------------------------------------
TORCH_KINDS = ("GPipe", "1F1B", "ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV")


def _pipelines(rank, world, width, depth, batch, steps) -> dict:
    x, y = _data(batch, width)
    ref = _reference_grads(width, depth, x, y)
    out: dict[str, Any] = {}

    model = _model(width, depth)
    rr = tidal.compile(model, x, passes=[RoundRobin(partitions=world)], loss_fn=LOSS,
                       optimizer=_opt)
    split = rr.graph_module
    pristine = copy.deepcopy(split)   # stage copies for the other rows, before any update
    out["round_robin"] = _measure(
        lambda: rr.step(x, y), lambda: {k: p.grad for k, p in model.named_parameters()}, ref,
        (model,), lambda: state_bytes(model, rr.optimizer), steps)
    out["round_robin"]["switch_mib"] = rr.plan.get("round_robin").switch_bytes_per_step() / MIB

    for name, micro in (("hand GPipe (N micro-batches)", world),
                        ("hand vanilla model parallel", 1)):
        stage = copy.deepcopy(getattr(pristine, f"submod_{rank}"))
        step, opt = _hand_pipeline(stage, _stage_input_shape(pristine, rank, x, micro), x, y,
                                   rank, world, micro)
        out[name] = _measure(step, lambda: {k: p.grad for k, p in stage.named_parameters()},
                             ref, (stage,), lambda: state_bytes(stage, opt), steps)

    for kind in TORCH_KINDS:
        name = f"torch {kind}"
        try:
            step, opts, mods, grads = _torch_schedule(kind, pristine, x, y, rank, world)
        except Exception as e:  # noqa: BLE001 - torch's refusal is the result
            out[name] = {"unsupported": f"{type(e).__name__}: {e}"}
            continue
        out[name] = _measure(step, grads, ref, mods,
                             lambda: sum(state_bytes(m, o) for m, o in zip(mods, opts)), steps)
    return out


def _plain_dp(model, x, y, rank, world):
    opt = _opt(model.parameters())
    # this rank's shard in storage of its own, as a data loader hands it (not a view of the
    # global batch, which the memory probe would count whole)
    xs = tuple(t.clone() for t in split_batch(x, world)[rank])
    ys = split_batch(y, world)[rank].clone()

    def step():
        opt.zero_grad()
        LOSS(model(*xs), ys).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)
        flat /= world
        o = 0
        for p in model.parameters():
            p.grad.copy_(flat[o:o + p.numel()].view_as(p))
            o += p.numel()
        opt.step()
    return step, opt


def _memory_bound(rank, world, width, depth, dp_batch, wave_batch, steps) -> dict:
    out: dict[str, Any] = {}
    if dp_batch:
        x, y = _data(world * dp_batch, width)
        model = _model(width, depth)
        step, opt = _plain_dp(model, x, y, rank, world)
        ref = _reference_grads(width, depth, x, y)
        r = _measure(step, lambda: {k: p.grad for k, p in model.named_parameters()}, ref,
                     (model,), lambda: state_bytes(model, opt), steps)
        r["sps"] = world * dp_batch / (r["ms"] / 1e3)
        out["data parallel"] = r
    if wave_batch:
        x, y = _data(2 * world * wave_batch, width)
        model = _model(width, depth)
        tt = tidal.compile(model, x, passes=[TickTock(ranks=world)], example_targets=y,
                           loss_fn=LOSS, optimizer=_opt)
        tt.step(x, y)   # warm-up: the tock replica, the captured waves
        dist.barrier()
        t0 = time.perf_counter()
        tt.train_scheduled(lambda i: (x, y), steps)   # persistent waves across the steps
        dist.barrier()
        secs = time.perf_counter() - t0
        tock = tt.executor.tock   # the tock replica and its optimizer (made at the first step)

        def state() -> int:
            # the closed step's tock wave steps one clone of tt.optimizer
            return state_bytes(model, tt.optimizer) + state_bytes(
                tock, *tt.executor.tock_optimizers()[:1])

        out["tick_tock"] = {"ms": 1e3 * secs / steps, "grad": None,
                            "sps": 2 * world * wave_batch * steps / secs,
                            **_probed(lambda: tt.step(x, y), (model, tock), state)}
    return out


def _worker(rank, world, args: dict, fit: Optional[dict]) -> dict:
    torch.set_num_threads(1)
    out = {"pipelines": _pipelines(rank, world, args["width"], args["depth"], args["batch"],
                                   args["steps"])}
    if fit is not None:
        out["memory_bound"] = _memory_bound(rank, world, args["fit_width"], args["depth"],
                                            fit["dp_batch"], fit["wave_batch"], args["steps"])
    return out


# -- the parent: fit, memory rows, tables ------------------------------------------------------
def _fit(width: int, depth: int, memory_gb: float, limit: int):
    from tidal.ir.capture import capture_train_step
    from tidal.ir.memory_fit import (fit_batches, gradient_bytes, predicted_state_bytes,
                                     rows_at)
    from tidal.ir.memory_timeline import memory_timeline

    model = _model(width, depth)
    x, y = _data(8, width)

    def timeline_at(b: int):
        return memory_timeline(capture_train_step(model, rows_at(x, b), rows_at(y, b), LOSS))

    return fit_batches(timeline_at, predicted_state_bytes(model, _opt(model.parameters())),
                       int(memory_gb * 2 ** 30), limit, wave_extra_bytes=gradient_bytes(model))


def _memory_rows():
    from examples.models import ZOO
    from tidal.ir.capture import capture_train_step
    from tidal.ir.memory_timeline import interleave, memory_timeline

    rows = []
    for name, batch in (("vgg19", 2), ("bert_base", 2)):
        model = ZOO[name]().train()
        x, y = model.example_inputs(batch), model.example_targets(batch)
        tl = memory_timeline(capture_train_step(model, x, y, model.default_loss))
        il = interleave(tl, tl.forward_us)
        rows.append((name, batch, tl.saved_bytes, tl.peak_bytes, il.peak_sum, il.peak_gang,
                     tl.forward_us, tl.iteration_us))
    return rows


def _per_rank(rows: list[dict], key: str) -> tuple[str, str]:
    """(max over ranks, each rank's) in MiB of: ``act`` the saved-activation peak alone,
    ``act+state`` it plus the state after the step, ``heap+state`` the heap's rise plus the
    state at entry; '-' where not measured."""
    if key.startswith("act") and not any(r["saves"] for r in rows):
        return "-", "-"
    if key.startswith("heap") and any(r["heap"] is None for r in rows):
        return "-", "-"
    vals = [{"act": r["act"], "act+state": r["act"] + r["state"],
             "heap+state": (r["heap"] or 0) + r["state_entry"]}[key] / MIB for r in rows]
    digits = 2 if key == "act" else 1
    return f"{max(vals):.{digits}f}", " ".join(f"{v:.{digits}f}" for v in vals)


def _stage_us(width: int, depth: int, micro: int, world: int) -> tuple[float, float]:
    """One stage's forward and backward of one micro-batch (µs, this process, one thread):
    the whole model's, measured, divided by the ``world`` stages (the split is balanced)."""
    torch.set_num_threads(1)
    model = _model(width, depth)
    (x,), y = _data(micro, width)
    fwd, bwd = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        loss = LOSS(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return (statistics.median(fwd[2:]) * 1e6 / world, statistics.median(bwd[2:]) * 1e6 / world)


def _simulated_ms(n: int, m: int, fwd_us: float, bwd_us: float) -> dict[str, float]:
    """The simulator's step (ms) for table 1's rows that tidal has a schedule object of
    (``tidal.ir.pipeline_schedules``, run by ``tidal.sim.programs.schedule_result``; transfers,
    switches and all-reduces take no time in it: compute only)."""
    from tidal.ir.pipeline_schedules import gpipe, one_f_one_b, round_robin
    from tidal.sim.programs import schedule_result

    def ms(schedule) -> float:
        return schedule_result(schedule, m, contention=True).iteration_us / 1e3

    piped = ms(gpipe(n, m, fwd_us=fwd_us, bwd_us=bwd_us))
    return {"round_robin": ms(round_robin(n, fwd_us=fwd_us, bwd_us=bwd_us)),
            "hand GPipe (N micro-batches)": piped, "torch GPipe": piped,
            "torch 1F1B": ms(one_f_one_b(n, m, fwd_us=fwd_us, bwd_us=bwd_us)),
            "hand vanilla model parallel": ms(gpipe(n, 1, fwd_us=fwd_us * m,
                                                   bwd_us=bwd_us * m))}


def _pipeline_table(res: list[dict], world: int, simulated: dict[str, float]) -> list[str]:
    names = list(res[0]["pipelines"])
    rr_ms = max(r["pipelines"]["round_robin"]["ms"] for r in res)
    w = max(len(n) for n in names)
    pr = 5 * world
    lines = [f"{'schedule':{w}s} {'step ms':>8s} {'sim ms':>7s} {'/rr':>5s} {'act MiB':>7s} "
             f"{'act+state MiB':>13s} {'per rank':{pr}s} {'heap+state MiB':>14s} "
             f"{'per rank':{pr}s} {'grad rel diff':>13s}"]
    unsupported = []
    for name in names:
        rows = [r["pipelines"][name] for r in res]
        why = next((r.get("unsupported") for r in rows if r.get("unsupported")), None)
        if why is not None:
            unsupported.append(f"{name}: not supported: {why}")
            lines.append(f"{name:{w}s} not supported (below)")
            continue
        ms = max(r["ms"] for r in rows)
        act, _ = _per_rank(rows, "act")
        peak, peak_ranks = _per_rank(rows, "act+state")
        heap, heap_ranks = _per_rank(rows, "heap+state")
        diff = max(r["grad"] for r in rows)
        sim = f"{simulated[name]:7.1f}" if name in simulated else f"{'-':>7s}"
        lines.append(f"{name:{w}s} {ms:8.1f} {sim} {ms / rr_ms:5.2f} {act:>7s} {peak:>13s} "
                     f"{peak_ranks:{pr}s} {heap:>14s} {heap_ranks:{pr}s} {diff:13.1e}")
    return lines + unsupported


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256, help="global batch of table 1")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--fit-width", type=int, default=128, help="MLP width of table 2")
    ap.add_argument("--memory-gb", type=float, default=8 / 1024,
                    help="per-rank memory budget of table 2 (default 8 MiB)")
    ap.add_argument("--fit-limit", type=int, default=4096,
                    help="largest per-rank batch table 2's fit tries")
    ap.add_argument("--no-fit", action="store_true", help="skip table 2")
    ap.add_argument("--no-memory", action="store_true", help="skip table 3 (VGG-19, BERT)")
    args = ap.parse_args(argv)
    if args.ranks < 2:
        raise SystemExit(f"--ranks {args.ranks}: need at least 2")
    if args.batch % args.ranks:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --ranks {args.ranks}")
    n = args.ranks
    fit = None if args.no_fit else _fit(args.fit_width, args.depth, args.memory_gb,
                                        args.fit_limit)
    fit_arg = None if fit is None else {"dp_batch": fit.dp_batch, "wave_batch": fit.wave_batch}
    res = spawn(_worker, n, vars(args), fit_arg, timeout_s=1800)

    print("CPU figures, not GPU: gloo ranks sharing this machine's cores; the ratios are of "
          "figures measured in this run.")
    print(f"\n1. pipelines on {n} gloo ranks: MLP {args.depth}x{args.width}, global batch "
          f"{args.batch} in {n} micro-batches, median of {args.steps} steps; MiB per rank "
          f"(max, then ranks 0..{n - 1})")
    fwd_us, bwd_us = _stage_us(args.width, args.depth, args.batch // n, n)
    for line in _pipeline_table(res, n, _simulated_ms(n, n, fwd_us, bwd_us)):
        print(line)
    print(f"sim ms: the simulator runs tidal's schedule object of the row (GPipe, 1F1B, "
          f"round_robin) with one stage's measured forward {fwd_us / 1e3:.2f} ms and backward "
          f"{bwd_us / 1e3:.2f} ms per micro-batch, compute only")
    rr = res[0]["pipelines"]["round_robin"]
    print(f"round_robin loads {rr['switch_mib']:.3g} MiB of weights per rank per step "
          f"(context switches); its act+state is '-': its captured joint graphs save nothing "
          f"through autograd on the caller's thread")
    if heap_bytes() is None:
        print("(heap figures need glibc's mallinfo2, not available here)")
    sched = schedules_for(n, n)
    if sched:
        print(f"tidal schedules of these runs (tidal.ir.pipeline_schedules): "
              f"{', '.join(sched)} (benchmarks.wavelet.schedules_for({n}, {n}))")

    if fit is not None:
        print(f"\n2. tick_tock vs data parallelism at the memory-bound batch: MLP "
              f"{args.depth}x{args.fit_width}, {fit.summary()}")
        mb = [r["memory_bound"] for r in res]
        rows = {"data parallel": (fit.dp_batch, fit.dp_peak),
                "tick_tock": (2 * fit.wave_batch, fit.wave_peak)}
        print(f"{'schedule':14s} {'batch/rank':>10s} {'samples/s':>10s} {'ratio':>6s} "
              f"{'predicted MiB':>13s} {'act+state MiB':>13s} {'heap+state MiB':>14s}")
        base = min(m["data parallel"]["sps"] for m in mb) if "data parallel" in mb[0] else None
        for name, (per_rank, predicted) in rows.items():
            if name not in mb[0]:
                print(f"{name:14s} {'does not fit the budget (batch 0)':>40s}")
                continue
            got = [m[name] for m in mb]
            sps = min(g["sps"] for g in got)
            ratio = f"{sps / base:6.2f}" if base else "     -"
            act, _ = _per_rank(got, "act+state")
            heap, _ = _per_rank(got, "heap+state")
            print(f"{name:14s} {per_rank:10d} {sps:10.1f} {ratio} {predicted / MIB:13.1f} "
                  f"{act:>13s} {heap:>14s}")
        dp = mb[0].get("data parallel")
        if dp is not None:
            print(f"data parallel grad rel diff to one process: "
                  f"{max(m['data parallel']['grad'] for m in mb):.1e}")

    if not args.no_memory:
        print("\n3. predicted activation memory (memory timeline, tock offset = forward time):")
        print(f"{'model':10s} {'batch':>5s} {'saved MiB':>9s} {'peak MiB':>9s} "
              f"{'tick+tock':>9s} {'gang 2x':>9s} {'ratio':>6s} {'fwd/iter':>8s}")
        for name, b, saved, peak, psum, pgang, fwd, it in _memory_rows():
            print(f"{name:10s} {b:5d} {saved / MIB:9.1f} {peak / MIB:9.1f} {psum / MIB:9.1f} "
                  f"{pgang / MIB:9.1f} {psum / pgang:6.2f} {fwd / it:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""End-to-end rows of ``benchmarks/sim_validation.py``: the simulator, given the profiler's
calibrated durations, against the measured step of data parallelism and a burst plan on gloo
ranks.

Inputs of the prediction, all measured before and apart from the runs being predicted:

* a per-layer CPU profile (tidal's profiler, 1 thread) at the per-rank batches the plans use,
  calibrated in context: per batch, the profile is scaled so that its layers add up to a whole
  forward + backward step of the model (``ir.profiler.training_step_samples`` and
  ``calibrate_profile``), timed with every core busy: one process per core runs the same local
  step at once, with no communication, each step started at a barrier; per step the slowest
  process counts, then the estimator over steps (``--calibrate cores``; a synchronous step
  waits for its slowest rank, busy cores slow each other through shared caches and memory,
  and on a noisy machine the best step of each process alone is far below what all ranks
  manage together). ``--calibrate one`` times it on one process alone. The optimizer step
  timed there is an ``update`` task on every rank;
* the gloo link of each world size (``runtime.link_fit.measure_ring_link``, ring all-reduce
  latency and bandwidth);
* the machine's core count: ranks beyond it share the cores, simulated as processor sharing of
  all compute lanes (``simulate(..., cores=...)``), not as a factor on the result.

Data parallelism is DDP (bucketed all-reduces overlapping backward) and simulated as such;
DDP runs with ``broadcast_buffers=False``, since the simulator, like tidal's executors,
syncs gradients only (DDP's default broadcast of BatchNorm buffers before every forward
cost resnet50_small about 10 ms a step here). The
burst plan is hand-written (the first half of the layers on all ranks, the second half on half of
them: the same plan on every run) or, with ``--plan planner``, the burst_parallel planner's for
this profile and link (which on this CPU often puts every layer on one rank); it is run through
``tidal.compile(..., passes=[BurstParallel(plan=...)])`` and ``Compiled.step`` and simulated as
the burst-parallel program (``runtime.programs.burst``) runs it
(``sim.programs.burst_execution``). CPU numbers only;
timings are noisy on a shared machine: every step time (one-process and multi-rank alike)
is the minimum over ``--steps`` steps by default (``--stat median`` for the median); the
multi-rank time is the median over ranks. The whole comparison (link fits, profiles,
calibration, measured runs) is repeated ``--rounds`` times (default 3, about 4 minutes each) and
each row reports the median over rounds of its prediction and of its measurement: the gloo link
fit alone moves a burst plan's prediction by about 10 % from one round to the next.

    python benchmarks/sim_validation.py [--e2e-models vgg16_small,resnet50_small]
                                        [--global-batch 32]
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tidal  # noqa: E402
from examples.models import ZOO  # noqa: E402
from tidal.ir import layer_graph  # noqa: E402
from tidal.ir.profiler import (StepTime, calibrate_profile, profile_layers,  # noqa: E402
                               training_step_samples)
from tidal.passes.burst_parallel import BurstParallel, build_problem  # noqa: E402
from tidal.passes.burst_planner import plan_burst, plan_from_counts  # noqa: E402
from tidal.runtime.distributed import spawn  # noqa: E402
from tidal.runtime.comm.link_fit import measure_ring_link  # noqa: E402
from tidal.sim.programs import (burst_execution, data_parallel, layer_times,  # noqa: E402
                                output_bytes, summarize)

STATS = {"median": statistics.median, "min": min}


def _link_worker(rank: int, size: int):
    return measure_ring_link()


def _timed(step, steps: int, stat) -> float:
    import torch.distributed as dist

    times = []
    for i in range(steps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return STATS[stat](times) * 1e6


def _calib_worker(rank: int, size: int, name: str, batches, steps: int):
    """This rank's local training-step samples (no communication) per batch: every process
    starts each step at a barrier, as the ranks of a synchronous step do."""
    import torch.distributed as dist

    model = ZOO[name]()
    gm = tidal.compile(model, model.example_inputs(max(batches))).graph_module
    return {b: training_step_samples(gm, model.example_inputs(b), model.example_targets(b),
                                     model.default_loss, repeats=steps,
                                     before_each=dist.barrier)
            for b in batches}


def _step_times(name: str, batches, steps: int, stat: str, processes: int) -> dict:
    """Per batch, the (fwd+bwd, update) step time of ``processes`` processes running the local
    step at the same time, step by step: per step the slowest process (a synchronous step
    waits for its slowest rank), then ``stat`` over steps. The straggler is taken per step,
    not from each process's own best: on a noisy machine the ranks are rarely fast together."""
    ranks = spawn(_calib_worker, processes, name, batches, steps, timeout_s=900)
    out = {}
    for b in batches:
        fb = [max(r[b][0][i] for r in ranks) for i in range(steps)]
        up = [max(r[b][1][i] for r in ranks) for i in range(steps)]
        out[b] = StepTime(STATS[stat](fb), STATS[stat](up))
    return out


def _measure_worker(rank: int, size: int, name: str, global_batch: int, steps: int, cluster,
                    plan, stat: str) -> tuple[float, float]:
    """Step time (us, ``stat`` over ``steps``) of DDP data parallelism and of ``plan`` on this
    rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = ZOO[name]()
    inputs, targets = model.example_inputs(global_batch), model.example_targets(global_batch)
    shard = global_batch // size
    sl = slice(rank * shard, (rank + 1) * shard)
    # broadcast_buffers=False: the simulator (like tidal's executors) syncs gradients only;
    # DDP's default re-broadcast of buffers before every forward is not modelled
    ddp = DDP(tidal.compile(model, tuple(x[sl] for x in inputs)).graph_module,
              broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def dp_step():
        opt.zero_grad()
        model.default_loss(ddp(*(x[sl] for x in inputs)), targets[sl]).backward()
        opt.step()

    dp = _timed(dp_step, steps, stat)
    torch.manual_seed(0)
    model = ZOO[name]()
    c = tidal.compile(model, inputs, passes=[BurstParallel(plan=plan)], cluster=cluster,
                      loss_fn=model.default_loss,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    burst = _timed(lambda: c.step(inputs, targets), steps, stat)
    return dp, burst


def _half_plan(problem, world: int, amp_limit: float):
    """Hand-written burst plan: the first half of the layers (in layer order) on all ranks, the
    second half on half of them."""
    n = len(problem.names)
    counts = [world if i < n // 2 else world // 2 for i in range(n)]
    return plan_from_counts(problem, counts, amp_limit=amp_limit, algorithm="hand-written")


def _runs(plan) -> str:
    """The plan's GPU counts in layer order, run-length encoded: ``20x2 20x1`` is 20 layers on
    2 ranks, then 20 on 1."""
    out: list[list[int]] = []
    for l in plan.layers:
        if out and out[-1][1] == l.gpus:
            out[-1][0] += 1
        else:
            out.append([1, l.gpus])
    text = " ".join(f"{n}x{g}" for n, g in out)
    return text if len(text) <= 30 else text[:27] + "..."


def _round(args, cores: int, worlds) -> list[tuple[str, int, str, float, float]]:
    """One independent round on each world size of ``worlds``: link fits, profiles and
    calibration, then the measured runs; rows of (model, ranks, plan label, predicted us,
    measured us)."""
    gb = args.global_batch
    links = {w: spawn(_link_worker, w)[0] for w in worlds}
    for w, link in links.items():
        print(f"gloo link fitted on {w} ranks: latency {link.latency_us:.1f} us, "
              f"{link.bandwidth_gbps:.2f} Gb/s")
    rows = []
    for name in args.e2e_models.split(","):
        model = ZOO[name]()
        inputs = model.example_inputs(gb)
        gm = tidal.compile(model, inputs).graph_module
        batches = sorted({-(-gb // g) for g in (1,) + worlds})
        prof = profile_layers(gm, inputs, batches, repeats=5, cache_dir=tempfile.mkdtemp(),
                              progress=False)
        processes = min(cores, max(worlds)) if args.calibrate == "cores" else 1
        steps = _step_times(name, batches, args.steps, args.stat, processes)
        for b in batches:
            prof = calibrate_profile(prof, gm, b, steps[b].fwd_bwd_us)
        print(f"{name}: local step on {processes} busy core(s) (fwd+bwd / optimizer) " + ", ".join(
            f"b={b}: {s.fwd_bwd_us / 1e3:.1f}/{s.update_us / 1e3:.1f} ms"
            for b, s in steps.items()))
        lg = layer_graph.build(gm)
        preds = {n: list(lg.predecessors(n)) for n in lg.nodes}
        update = steps[gb].update_us
        for w in worlds:
            link = links[w]
            cluster = tidal.Cluster(gpus=w, bandwidth_gbps=link.bandwidth_gbps,
                                    latency_us=link.latency_us, profile=prof)
            times = lambda b: layer_times(gm, cluster, b)  # noqa: E731
            dp_sim = summarize(data_parallel(times, w, gb, cluster, update_us=update), w, gb,
                               cores=cores).iteration_us
            problem = build_problem(gm, cluster, gb, sync="paper")  # as the README figures
            plan = plan_burst(problem, args.amp_limit) if args.plan == "planner" else None
            if plan is None or plan.is_data_parallel:
                plan = _half_plan(problem, w, args.amp_limit)
            program = burst_execution(plan, preds, times, cluster, output_bytes(gm), update)
            bp_sim = summarize(program, w, gb, cores=cores).iteration_us
            measured = spawn(_measure_worker, w, name, gb, args.steps, cluster, plan,
                             args.stat, timeout_s=900)
            dp_meas = statistics.median(m[0] for m in measured)
            bp_meas = statistics.median(m[1] for m in measured)
            rows.append((name, w, "data parallel", dp_sim, dp_meas))
            rows.append((name, w, f"burst {plan.algorithm} [{_runs(plan)}]", bp_sim, bp_meas))
    return rows


def end_to_end_rows(args, cores: int, worlds) -> list[tuple[str, int, str, float, float]]:
    """``args.rounds`` independent rounds (:func:`_round`; ``args``: the command line's
    ``e2e_models``, ``global_batch``, ``steps``, ``stat``, ``calibrate``, ``amp_limit``,
    ``plan``): per row (model, ranks, plan label), the median over rounds of its prediction
    and of its measurement (us)."""
    rounds = []
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"end-to-end round {r + 1} of {args.rounds}", flush=True)
        rounds.append(_round(args, cores, worlds))
        if args.rounds > 1:
            errs = [abs(p - m) / m for *_, p, m in rounds[-1]]
            print(f"end-to-end round {r + 1}: median absolute error "
                  f"{statistics.median(errs):.1%}", flush=True)
    return [(name, w, label, statistics.median(rd[i][3] for rd in rounds),
             statistics.median(rd[i][4] for rd in rounds))
            for i, (name, w, label, _, _) in enumerate(rounds[-1])]


def add_arguments(parser) -> None:
    """The end-to-end rows' options on ``parser``."""
    parser.add_argument("--e2e-models", default="vgg16_small,resnet50_small",
                        help="models of examples.models.ZOO for the end-to-end rows (data "
                             "parallel as DDP, a burst plan through tidal); empty: none")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stat", choices=tuple(STATS), default="min",
                        help="estimator of every end-to-end step time, one-process calibration "
                             "and multi-rank runs alike (default min: least disturbed by other "
                             "processes on a shared machine)")
    parser.add_argument("--calibrate", choices=("cores", "one"), default="cores",
                        help="time the one-rank step for calibration with one process per core "
                             "at once, slowest counts (default), or on one process alone")
    parser.add_argument("--rounds", type=int, default=3,
                        help="independent end-to-end rounds (link fits, profiles, calibration "
                             "and measured runs each time); each row reports the median over "
                             "rounds of its prediction and of its measurement (default 3)")
    parser.add_argument("--amp-limit", type=float, default=2.0)
    parser.add_argument("--plan", choices=("half", "planner"), default="half",
                        help="burst plan: hand-written, the second half of the layers on half "
                             "the ranks (default, the same plan on every run), or the planner's "
                             "for the measured profile and link (the half plan when it keeps "
                             "data parallelism)")

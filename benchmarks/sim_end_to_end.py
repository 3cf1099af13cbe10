"""End-to-end rows of ``benchmarks/sim_validation.py``: the simulator, given the profiler's
calibrated durations, against the measured step of data parallelism and a burst plan on gloo
ranks.

What is measured: each run's step as the period of a training loop (``CHAIN`` steps back to
back after one untimed step, the mean per step, the slowest rank's; a step timed after a
barrier pays the ranks' skew leaving it, up to 13 ms on 4 ranks of 2 cores, which a loop
does not pay each step). Data parallelism is DDP (``broadcast_buffers=False``: the simulator
syncs gradients only); the burst plan runs through ``tidal.compile(...,
passes=[BurstParallel(plan=...)])`` and ``Compiled.step``.

Inputs of the prediction, none read from the steps being predicted:

* a per-layer CPU profile (tidal's profiler, 1 thread) at the per-rank batches the plans use,
  calibrated in context: per batch, the profile is scaled so that its layers add up to a whole
  forward + backward step (``calibrate_profile``), timed on the ranks of the run itself, every
  rank computing at once with no communication, round by round *interleaved* with the measured
  steps (one job, :func:`_interleaved_worker`; timed minutes apart in jobs of their own, the
  same step moved by 30 % on this shared 2-core machine). Per round the slowest rank's step
  counts: a synchronous step waits for it. The calibration holds the sharing of the cores by
  the ranks, so no processor sharing is simulated on top. The data-parallel rows are
  calibrated on DDP's own step with its communication cut (a no-op communication hook: its
  reducer's host work, 1-4 ms a step here, is the executor's computation); the burst rows on
  the plain module's step;
* three gloo ring links (latency, bandwidth: ``runtime.comm.link_fit.fit_ring_link``)
  fitted to all-reduces of two sizes timed in the same rounds: issued *after* the local step,
  from the last rank's issue to the last end, in a loop of step and all-reduce (``loop``:
  each all-reduce but the last, followed by the next step, as a loop pays the sync that ends
  its step: the ranks that leave it first compute beside the ranks still in it; ``after``:
  the last, followed by nothing); and issued *beside* it (from each rank's own issue: a
  synchronisation point inside the step's computation, sharing the cores with it and waiting
  for the ranks still computing; on this CPU several times the others). The engine gives
  each link piece the beside link's duration while computation remains in the step and the
  after-computation one after it (``sim.engine.simulate(link_load=)``,
  ``sim.programs.link_load``): for DDP the loop's (its bucket all-reduce ends its step), for
  the burst plan the ``after`` one (its collectives come before the loss all-reduce that ends
  ``Compiled.step``, whose loop cost is in the host time outside the pieces below). With the
  ``after`` link alone, DDP was under-predicted by 6-10 % on average over four runs. The plan
  itself is made for a link fitted on idle ranks before (``measure_ring_link``), then costed
  with these;
* two host terms of tidal's runtime calibrated on the composition runs of the burst kind
  (other models and batches: ``sim_validation.burst_host_us``): the dispatch per runtime
  piece and ``Compiled.step``'s host time outside its pieces (binding the batch, its checks),
  added to the step.

Per round the estimator over ``--steps`` rounds (``--stat``, default median). Each row is
printed with where the prediction puts rank 0's time (compute segments, transfers,
collectives, the optimizer step; the bounds with every link after the computation and every
link beside it), and the measured burst step's own trace summed the same way. The burst plan
is hand-written (the first half of the layers on all ranks, the second half on half of them:
the same plan on every run) or, with ``--plan planner``, the burst_parallel planner's for
this profile and link (which on this CPU often puts every layer on one rank), simulated by
the cluster simulator's model of the burst-parallel program
(``sim.programs.burst_execution``). CPU numbers only. The whole comparison is repeated
``--rounds`` times (default 3) and each row reports the median over rounds of its prediction
and of its measurement.

    python benchmarks/sim_validation.py [--e2e-models vgg16_small,resnet50_small]
                                        [--global-batch 32]
"""
from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tidal  # noqa: E402
from examples.models import ZOO  # noqa: E402
from tidal.ir import layer_graph  # noqa: E402
from tidal.ir.profiler import StepTime, calibrate_profile, profile_layers  # noqa: E402
from tidal.passes.burst_parallel import BurstParallel, build_problem  # noqa: E402
from tidal.passes.burst_planner import plan_burst, plan_from_counts  # noqa: E402
from tidal.runtime.distributed import spawn  # noqa: E402
from tidal.runtime.comm.link_fit import (DEFAULT_SIZES, RingLink,  # noqa: E402
                                         fit_ring_link, measure_ring_link)
from tidal.sim.programs import (burst_execution, data_parallel,  # noqa: E402
                                layer_buffer_bytes, layer_times, link_load, output_bytes,
                                summarize)

STATS = {"median": statistics.median, "min": min}
CHAIN = 3
"""Steps run back to back per measured timing, after an untimed one (the mean per step): the
period of a training loop, not one step after a barrier (see the module docstring)."""


def _link_worker(rank: int, size: int):
    return measure_ring_link()


def _timed_step(model, net, opt, x, y) -> Callable[[], tuple[float, float]]:
    """A training step of ``net`` on (``x``, ``y``) with ``opt`` as a function returning
    its (fwd+bwd, update) us."""
    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        model.default_loss(net(*x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        return (t1 - t0) * 1e6, (time.perf_counter() - t1) * 1e6
    return step


def _local_steps(name: str, batches) -> dict:
    """Per batch of ``batches``: the model's local training step (no communication; a copy
    of its graph module with its own SGD) as a function returning its (fwd+bwd, update) us."""
    model = ZOO[name]()
    gm = tidal.compile(model, model.example_inputs(max(batches))).graph_module
    out = {}
    for b in batches:
        work = copy.deepcopy(gm)
        out[b] = _timed_step(model, work, torch.optim.SGD(work.parameters(), lr=0.01),
                             model.example_inputs(b), model.example_targets(b))
    return out


def _no_communication(state, bucket):
    """A DDP communication hook that communicates nothing (the bucket as it is)."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _ddp_local_step(name: str, batch: int) -> Callable[[], tuple[float, float]]:
    """DDP's step at ``batch`` with its communication cut (:func:`_no_communication`): the
    executor's own local step, its reducer's host work included (on this CPU 1-4 ms per
    step over the plain module's), as a function returning (fwd+bwd, update) us. Collective
    (DDP's construction)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = ZOO[name]()
    x = model.example_inputs(batch)
    net = DDP(tidal.compile(model, x).graph_module, broadcast_buffers=False)
    net.register_comm_hook(None, _no_communication)
    return _timed_step(model, net, torch.optim.SGD(net.parameters(), lr=0.01), x,
                       model.example_targets(batch))


def _interleaved_worker(rank: int, size: int, name: str, global_batch: int, steps: int,
                        cluster, plan, batches) -> list[dict]:
    """This rank's rounds (``steps``, after 2 warm-up ones): in each, the local step at every
    batch of ``batches`` and DDP's step with its communication cut (the calibration: every
    rank computing at once, no communication), then ``CHAIN`` DDP steps and ``CHAIN`` steps
    of the burst ``plan`` through tidal, each timing after a barrier and one untimed step.
    Calibration and measured runs interleave round by round, so both see the same machine.
    Each round also times an all-reduce of each of ``link_fit.DEFAULT_SIZES`` issued beside
    the rank's local step (:func:`_all_reduce_beside`) and a loop of the step and one issued
    after it (:func:`_all_reduce_after`).
    Per round: ``{batch: (fwd+bwd us, update us), "ddp local": (...), "dp": us per step,
    "burst": us per step, "burst parts": {piece kind: us}, "beside <bytes>": [(issue, end)],
    "after <bytes>": [(issue, end) per step of the loop]}`` (times on the machine's clock,
    seconds)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    # torch 2.13 deprecates broadcast_buffers under a new name that 2.11 lacks: keep the old one
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
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

    torch.manual_seed(0)
    c = tidal.compile(ZOO[name](), inputs, passes=[BurstParallel(plan=plan)], cluster=cluster,
                      loss_fn=model.default_loss,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    flats = {n: torch.zeros(n // 4) for n in DEFAULT_SIZES}
    runs = {"dp": dp_step, "burst": lambda: c.step(inputs, targets)}
    local = _local_steps(name, batches)
    own = local[shard]
    local["ddp local"] = _ddp_local_step(name, shard)
    rounds = []
    for i in range(steps + 2):
        row: dict = {}
        for b, step in local.items():
            dist.barrier()
            row[b] = step()
        for what, run in runs.items():
            dist.barrier()
            run()  # the first step after the barrier pays the ranks' skew leaving it
            t0 = time.perf_counter()
            for _ in range(CHAIN):
                run()
            row[what] = (time.perf_counter() - t0) * 1e6 / CHAIN
        row["burst parts"] = _trace_parts(c.executor.last_trace)
        for n, flat in flats.items():  # an all-reduce beside this rank's local step
            dist.barrier()
            row[f"beside {n}"] = [_all_reduce_beside(flat, own)]
        for n, flat in flats.items():  # an all-reduce issued when the local step ended
            dist.barrier()
            row[f"after {n}"] = _all_reduce_after(flat, own)
        if i >= 2:
            rounds.append(row)
    return rounds


def _trace_parts(trace) -> dict[str, float]:
    """A rank's step trace summed by piece kind (us): segment, optimizer, point_to_point
    (the transfer stream), collective (the comm stream), each piece from its start to its
    end (its waits for other ranks included)."""
    kinds = {"transfer": "point_to_point", "comm": "collective"}
    out: dict[str, float] = {}
    for t in trace:
        kind = "optimizer" if t.name == "optimizer" else kinds.get(t.stream, "segment")
        out[kind] = out.get(kind, 0.0) + t.end_us - t.start_us
    return out


def _all_reduce_beside(flat: torch.Tensor, step: Callable[[], Any]) -> tuple[float, float]:
    """An all-reduce of ``flat`` issued asynchronously right before ``step`` (this rank's
    local training step) runs: when it was issued and when it ended (``time.perf_counter``,
    a clock all processes of the machine share). A collective of the step shares the cores
    with the ranks' computation, as the runtime's do (on this CPU, several times an
    all-reduce on idle ranks). Collective."""
    import torch.distributed as dist

    ended: list[float] = []
    t0 = time.perf_counter()
    work = dist.all_reduce(flat, async_op=True)
    work.get_future().then(lambda _: ended.append(time.perf_counter()))
    step()
    work.wait()
    while not ended:  # the callback runs on gloo's thread right after completion
        time.sleep(1e-5)
    return t0, ended[0]


def _all_reduce_after(flat: torch.Tensor, step: Callable[[], Any]) -> list[tuple[float, float]]:
    """A loop of ``step`` (this rank's local training step) then an all-reduce of ``flat``,
    ``CHAIN`` + 1 times from a barrier: per step, when the all-reduce was issued and when it
    ended (``time.perf_counter``, a clock all processes of the machine share). From the last
    rank's issue to the last end, the collective once the computation is over (the ranks'
    waits for the slowest are the calibrated step's: it is the slowest rank's). All but the
    last are followed by the next step, as a loop pays the sync that ends its step: the ranks
    that leave it first start their next step beside the ranks still in it (on 4 ranks of 2
    cores, a DDP loop's ends 3 ms apart, its all-reduce 12 ms against 7 ms on idle cores);
    the last by nothing (the caller's barrier). Collective."""
    import torch.distributed as dist

    out = []
    for _ in range(CHAIN + 1):
        step()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        out.append((t0, time.perf_counter()))
    return out


def _over_rounds(ranks: list[list[dict]], stat: str
                 ) -> tuple[dict, float, float, dict[str, RingLink], dict]:
    """The interleaved job's rounds of every rank: per batch the calibrated ``StepTime``, the
    DDP and burst step times (us), three ring links and the measured burst step's parts. The
    links: fitted to the all-reduces issued after the local step, from the last rank's issue to
    the last end (``after``: the loop's last, followed by nothing but a barrier; ``loop``: the
    others, each the sync that ends a step, followed by the next) and to those issued beside it
    (``beside``: the link beside computation). Per round the slowest rank counts (a synchronous
    step waits for it), then ``stat`` over rounds."""
    rounds = range(len(ranks[0]))
    per = lambda key, k=None: [max(r[i][key] if k is None else r[i][key][k]  # noqa: E731
                                   for r in ranks) for i in rounds]
    batches = [k for k in ranks[0][0] if isinstance(k, int)] + ["ddp local"]
    steps = {b: StepTime(STATS[stat](per(b, 0)), STATS[stat](per(b, 1))) for b in batches}
    def fit(key: str, issue, of: slice = slice(None)) -> RingLink:
        """The link fitted to the all-reduces ``key`` (per round and rank a list of (issue,
        end) pairs: the mean over those ``of``), each from ``issue`` (of the ranks' issue
        times) to its last end."""
        def took_us(i: int, n: int) -> float:
            loops = [r[i][f"{key} {n}"][of] for r in ranks]
            return statistics.fmean(
                max(q[j][1] for q in loops) - issue(q[j][0] for q in loops)
                for j in range(len(loops[0]))) * 1e6
        return fit_ring_link(len(ranks), DEFAULT_SIZES, [STATS[stat](
            [took_us(i, n) for i in rounds]) for n in DEFAULT_SIZES])

    # after the step: from the last issue (the calibrated step is the slowest rank's already),
    # the loop's last (nothing after it but a barrier) and the others (each followed by the
    # next step: a loop's end-of-step sync);
    # inside it: from each rank's own issue (a rank's wait for the others is part of the cost
    # of a synchronisation point inside the step's computation)
    links = {"after": fit("after", max, slice(-1, None)),
             "loop": fit("after", max, slice(None, -1)),
             "beside": fit("beside", min)}
    parts = {k: statistics.median(r["burst parts"].get(k, 0.0) for r in ranks[0])
             for k in ranks[0][0]["burst parts"]}
    return steps, STATS[stat](per("dp")), STATS[stat](per("burst")), links, parts


def _parts(program, rank: int) -> str:
    """The summed durations of ``rank``'s pieces of a placed program by kind (compute, the
    optimizer step, transfers, collectives), in ms: where a prediction puts its time."""
    sums: dict[str, float] = {}
    for p in program.pieces:
        if rank in p.ranks:
            sums[p.kind] = sums.get(p.kind, 0.0) + p.duration_us
    return ", ".join(f"{k} {v / 1e3:.1f}" for k, v in sums.items()) + " ms"


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


def _cluster(world: int, fit: RingLink, profile) -> "tidal.Cluster":
    """``world`` ranks joined by ``fit``'s link, computing as ``profile`` says."""
    return tidal.Cluster(gpus=world, bandwidth_gbps=fit.bandwidth_gbps,
                         latency_us=fit.latency_us, profile=profile)


def _dp_program(gm, cal, global_batch: int, update_us: float):
    """DDP's step as a placed Program on ``cal`` (its ranks, link and calibrated profile:
    the calibration ran with every rank computing at once, so its durations hold the
    sharing of the cores; no processor sharing on top)."""
    return data_parallel(lambda b: layer_times(gm, cal, b), cal.gpus, global_batch, cal,
                         update_us=update_us)


def _burst_program(gm, cal, global_batch: int, plan, amp_limit: float, preds,
                   update_us: float, dispatch_us: float):
    """``plan``'s GPU counts costed on ``cal`` (its link and calibrated profile), and the
    burst step's placed Program with ``dispatch_us`` of host dispatch per runtime piece:
    (costed plan, program)."""
    costed = plan_from_counts(build_problem(gm, cal, global_batch, sync="paper"),
                              [l.gpus for l in plan.layers], amp_limit=amp_limit,
                              algorithm=plan.algorithm)
    return costed, burst_execution(costed, preds, lambda b: layer_times(gm, cal, b), cal,
                                   output_bytes(gm), update_us,
                                   buffer_bytes=layer_buffer_bytes(gm), dispatch_us=dispatch_us)


def _round(args, cores: int, worlds, dispatch_us: Mapping[int, float],
           outside_us: Mapping[int, float]) -> list[tuple[str, int, str, float, float]]:
    """One independent round on each world size of ``worlds``: link fits and profiles, then
    per model and world size one job that calibrates the profile and measures DDP and the
    burst plan interleaved (:func:`_interleaved_worker`); rows of (model, ranks, plan label,
    predicted us, measured us)."""
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
        profile = profile_layers(gm, inputs, batches, repeats=5, cache_dir=tempfile.mkdtemp(),
                                 progress=False)
        lg = layer_graph.build(gm)
        preds = {n: list(lg.predecessors(n)) for n in lg.nodes}
        for w in worlds:
            link = links[w]
            cluster = _cluster(w, link, profile)
            problem = build_problem(gm, cluster, gb, sync="paper")  # as the README figures
            plan = plan_burst(problem, args.amp_limit) if args.plan == "planner" else None
            if plan is None or plan.is_data_parallel:
                plan = _half_plan(problem, w, args.amp_limit)
            used = sorted({-(-gb // g) for g in (w,) + tuple(l.gpus for l in plan.layers)})
            steps, dp_meas, bp_meas, fits, measured_parts = _over_rounds(spawn(
                _interleaved_worker, w, name, gb, args.steps, cluster, plan, used,
                timeout_s=900), args.stat)
            prof = profile
            for b in used:
                prof = calibrate_profile(prof, gm, b, steps[b].fwd_bwd_us)
            ddp = steps["ddp local"]
            prof_ddp = calibrate_profile(profile, gm, gb // w, ddp.fwd_bwd_us)
            print(f"{name} on {w} ranks, in context: local step, every rank at once "
                  "(fwd+bwd / optimizer) " + ", ".join(
                      f"b={b}: {s.fwd_bwd_us / 1e3:.1f}/{s.update_us / 1e3:.1f} ms"
                      for b, s in steps.items())
                  + "; links: " + ", ".join(
                      f"{k} {f.latency_us:.1f} us, {f.bandwidth_gbps:.2f} Gb/s"
                      for k, f in fits.items()))
            update = steps[gb // w].update_us

            # after the computation, DDP's collective is the sync that ends its step: the
            # loop's link; the burst plan's collectives come before the loss all-reduce that
            # ends tidal's step (its loop cost is in ``outside_us``, measured on tidal's own
            # loops): the link of an all-reduce followed by nothing
            dp = {k: _dp_program(gm, _cluster(w, fit, prof_ddp), gb, ddp.update_us)
                  for k, fit in (("idle", fits["loop"]), ("busy", fits["beside"]))}
            bp = {k: _burst_program(gm, _cluster(w, fit, prof), gb, plan, args.amp_limit,
                                    preds, update, dispatch_us.get(w, 0.0))
                  for k, fit in (("idle", fits["after"]), ("busy", fits["beside"]))}
            plan = bp["idle"][0]
            programs = {"data parallel": dp, "burst": {k: v[1] for k, v in bp.items()}}
            sims = {label: summarize(p["idle"], w, gb,
                                     link_load=link_load(p["idle"], p["busy"])).iteration_us
                    for label, p in programs.items()}
            sims["burst"] += outside_us.get(w, 0.0)  # serial, before the pieces
            for label, p in programs.items():
                print(f"  predicted {label} on {w} ranks: {sims[label] / 1e3:.1f} ms (every "
                      "link after computation "
                      f"{summarize(p['idle'], w, gb).iteration_us / 1e3:.1f}, every link beside "
                      f"computation {summarize(p['busy'], w, gb).iteration_us / 1e3:.1f}); "
                      "rank 0's pieces, links after computation: " + _parts(p["idle"], 0)
                      + (f" (with {dispatch_us.get(w, 0.0) / 1e3:.2f} ms of host dispatch per "
                         f"runtime piece; {outside_us.get(w, 0.0) / 1e3:.2f} ms of host time "
                         "outside the pieces)" if label == "burst" else ""))
            print(f"  measured burst on {w} ranks, rank 0's pieces (median over rounds; "
                  "waits for other ranks included): " + ", ".join(
                      f"{k} {v / 1e3:.1f}" for k, v in measured_parts.items()) + " ms")
            rows.append((name, w, "data parallel", sims["data parallel"], dp_meas))
            rows.append((name, w, f"burst {plan.algorithm} [{_runs(plan)}]", sims["burst"],
                         bp_meas))
    return rows


def end_to_end_rows(args, cores: int, worlds, dispatch_us: Optional[Mapping[int, float]] = None,
                    outside_us: Optional[Mapping[int, float]] = None
                    ) -> list[tuple[str, int, str, float, float]]:
    """``args.rounds`` independent rounds (:func:`_round`; ``args``: the command line's
    ``e2e_models``, ``global_batch``, ``steps``, ``stat``, ``amp_limit``, ``plan``): per row
    (model, ranks, plan label), the median over rounds of its prediction and of its
    measurement (us). ``dispatch_us``, ``outside_us``: per world size, the host's dispatch
    per piece of a burst run and ``Compiled.step``'s host time outside its pieces
    (calibrated on other runs; none: 0)."""
    rounds = []
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"end-to-end round {r + 1} of {args.rounds}", flush=True)
        rounds.append(_round(args, cores, worlds, dispatch_us or {}, outside_us or {}))
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
    parser.add_argument("--stat", choices=tuple(STATS), default="median",
                        help="estimator over the interleaved rounds of every end-to-end time, "
                             "calibration, link and measured runs alike (default median)")
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

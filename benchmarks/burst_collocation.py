"""BP+Col on real ranks: a background training job in the idle time a burst plan leaves.

DeepPool's point (§3, Fig. 11): burst parallelism runs some layers on fewer GPUs, the others
sit idle meanwhile, and a low-priority background job fills that idle time while the
foreground keeps its speed. Here, on 2 gloo ranks of this CPU machine (1 thread each):

- foreground: an MLP whose burst plan (written by hand) runs the first and last layers on both
  ranks and a wide middle block on rank 0 only, so rank 1 waits in the transfer that brings its
  rows back while rank 0 computes it (forward and backward). Each scatter/gather is a piece of
  its own on the ``transfer`` stream, so the scheduler knows the device is idle meanwhile;
- background: a second small model training on every rank (its own data, no collectives),
  submitted beside the foreground with ``Compiled.train_scheduled(..., background=job)`` (the scheduler's
  ``idle_only`` policy: a background piece only when it is predicted to end before the
  foreground's next compute piece can start). Its batch is chosen per rank from the idle spans
  of the foreground's step alone (``tidal.sim.collocation.best_background_batch``: the batch
  whose steps, each inside one span, turn the most idle time into samples).

Printed per rank: foreground ms/step alone and with the background (ratio), the chosen
background batch and its samples/s, the foreground's idle rank-time (the step minus its compute
pieces, alone) and the share of it the background turned into work (its compute pieces' time
over that idle time), beside the simulator's prediction for the same program objects (the
measured piece durations, the spans packed with the same background steps). CPU figures, not
GPU ones.

    python benchmarks/burst_collocation.py [--steps 10] [--rounds 3] [--width 2048] [--batch 256]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402



def _foreground(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def _background() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def _plan(model: torch.nn.Module, x: torch.Tensor, cluster) -> str:
    """Both ranks for the first and last layers, rank 0 alone for the wide middle."""
    import tidal
    from tidal.ir import cost
    from tidal.passes.burst_parallel import build_problem
    from tidal.passes.burst_planner import plan_from_counts

    gm = tidal.trace(model, (x,))
    cost.annotate(gm, (x,))
    problem = build_problem(gm, cluster, x.shape[0])
    middle = {"_2", "_3", "_4", "_5", "_6"}
    counts = {n: 1 if n in middle else 2 for n in problem.names}
    return plan_from_counts(problem, counts).to_json()


DELAY_BUDGET = 0.10
"""The share of the foreground's step time its background may cost it, at worst (the goal:
<= 10 %)."""
MIN_SHARE = 0.25
"""A rank whose idle spans a background step would fill less than this share of runs none (its
spans are short waits on the critical path: risk without gain)."""
BG_BATCHES = (64, 128, 256, 512, 1024, 2048, 4096)


def _bg_step_us(batch: int) -> tuple[float, float]:
    """One background step alone at ``batch`` (median µs, ``Compiled.step``) and the dispatch
    overhead per iteration of its job on a scheduler (median iteration minus the step)."""
    import tidal
    from tidal.runtime.backend import backend_for
    from tidal.runtime.scheduler import Runtime

    g = torch.Generator().manual_seed(3)
    data = (torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g))
    bg = tidal.compile(_background(), (data[0],), loss_fn=F.cross_entropy,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    times = []
    for _ in range(15):
        t = time.perf_counter()
        bg.step(*data)
        times.append((time.perf_counter() - t) * 1e6)
    step = statistics.median(times[3:])
    with Runtime(backend=backend_for(torch.device("cpu"), slots=1)) as runtime:
        runtime.submit(bg.job(lambda i: data, iterations=7, name="bg"), priority="low")
        stats = runtime.run(until="all")
    return step, max(0.0, statistics.median(stats["bg"].iteration_us[2:]) - step)


def _run(rank: int, size: int, steps: int, width: int, batch: int, rounds: int) -> dict:
    import torch.distributed as dist

    import tidal
    from tidal.passes.burst_parallel import BurstParallel
    from tidal.sim.collocation import best_background_batch, job_idle_spans

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(4)]
    batches = (lambda i: data[i % len(data)])
    cluster = tidal.Cluster(gpus=size)
    model = _foreground(width)
    plan = _plan(model, data[0][0], cluster)

    fg = tidal.compile(_foreground(width), (data[0][0],), passes=[BurstParallel(plan=plan)],
                       cluster=cluster, loss_fn=F.cross_entropy,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    fg.train_scheduled(batches, 3)  # warm-up: groups, layouts, isolated piece times
    dist.barrier()

    # the background batch, from the idle spans of steps alone (between compute pieces)
    stats = fg.train_scheduled(batches, steps)["train"]
    spans = job_idle_spans(fg.train_trace, "train")
    timed = {b: _bg_step_us(b) for b in BG_BATCHES}
    overhead = statistics.median(o for _, o in timed.values())
    # a background step may delay the foreground at most once per span it runs in: together
    # at most DELAY_BUDGET of a foreground step
    delay = DELAY_BUDGET * sum(stats.iteration_us)
    bg_batch, _ = best_background_batch(spans, {b: t for b, (t, _) in timed.items()}, overhead,
                                        delay, MIN_SHARE)
    bg_data = (torch.randn(max(bg_batch, 1), 64, generator=g),
               torch.randint(0, 10, (max(bg_batch, 1),), generator=g))
    background = tidal.compile(_background(), (bg_data[0],), loss_fn=F.cross_entropy,
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))

    # alone and with the background, alternating (the host's noise hits both alike)
    alone_us, with_us, idle, wait, bg_busy, bg_iters = [], [], 0.0, 0.0, 0.0, 0
    for _ in range(rounds):
        dist.barrier()
        stats = fg.train_scheduled(batches, steps)["train"]
        alone_us += stats.iteration_us
        idle += max(0.0, sum(stats.iteration_us) - stats.busy_us)
        wait += _waiting_us(fg.train_trace, "train")
        dist.barrier()
        job = background.job(lambda i: bg_data, name="extra") if bg_batch else None
        stats = fg.train_scheduled(batches, steps, background=job)
        with_us += stats["train"].iteration_us
        if bg_batch:
            bg_busy += stats["extra"].busy_us
            bg_iters += stats["extra"].iterations
    fg.step(*batches(0))  # one more step: the program and piece times for the simulator
    n = rounds * steps
    return {"rank": rank, "alone_ms": statistics.median(alone_us) / 1e3,
            "with_ms": statistics.median(with_us) / 1e3, "idle_us": idle / n,
            "wait_us": wait / n, "bg_busy_us": bg_busy / n,
            "bg_batch": bg_batch, "bg_step_us": timed[bg_batch][0] if bg_batch else 0.0,
            "overhead_us": overhead,
            "bg_samples_s": bg_iters * bg_batch / (sum(with_us) * 1e-6),
            "reclaimed": bg_busy / idle if idle else 0.0,
            "program": fg.executor.last_program, "trace": fg.executor.last_trace}


def _waiting_us(records, job: str) -> float:
    """The time ``job``'s device is idle while one of its transfer or collective pieces runs
    (the idle spans the program exposes), summed over the iterations in ``records``."""
    from tidal.sim.collocation import idle_spans

    total = 0.0
    for r in records:
        if r.job != job or r.kind in ("compute", "host"):  # host: the step's loss
            continue
        device = [(d.start_us, d.end_us) for d in records if d.job == job and
                  d.iteration == r.iteration and d.kind == "compute" and
                  d.end_us > r.start_us and d.start_us < r.end_us]
        total += sum(idle_spans(device, r.start_us, r.end_us)) if device else \
            r.end_us - r.start_us
    return total


def _predicted(results: list[dict]) -> dict[int, tuple[float, float]]:
    """Per rank, the simulator's idle share of the step and the share of that idle time the
    rank's background steps fill (the same programs, with the durations measured in the last
    step's traces; each background step plus its overhead inside one idle span)."""
    from tidal.sim.collocation import idle_spans, pieces_that_fit
    from tidal.sim.engine import is_compute_lane, simulate
    from tidal.sim.programs import join_ranks, measured_durations

    programs = {r["rank"]: r["program"] for r in results}
    traces = {r["rank"]: r["trace"] for r in results}
    intervals = simulate(join_ranks(programs, measured_durations(traces)))
    t0, t1 = min(i.start_us for i in intervals), max(i.end_us for i in intervals)
    out = {}
    for r in results:
        busy = [(i.start_us, i.end_us) for i in intervals
                if i.gpu == r["rank"] and is_compute_lane(i.lane)]
        spans = idle_spans(busy, t0, t1)
        idle = sum(spans)
        filled = pieces_that_fit(spans, r["bg_step_us"] + r["overhead_us"]) * r["bg_step_us"] \
            if r["bg_batch"] else 0.0
        out[r["rank"]] = (idle / (t1 - t0) if t1 > t0 else 0.0, filled / idle if idle else 0.0)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternations of --steps steps alone and with the background")
    args = parser.parse_args(argv)
    from tidal.runtime.distributed import spawn

    results = spawn(_run, 2, args.steps, args.width, args.batch, args.rounds,
                    timeout_s=900)
    predicted = _predicted(results)
    print("BP+Col on 2 gloo ranks (CPU, 1 thread per rank; not a GPU figure)")
    for r in results:
        idle_share, filled = predicted[r["rank"]]
        print(f"  rank {r['rank']}: foreground {r['alone_ms']:.2f} ms/step alone, "
              f"{r['with_ms']:.2f} with background (x{r['with_ms'] / r['alone_ms']:.3f}); "
              f"background batch {r['bg_batch']} ({r['bg_step_us'] / 1e3:.2f} ms/step), "
              f"{r['bg_samples_s']:.0f} samples/s; idle {r['idle_us'] / 1e3:.2f} ms/step, "
              f"reclaimed {100 * r['reclaimed']:.0f} % (simulator: idle "
              f"{100 * idle_share:.0f} % of the step, {100 * filled:.0f} % reclaimable)")
    idle = sum(r["idle_us"] for r in results)
    waiting = sum(r["wait_us"] for r in results)
    busy = sum(r["bg_busy_us"] for r in results)
    slow = max(r["with_ms"] / r["alone_ms"] for r in results)
    print(f"  both ranks: the background's work is {100 * busy / idle:.0f} % of the idle "
          f"rank-time ({idle / 1e3:.2f} ms/step between compute pieces) and "
          f"{100 * busy / waiting:.0f} % of the time ranks wait on transfers and collectives "
          f"({waiting / 1e3:.2f} ms/step; goal >= 70 %); foreground x{slow:.3f} of alone at "
          f"worst (goal <= 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

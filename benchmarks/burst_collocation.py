"""BP+Col on real ranks: a background training job in the idle time a burst plan leaves.

DeepPool's point (§3, Fig. 11): burst parallelism runs some layers on fewer GPUs, the others
sit idle meanwhile, and a low-priority background job fills that idle time while the
foreground keeps its speed. Here, on 2 gloo ranks of this CPU machine (1 thread each):

- foreground: an MLP whose burst plan (written by hand) runs the first and last layers on both
  ranks and a wide middle block on rank 0 only, so rank 1 waits while rank 0 computes it;
- background: a second small model training on every rank (its own data, no collectives),
  submitted beside the foreground with ``Compiled.train(..., background=job)`` (the scheduler's
  ``idle_only`` policy: background pieces only in the foreground's idle spans).

Printed per rank: foreground ms/step alone and with the background (ratio), background
samples/s, the foreground's idle rank-time (wall minus the process's CPU time, per step, alone)
and the share of it the background turned into work (its busy time over that idle time). The
simulator's prediction of each rank's idle share for the same program objects is printed
beside it. CPU figures, not GPU ones.

    python benchmarks/burst_collocation.py [--steps 20] [--width 512]
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

BATCH = 32


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
    problem = build_problem(gm, cluster, BATCH)
    middle = {"_2", "_3", "_4", "_5", "_6"}
    counts = {n: 1 if n in middle else 2 for n in problem.names}
    return plan_from_counts(problem, counts).to_json()


def _run(rank: int, size: int, steps: int, width: int) -> dict:
    import torch.distributed as dist

    import tidal
    from tidal.passes.burst_parallel import BurstParallel

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(BATCH, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(4)]
    batches = (lambda i: data[i % len(data)])
    cluster = tidal.Cluster(gpus=size)
    model = _foreground(width)
    plan = _plan(model, data[0][0], cluster)

    def foreground():
        return tidal.compile(_foreground(width), (data[0][0],),
                             passes=[BurstParallel(plan=plan)], cluster=cluster,
                             loss_fn=F.cross_entropy,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))

    bg_data = [(torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g))]
    background = tidal.compile(_background(), (bg_data[0][0],), loss_fn=F.cross_entropy,
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))

    alone = foreground()
    alone.train(batches, 2)  # warm-up: capture, groups
    dist.barrier()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    stats = alone.train(batches, steps)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    alone_ms = statistics.median(stats["train"].iteration_us) / 1e3
    idle_us = max(wall - cpu, 0.0) * 1e6 / steps

    shared = foreground()
    shared.train(batches, 2)
    dist.barrier()
    job = background.job(lambda i: bg_data[0], name="extra")
    stats = shared.train(batches, steps, background=job)
    with_ms = statistics.median(stats["train"].iteration_us) / 1e3
    extra = stats["extra"]
    span_s = sum(stats["train"].iteration_us) * 1e-6
    shared.step(*batches(0))  # one more step alone: its program and trace for the simulator
    return {"rank": rank, "alone_ms": alone_ms, "with_ms": with_ms, "idle_us": idle_us,
            "bg_samples_s": extra.iterations * 16 / span_s if span_s else 0.0,
            "reclaimed": extra.busy_us / (idle_us * steps) if idle_us else 0.0,
            "program": shared.executor.last_program, "trace": shared.executor.last_trace}


def _predicted_idle(results: list[dict]) -> dict[int, float]:
    """Per rank, the share of the simulated step its device is idle (the same programs, with
    the durations measured in the last step's traces)."""
    from tidal.sim.engine import is_compute_lane, simulate
    from tidal.sim.programs import measured_durations, program_tasks

    programs = {r["rank"]: r["program"] for r in results}
    traces = {r["rank"]: r["trace"] for r in results}
    intervals = simulate(program_tasks(programs, measured_durations(traces)))
    span = max(i.end_us for i in intervals) - min(i.start_us for i in intervals)
    out = {}
    for rank in programs:
        busy = sum(i.end_us - i.start_us for i in intervals
                   if i.gpu == rank and is_compute_lane(i.lane))
        out[rank] = max(0.0, 1.0 - busy / span) if span else 0.0
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args(argv)
    from tidal.runtime.distributed import spawn

    results = spawn(_run, 2, args.steps, args.width, timeout_s=900)
    predicted = _predicted_idle(results)
    print("BP+Col on 2 gloo ranks (CPU, 1 thread per rank; not a GPU figure)")
    for r in results:
        print(f"  rank {r['rank']}: foreground {r['alone_ms']:.2f} ms/step alone, "
              f"{r['with_ms']:.2f} with background (x{r['with_ms'] / r['alone_ms']:.3f}); "
              f"background {r['bg_samples_s']:.0f} samples/s; idle {r['idle_us'] / 1e3:.2f} "
              f"ms/step, reclaimed {100 * r['reclaimed']:.0f} %; simulator: idle "
              f"{100 * predicted[r['rank']]:.0f} % of the step")
    return 0


if __name__ == "__main__":
    sys.exit(main())

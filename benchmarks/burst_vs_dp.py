"""Measured step time of data parallelism vs a burst-parallel plan on 4 gloo ranks (this CPU
machine), VGG-16-small, beside the planner's predictions for both.

The cluster given to the planner models this machine roughly: compute at a FLOP rate measured
with a matmul on one thread, and ``--bandwidth-gbps``/``--latency-us`` for gloo over loopback.
The burst plan is the planner's (``amp_limit``); when it falls back to data parallelism, a
hand-written burst plan (features on all ranks, classifier on one) is measured instead, so the
comparison always has two different plans. Prediction errors are printed, not hidden. CPU
numbers only; nothing here says anything about GPUs.

    python benchmarks/burst_vs_dp.py [--batch 32] [--steps 5] [--amp-limit 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import tidal  # noqa: E402
from tidal.ir import cost  # noqa: E402
from tidal.passes.burst_parallel import BurstParallel, build_problem  # noqa: E402
from tidal.passes.burst_planner import plan_burst, plan_from_counts  # noqa: E402
from tidal.runtime.distributed import spawn  # noqa: E402

RANKS = 4


def _tflops() -> float:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    return 10 * 2 * 512 ** 3 / (time.perf_counter() - t0) / 1e12


def _plans(batch: int, amp_limit: float, bw: float, lat: float, tflops: float):
    from examples.models import vgg16_small

    torch.manual_seed(0)
    model = vgg16_small()
    x = model.example_inputs(batch)
    gm = tidal.trace(model, x)
    cost.annotate(gm, x)
    cluster = tidal.Cluster(gpus=RANKS, bandwidth_gbps=bw, latency_us=lat, peak_tflops=tflops)
    problem = build_problem(gm, cluster, batch, sync="paper")  # as the README figure was taken
    dp = plan_from_counts(problem, [RANKS] * len(problem.names), amp_limit=amp_limit)
    burst = plan_burst(problem, amp_limit)
    if burst.fallback:  # measure a burst plan anyway: classifier on one rank
        first_fc = next(i for i, n in enumerate(problem.names) if "classifier" in n)
        counts = [RANKS if i < first_fc else 1 for i in range(len(problem.names))]
        burst = plan_from_counts(problem, counts, amp_limit=amp_limit, algorithm="hand-written")
    return cluster, dp, burst


def _measure(rank, size, batch, steps, cluster, plans):
    from examples.models import vgg16_small

    out = []
    for plan in plans:
        torch.manual_seed(0)
        model = vgg16_small()
        x, y = model.example_inputs(batch), model.example_targets(batch)
        c = tidal.compile(model, x, passes=[BurstParallel(plan=plan)], cluster=cluster,
                          loss_fn=model.default_loss,
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
        c.step(x, y)  # warm-up (creates subgroups)
        times = []
        for _ in range(steps):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            c.step(x, y)
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--amp-limit", type=float, default=2.0)
    ap.add_argument("--bandwidth-gbps", type=float, default=10.0)
    ap.add_argument("--latency-us", type=float, default=100.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tflops = _tflops()
    cluster, dp, burst = _plans(args.batch, args.amp_limit, args.bandwidth_gbps,
                                args.latency_us, tflops)
    dp_s, burst_s = spawn(_measure, RANKS, args.batch, args.steps, cluster, (dp, burst),
                          timeout_s=1200)[0]
    print(f"VGG-16-small, global batch {args.batch}, {RANKS} gloo ranks, "
          f"compute modelled at {tflops * 1e3:.1f} GFLOP/s, {args.bandwidth_gbps} Gb/s, "
          f"{args.latency_us} us")
    print(burst.table())
    print(f"{'plan':22s} {'measured ms':>12s} {'predicted ms':>13s} {'error':>7s}")
    for name, meas, plan in (("data parallel", dp_s, dp), (f"burst ({burst.algorithm})",
                                                           burst_s, burst)):
        pred = plan.time_us / 1e3
        print(f"{name:22s} {meas * 1e3:12.2f} {pred:13.2f} {(pred / (meas * 1e3) - 1):+7.0%}")
    print(f"measured burst/DP step time: {burst_s / dp_s:.3f}  predicted: "
          f"{burst.time_us / dp.time_us:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Simulator vs measurement: data-parallel step time on 2 and 4 gloo ranks on this machine.

For each model, the per-layer CPU profile is measured once with tidal's profiler (1 thread), the
gloo link is fitted from all-reduce timings (latency + bytes/bandwidth) for each world size, and
the simulator predicts one data-parallel iteration; the same step (DDP over gloo, SGD) is then
measured on real ranks. Ranks beyond the machine's cores share them, so the prediction is scaled by
max(1, ranks / cores) — an input to the comparison, stated here, not fitted.

    python benchmarks/sim_validation.py [--models vgg16_small,resnet50_small] [--global-batch 32]
"""
from __future__ import annotations

import argparse
import os
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
from tidal.ir.profiler import profile_layers  # noqa: E402
from tidal.runtime.distributed import spawn  # noqa: E402
from tidal.runtime.sim.programs import data_parallel, layer_times, summarize  # noqa: E402

SIZES = (1 << 12, 1 << 22)


def _allreduce_worker(rank: int, size: int, repeats: int) -> list[float]:
    import torch.distributed as dist

    out = []
    for nbytes in SIZES:
        t = torch.zeros(nbytes // 4)
        for _ in range(2):
            dist.all_reduce(t)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times) * 1e6)
    return out


def fit_link(world: int, repeats: int = 15) -> tuple[float, float]:
    """(latency_us, bytes_per_us) of a ring all-reduce fitted to gloo timings on ``world``
    local ranks, from t = 2(p-1)a + 2(p-1)/p * b/BW at two sizes."""
    small, large = spawn(_allreduce_worker, world, repeats)[0]
    steps = 2 * (world - 1)
    per_byte = (large - small) / (SIZES[1] - SIZES[0]) / (steps / world)
    latency = max(0.0, (small - steps / world * SIZES[0] * per_byte) / steps)
    return latency, 1.0 / per_byte


def _dp_worker(rank: int, size: int, name: str, global_batch: int, steps: int) -> float:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = ZOO[name]()
    inputs, targets = model.example_inputs(global_batch), model.example_targets(global_batch)
    shard = global_batch // size
    sl = slice(rank * shard, (rank + 1) * shard)
    compiled = tidal.compile(model, tuple(x[sl] for x in inputs))
    ddp = DDP(compiled.graph_module)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    times = []
    for i in range(steps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model.default_loss(ddp(*(x[sl] for x in inputs)), targets[sl])
        loss.backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg16_small,resnet50_small")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cores = os.cpu_count() or 1
    worlds = (2, 4)
    links = {w: fit_link(w) for w in worlds}
    for w, (lat, bw) in links.items():
        print(f"gloo link fitted on {w} ranks: latency {lat:.1f} us, {bw * 8 / 1e3:.2f} Gb/s")
    rows = []
    for name in args.models.split(","):
        model = ZOO[name]()
        gb = args.global_batch
        inputs = model.example_inputs(gb // worlds[0])
        compiled = tidal.compile(model, inputs)
        gm = compiled.graph_module
        prof = profile_layers(gm, inputs, [gb // w for w in worlds], repeats=5,
                              cache_dir=tempfile.mkdtemp(), progress=False)
        for w in worlds:
            lat, bw = links[w]
            cluster = tidal.Cluster(gpus=w, bandwidth_gbps=bw * 8 / 1e3, latency_us=lat,
                                    profile=prof)
            sim = summarize(data_parallel(lambda b: layer_times(gm, cluster, b), w, gb, cluster),
                            w, gb)
            predicted = sim.iteration_us * max(1.0, w / cores)
            measured = statistics.median(spawn(_dp_worker, w, name, gb, args.steps))
            rows.append((name, w, predicted / 1e3, measured / 1e3,
                         (predicted - measured) / measured))
    print(f"\n{'model':16s} {'ranks':>5s} {'predicted ms':>13s} {'measured ms':>12s} {'error':>7s}")
    for name, w, p, m, e in rows:
        print(f"{name:16s} {w:5d} {p:13.2f} {m:12.2f} {e:+7.1%}")
    med = statistics.median(abs(r[4]) for r in rows)
    print(f"median absolute error: {med:.1%} (goal <= 15 %); data parallelism only so far "
          "(burst plans not yet compared)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

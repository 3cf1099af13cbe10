"""Gradient all-reduce overlapping backward: a data-parallel step run as a program
(``tidal.runtime.program``) with and without overlap, and PyTorch's DDP (the tool a user would
otherwise pick), on 2 gloo ranks of this CPU machine.

Model: an MLP of 4 layers of width 1024 (about 3.2 M parameters, 12.6 MB of gradients), global
batch 64 (32 per rank), buckets of 1 MiB so that every large layer's gradients form their own
all-reduce. Each configuration runs ``--warmup`` steps, then ``--steps`` timed steps; the median
step time is printed with the ratio against the program without overlap (same process, same
data). CPU figures on a 2-core machine shared by both ranks: overlap can only hide what the
cores are not both busy with.

    python benchmarks/overlap.py [--steps 20] [--warmup 3]
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

BATCH, WIDTH, BUCKET = 64, 1024, 1 << 20


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, WIDTH), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTH, 10))


def _run(rank: int, size: int, steps: int, warmup: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tidal.ir.capture import capture_train_step
    from tidal.runtime.program import ProgramRunner, data_parallel

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 128, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    xs, ys = x[rows], y[rows]
    out = {}
    for overlap in (False, True):
        model = _model()
        step = capture_train_step(model, (xs,), ys, F.cross_entropy)
        program = data_parallel(step, size, bucket_bytes=BUCKET, overlap=overlap)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        times = []
        with ProgramRunner() as run:
            for i in range(warmup + steps):
                dist.barrier()
                t0 = time.perf_counter()
                run(program, step, model, (xs,), ys, opt)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
        out["tidal overlap" if overlap else "tidal serial"] = statistics.median(times)
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET / 2**20)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(ddp(xs), ys).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    out["torch DDP"] = statistics.median(times)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    from tidal.runtime.distributed import spawn

    results = spawn(_run, 2, args.steps, args.warmup, timeout_s=600)
    base = max(r["tidal serial"] for r in results)
    print(f"data-parallel step, 2 gloo ranks, MLP width {WIDTH}, batch {BATCH}, "
          f"buckets {BUCKET >> 20} MiB (CPU, not a GPU figure)")
    for name in ("tidal serial", "tidal overlap", "torch DDP"):
        t = max(r[name] for r in results)  # the slower rank sets the step time
        print(f"  {name:14s} {t * 1e3:8.2f} ms/step   ratio vs tidal serial {t / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

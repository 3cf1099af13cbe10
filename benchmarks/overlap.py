"""Gradient all-reduce overlapping backward: a data-parallel step run as a program
(``tidal.runtime.program``) with and without overlap, and PyTorch's DDP (the tool a user would
otherwise pick), on 2 gloo ranks of this CPU machine.

Model: an MLP of 4 layers of width 1024 (about 3.2 M parameters, 12.6 MB of gradients), global
batch 64 (32 per rank), buckets of 1 MiB so that every large layer's gradients form their own
all-reduce. Each rank builds the three (the program without overlap, with overlap, DDP), runs
``--warmup`` rounds, then ``--steps`` timed rounds; a round runs one step of each, in turn,
each after a barrier (interleaved: the noise of a shared machine hits the three alike). Then
a training loop's step, tidal's open step (``compiled.backward`` under ``compression`` with
the plain all-reduce, each rank its own batch) against DDP's: AdamW, accumulation over 2
micro-batches inside ``no_sync``, clipping by the global norm. A
step's time is the slower rank's; the median over the rounds is printed with the ratios against
the program without overlap, and the host-overhead figure of issue 33
(``benchmarks/host_overhead.py``): the program with overlap against DDP, with its goal. CPU
figures on a 2-core machine shared by both ranks: overlap can only hide what the cores are not
both busy with.

    python benchmarks/overlap.py [--steps 30] [--warmup 3]
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

from benchmarks.host_overhead import GOAL_DP_VS_DDP, goal_line, load_note  # noqa: E402

BATCH, WIDTH, BUCKET = 64, 1024, 1 << 20
VARIANTS = ("tidal serial", "tidal overlap", "torch DDP", "tidal loop", "DDP loop")
ACCUM = 2  # micro-batches per step in the training-loop variants


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, WIDTH), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTH, 10))


def _steps(xs: torch.Tensor, ys: torch.Tensor, size: int, runners: list) -> dict:
    """One step function per variant (``runners`` collects the program runners to close)."""
    from torch.nn.parallel import DistributedDataParallel

    from tidal.ir.capture import capture_train_step
    from tidal.runtime.program import ProgramRunner, data_parallel

    steps = {}
    for overlap in (False, True):
        model = _model()
        step = capture_train_step(model, (xs,), ys, F.cross_entropy)
        program = data_parallel(step, size, bucket_bytes=BUCKET, overlap=overlap)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        run = ProgramRunner()
        runners.append(run)
        steps[VARIANTS[overlap]] = (lambda run=run, program=program, step=step, model=model,
                                    opt=opt: run(program, step, model, (xs,), ys, opt))
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET / 2**20)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def ddp_step() -> None:
        ddp_opt.zero_grad()
        F.cross_entropy(ddp(xs), ys).backward()
        ddp_opt.step()

    steps[VARIANTS[2]] = ddp_step
    steps.update(_loop_steps(xs, ys))
    return steps


def _loop_steps(xs: torch.Tensor, ys: torch.Tensor) -> dict:
    """A training loop's step, tidal's open step (``compression`` with the plain all-reduce,
    each rank its own batch) and DDP's: AdamW, accumulation over ``ACCUM`` micro-batches (all
    but the last inside ``no_sync``), clipping by the global norm."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel

    import tidal

    micro = xs.shape[0] // ACCUM
    chunks = [(xs[i * micro:(i + 1) * micro], ys[i * micro:(i + 1) * micro])
              for i in range(ACCUM)]
    compiled = tidal.compile(_model(), (chunks[0][0],), passes=["compression"],
                             compressor="none", bucket_mb=BUCKET / 2**20, batch="local",
                             check_batch=False, loss_fn=F.cross_entropy)
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET / 2**20)
    opts = {"tidal": torch.optim.AdamW(compiled.parameters(), lr=1e-3),
            "ddp": torch.optim.AdamW(ddp.parameters(), lr=1e-3)}

    def tidal_loop() -> None:
        for i, (x, y) in enumerate(chunks):
            with compiled.no_sync() if i < ACCUM - 1 else contextlib.nullcontext():
                compiled.backward(x, y, scale=1 / ACCUM)
        compiled.clip_grad_norm_(1.0)
        opts["tidal"].step()
        opts["tidal"].zero_grad()

    def ddp_loop() -> None:
        for i, (x, y) in enumerate(chunks):
            with ddp.no_sync() if i < ACCUM - 1 else contextlib.nullcontext():
                (F.cross_entropy(ddp(x), y) / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opts["ddp"].step()
        opts["ddp"].zero_grad()

    return {VARIANTS[3]: tidal_loop, VARIANTS[4]: ddp_loop}


def _run(rank: int, size: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """This rank's step times (s) by variant, interleaved rounds after a barrier each."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 128, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    runners: list = []
    fns = _steps(x[rows], y[rows], size, runners)
    times: dict[str, list[float]] = {k: [] for k in fns}
    try:
        for i in range(warmup + steps):
            for name, fn in fns.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
    finally:
        for run in runners:
            run.close()
    return times


def measure(steps: int = 30, warmup: int = 3) -> dict[str, float]:
    """Median seconds per step by variant on 2 gloo ranks, each step's time the slower rank's."""
    from tidal.runtime.distributed import spawn

    results = spawn(_run, 2, steps, warmup, timeout_s=900)
    return {k: statistics.median(max(ts) for ts in zip(*(r[k] for r in results)))
            for k in VARIANTS}


def ddp_figure(steps: int = 30, med: dict[str, float] | None = None) -> str:
    """The host-overhead figure: the program with overlap / DDP on 2 gloo ranks, against its
    goal (measured now unless ``med``, :func:`measure`'s result, is given)."""
    med = measure(steps) if med is None else med
    return goal_line("data-parallel program with overlap / PyTorch DDP, 2 gloo ranks",
                     med["tidal overlap"] / med["torch DDP"], GOAL_DP_VS_DDP)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    med = measure(args.steps, args.warmup)
    base = med["tidal serial"]
    print(f"data-parallel step, 2 gloo ranks, MLP width {WIDTH}, batch {BATCH}, "
          f"buckets {BUCKET >> 20} MiB (CPU, not a GPU figure); {load_note()}")
    for name in VARIANTS:
        t = med[name]
        print(f"  {name:14s} {t * 1e3:8.2f} ms/step   ratio vs tidal serial {t / base:.3f}")
    print("  " + ddp_figure(med=med))
    print(f"  training loop (AdamW, accumulation {ACCUM} with no_sync, clipping), tidal's open "
          f"step / DDP: {med['tidal loop'] / med['DDP loop']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

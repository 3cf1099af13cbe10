"""``tidal.hooks.powersgd`` against PyTorch's ``powerSGD_hook`` in DDP on 2 gloo ranks, ViT-sized.

A ViT-Base-sized encoder (12 pre-norm blocks of width 768, 12 heads, MLP 3072: about 85 M
parameters) on a few patch tokens, so the step is dominated by the weights (the gradient sync
and PowerSGD's passes over the gradients), as in the issue's measurement. For each bucket
size (one bucket; 1 MiB buckets) both hooks train their own copy of the same model on the same
batches, at the same rank (``--rank``, 4), alternating step by step (which one goes first
alternates too), one thread per rank. Per step, the slower rank's time for zero_grad +
forward + backward + SGD step (DDP waits for the hook's futures inside the backward) and the
time spent inside the hook calls (what DDP's backward waits for before it can go on; the rest
of the sync overlaps the backward). Medians after ``--warmup`` steps, printed as tidal /
PyTorch ratios. Goal: tidal's step <= 1.02x PyTorch's.

PyTorch's hook issues its P and Q all-reduces from callbacks that run on gloo's worker
threads, unordered with the next bucket's first collective, so with more than one bucket the
ranks fail with a collective mismatch on gloo (``tidal.runtime.comm.compressors.comm``). For the
1 MiB buckets it therefore runs serialized: each bucket's hook is called once the previous
bucket's future has completed (the order NCCL's inline callbacks give). tidal's hook orders
its collectives itself (``tidal.runtime.comm.compressors.Lane``) and needs no such wrapper.

Loss curves: the global loss of every step for both hooks and for DDP without a hook
(uncompressed, the reference), ``--steps`` steps (50) cycling over ``--batches`` fixed batches;
printed: the largest relative difference between the curves, and the final losses. PyTorch's
hook runs plain all-reduce for its first 2 steps (``start_powerSGD_iter=2``, its minimum with
error feedback), tidal compresses from the first; tidal keeps this rank's own residual
(``M - P P^T M``), PyTorch the residual against the averaged result, so the curves differ by
the compression's own noise.

    python benchmarks/hooks.py [--steps 50] [--warmup 5] [--rank 4] [--batch 2] [--tokens 8]
                               [--buckets one,1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tidal import hooks  # noqa: E402
from tidal.runtime.distributed import spawn  # noqa: E402

ONE_BUCKET_MB = 2048
"""A bucket cap above the model's gradient bytes: DDP makes one bucket."""
PATCH_DIM = 48
CLASSES = 10


class ViT(nn.Module):
    """A ViT encoder on pre-cut patches: patch embedding, class token, position embedding,
    ``layers`` pre-norm transformer blocks, the class token's head."""

    def __init__(self, layers: int = 12, width: int = 768, heads: int = 12, tokens: int = 8):
        super().__init__()
        self.embed = nn.Linear(PATCH_DIM, width)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.randn(1, tokens + 1, width) * 0.02)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.embed(patches)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def _batches(args: argparse.Namespace, rank: int, size: int) -> list[tuple[torch.Tensor, ...]]:
    """This rank's share of ``args.batches`` fixed global batches."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(args.batches):
        x = torch.randn(args.batch * size, args.tokens, PATCH_DIM, generator=g)
        y = torch.randint(0, CLASSES, (args.batch * size,), generator=g)
        out.append((x[rank::size], y[rank::size]))
    return out


def _timed(hook: Callable, spent: list[float]) -> Callable:
    """``hook``, adding the seconds each call takes to ``spent[-1]``."""
    def timed(state, bucket):  # unannotated: DDP checks hook annotations as objects
        t0 = time.perf_counter()
        fut = hook(state, bucket)
        spent[-1] += time.perf_counter() - t0
        return fut
    return timed


def _serialized(hook: Callable) -> Callable:
    """``hook`` called for each bucket only once the previous bucket's future has completed
    (PyTorch's ``powerSGD_hook`` with several buckets on gloo; see the module docstring)."""
    tail: list[torch.futures.Future] = []

    def serialized(state, bucket):  # unannotated, as above
        result: torch.futures.Future = torch.futures.Future()

        def forward(done: torch.futures.Future) -> None:
            try:
                done.value()
            except Exception as e:  # noqa: BLE001 - handed on
                result.set_exception(e)
            else:
                result.set_result(done.value())

        def start(_: Optional[torch.futures.Future] = None) -> None:
            try:
                hook(state, bucket).add_done_callback(forward)
            except Exception as e:  # noqa: BLE001 - handed on
                result.set_exception(e)

        if tail and not tail[-1].done():
            tail[-1].add_done_callback(start)
        else:
            start()
        tail[:] = [result]
        return result
    return serialized


def _model(args: argparse.Namespace) -> ViT:
    torch.manual_seed(0)
    return ViT(args.layers, args.width, args.heads, args.tokens)


def _ddp(args: argparse.Namespace, method: str, bucket_mb: float, spent: list[float],
         seed: int = 0) -> tuple[DDP, torch.optim.Optimizer]:
    """The DDP model of ``method`` (tidal, torch, or none) with its timed hook (the hook
    function's own calls, wherever they run); ``seed``: PowerSGD's initial Q."""
    model = _model(args)
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    if method == "tidal":
        ddp.register_comm_hook(hooks.powersgd_state(model, args.rank, seed=seed),
                               _timed(hooks.powersgd, spent))
    elif method == "torch":
        state = torch_psgd.PowerSGDState(None, matrix_approximation_rank=args.rank,
                                         start_powerSGD_iter=2, min_compression_rate=2,
                                         random_seed=seed)
        hook = _timed(torch_psgd.powerSGD_hook, spent)
        ddp.register_comm_hook(state, hook if bucket_mb == ONE_BUCKET_MB else _serialized(hook))
    return ddp, torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)


def _step(ddp: DDP, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]) -> float:
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(ddp(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss.item()


def _rank(rank: int, size: int, args: argparse.Namespace) -> dict:
    """Per bucket size and method, per step: the slower rank's step and in-hook seconds and
    the global loss; and the loss curve of DDP without a hook."""
    batches = _batches(args, rank, size)
    out: dict[str, Any] = {"params": sum(p.numel() for p in _model(args).parameters())}

    def record(key: str, seconds: float, in_hook: float, loss: float) -> None:
        t = torch.tensor([seconds, in_hook, loss / size], dtype=torch.float64)
        dist.all_reduce(t[:2], op=dist.ReduceOp.MAX)
        dist.all_reduce(t[2:])
        for name, value in zip(("step", "hook", "loss"), t.tolist()):
            out.setdefault(key, {}).setdefault(name, []).append(value)

    for label in args.buckets:
        bucket_mb = ONE_BUCKET_MB if label == "one" else float(label)
        spent = {m: [0.0] for m in ("tidal", "torch")}
        runs = {m: _ddp(args, m, bucket_mb, spent[m]) for m in ("tidal", "torch")}
        for step in range(args.steps):
            order = ("tidal", "torch") if step % 2 == 0 else ("torch", "tidal")
            for method in order:
                dist.barrier()
                spent[method].append(0.0)
                t0 = time.perf_counter()
                loss = _step(*runs[method], batches[step % len(batches)])
                record(f"{label}/{method}", time.perf_counter() - t0, spent[method][-1], loss)
        del runs
    for key, method, seed in (("reference", "none", 0), ("tidal seed 1", "tidal", 1),
                              ("torch seed 1", "torch", 1)):      # loss curves only
        ddp, opt = _ddp(args, method, ONE_BUCKET_MB, [0.0], seed)
        for step in range(args.steps):
            record(key, 0.0, 0.0, _step(ddp, opt, batches[step % len(batches)]))
    return out


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _worst(a: list[float], b: list[float]) -> str:
    """The largest relative difference of curve ``a`` from ``b`` and its step."""
    rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    step = max(range(len(rel)), key=rel.__getitem__)
    return f"{rel[step]:.2%} (step {step})"


def report(r: dict, args: argparse.Namespace) -> None:
    """Print the table, the ratios and the loss comparison."""
    w = args.warmup
    print(f"ViT {args.layers} x {args.width} ({r['params'] / 1e6:.1f} M parameters), "
          f"{args.tokens} patches + class token, batch {args.batch} per rank, 2 gloo ranks "
          f"(1 thread each), PowerSGD rank {args.rank}; medians of steps {w}..{args.steps - 1}"
          f" (slower rank)")
    print(f"{'buckets':<9}{'hook':<16}{'step ms':>9}{'in hook ms':>12}")
    worst = 0.0
    for label in args.buckets:
        med = {m: {k: statistics.median(r[f"{label}/{m}"][k][w:]) for k in ("step", "hook")}
               for m in ("torch", "tidal")}
        for m, name in (("torch", "torch powerSGD" + ("" if label == "one" else " (ser.)")),
                        ("tidal", "tidal powersgd")):
            print(f"{label if label == 'one' else label + ' MiB':<9}{name:<16}"
                  f"{med[m]['step'] * 1e3:>9.1f}{med[m]['hook'] * 1e3:>12.1f}")
        ratio = med["tidal"]["step"] / med["torch"]["step"]
        worst = max(worst, ratio)
        print(f"{'':<9}{'tidal / torch':<16}{ratio:>8.3f}x"
              f"{med['tidal']['hook'] / med['torch']['hook']:>11.3f}x")
    print(f"goal: tidal's step <= 1.02x PyTorch's: {'met' if worst <= 1.02 else 'NOT met'} "
          f"(worst {worst:.3f}x)")
    curves = {k: r[k]["loss"] for k in ("reference", "tidal seed 1", "torch seed 1")}
    for label in args.buckets:
        curves[f"tidal {label}"] = r[f"{label}/tidal"]["loss"]
        curves[f"torch {label}"] = r[f"{label}/torch"]["loss"]
    print(f"loss over {args.steps} steps (global batch, {args.batches} batches cycled; "
          "first -> last):")
    for name, c in curves.items():
        print(f"  {name:<14}{c[0]:.4f} -> {c[-1]:.4f}")
    first = args.buckets[0]
    noise = max(_max_rel(curves[f"tidal {first}"], curves["tidal seed 1"]),
                _max_rel(curves[f"torch {first}"], curves["torch seed 1"]))
    print(f"max relative difference between curves (noise: the same hook with another "
          f"initial Q, {noise:.2%}):")
    for label in args.buckets:
        tl, pl = curves[f"tidal {label}"], curves[f"torch {label}"]
        print(f"  {label:<4} tidal vs torch {_worst(tl, pl)}; vs uncompressed: tidal "
              f"{_worst(tl, curves['reference'])}, torch {_worst(pl, curves['reference'])}")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--batch", type=int, default=2, help="samples per rank")
    p.add_argument("--tokens", type=int, default=8, help="patches per sample")
    p.add_argument("--batches", type=int, default=8, help="fixed batches, cycled")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--lr", type=float, default=0.0005, help="SGD (momentum 0.9)")
    p.add_argument("--buckets", type=lambda s: s.split(","), default=["one", "1"],
                   help="comma-separated: 'one' (one bucket) or a bucket cap in MiB")
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    results = spawn(_rank, 2, args, timeout_s=3600, pg_timeout_s=600)
    report(results[0], args)


if __name__ == "__main__":
    main()

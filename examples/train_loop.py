"""A complete training loop under tidal, beside the same loop under PyTorch DDP.

What an engineer writes: AdamW over two parameter groups, a warm-up + cosine schedule, clipping
by the global gradient norm, gradient accumulation over 4 micro-batches, a ``DataLoader`` with
a ``DistributedSampler`` (each rank passes its own batch: ``compile(..., batch="local")``),
evaluation every few steps in eval mode, a ``torch.distributed.checkpoint`` (DCP) checkpoint
half-way (with each rank's ``compiled.runtime_state_dict()``: compressor residuals) and a
resume from it. The loop runs twice in one process group: under tidal (the open
step: ``compiled.backward``, ``compiled.no_sync``, ``compiled.clip_grad_norm_``, the user's
optimizer and schedule) and under DDP, and prints both runs' losses and their largest
difference. ``--bf16`` runs the forward under ``torch.autocast(bfloat16)`` (no pass only: a
plan's program refuses autocast, see the README).

    python examples/train_loop.py                              # one process
    torchrun --nproc-per-node 2 examples/train_loop.py --pass compression
    tidal run -n 2 examples/train_loop.py --pass compression   # the same, through tidal's CLI
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT.parent) not in sys.path and (ROOT / "__init__.py").exists():
    sys.path.insert(0, str(ROOT.parent))

import tidal  # noqa: E402

LOCAL_BATCH, ACCUM, FEATURES, CLASSES = 8, 4, 16, 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                               torch.nn.Linear(64, CLASSES))


def make_data(n: int = 1024) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, FEATURES, generator=g)
    return TensorDataset(x, (x[:, :CLASSES] * 3).argmax(1))


def make_optimizer(params, steps: int):
    """AdamW, decay on the weights only, linear warm-up then cosine."""
    params = list(params)
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                            lr=3e-3)
    warmup = max(1, steps // 5)

    def rate(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, rate)


class Runner:
    """One way to train: ``backward(x, y, scale)``, ``no_sync()``, ``clip(max_norm)``,
    ``forward(x)`` for evaluation and ``module`` for checkpoints."""

    def __init__(self, kind: str, passes: list, model: torch.nn.Module, options: dict):
        self.kind = kind
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(model) if dist.is_initialized() else model
            self.module = model
        else:
            x, _ = make_data(LOCAL_BATCH)[:]
            self.net = tidal.compile(model, (x,), passes=passes, loss_fn=F.cross_entropy,
                                     batch="local", **options)
            self.module = model

    def backward(self, x, y, scale: float) -> float:
        if self.kind == "ddp":
            loss = F.cross_entropy(self.net(x), y)
            (loss * scale).backward()
            mean = loss.detach().clone()
            if dist.is_initialized():   # the global batch's loss, as tidal returns it
                dist.all_reduce(mean)
                mean /= dist.get_world_size()
            return float(mean)
        return float(self.net.backward(x, y, scale=scale))

    def no_sync(self):
        sync = getattr(self.net, "no_sync", None)
        return sync() if sync is not None else contextlib.nullcontext()

    def clip(self, max_norm: float) -> float:
        if self.kind == "ddp":
            return float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm))
        return float(self.net.clip_grad_norm_(max_norm))

    def parameters(self):
        return self.module.parameters()

    def evaluate(self, x, y) -> float:
        self.net.eval()
        with torch.no_grad():
            loss = float(F.cross_entropy(self.net(x), y))
        self.net.train()
        return loss


def _runtime_file(ckpt: Path, kind: str) -> Path:
    """This rank's file of the program's runtime state (``Compiled.runtime_state_dict``)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return ckpt / f"{kind}-runtime-rank{rank}.pt"


def train(kind: str, passes: list, steps: int, bf16: bool, ckpt: Path, resume: bool,
          options: dict) -> dict:
    """``steps`` optimizer steps; a DCP checkpoint after half of them; with ``resume``, a
    fresh model and optimizer load it and train the second half. Returns the losses by step
    (``(step, "eval")`` for the evaluations)."""
    model = make_model()
    run = Runner(kind, passes, model, options)
    opt, sched = make_optimizer(run.parameters(), steps)
    data = make_data()
    sampler = DistributedSampler(data, shuffle=True, seed=0) if dist.is_initialized() else None
    loader = DataLoader(data, batch_size=LOCAL_BATCH, sampler=sampler,
                        shuffle=sampler is None, generator=torch.Generator().manual_seed(0),
                        drop_last=True)
    x_val, y_val = data[:64]
    batches = iter(loader)
    losses: dict = {}
    start = 0
    if resume:
        start = steps // 2
        state = {"model": {}, "optim": {}}
        state["model"], state["optim"] = get_state_dict(run.module, opt)
        dcp.load(state, checkpoint_id=str(ckpt / kind))
        set_state_dict(run.module, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if kind == "tidal":   # what the program holds per rank (compressor residuals...)
            run.net.load_runtime_state_dict(torch.load(_runtime_file(ckpt, kind),
                                                       weights_only=False))
        for _ in range(start):
            sched.step()
        for _ in range(start * ACCUM):   # the loader where the checkpoint left it
            next(batches)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                else contextlib.nullcontext())
    for step in range(start, steps):
        if step == steps // 2 and not resume:
            model_state, optim_state = get_state_dict(run.module, opt)
            dcp.save({"model": model_state, "optim": optim_state},
                     checkpoint_id=str(ckpt / kind))
            if kind == "tidal":
                torch.save(run.net.runtime_state_dict(), _runtime_file(ckpt, kind))
        total = 0.0
        for micro in range(ACCUM):
            x, y = next(batches)
            sync = run.no_sync() if micro < ACCUM - 1 else contextlib.nullcontext()
            with sync, autocast:
                total += run.backward(x, y, 1 / ACCUM) / ACCUM
        run.clip(1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = total
        if step % 4 == 3:
            losses[(step, "eval")] = run.evaluate(x_val, y_val)
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pass", dest="passes", default="none",
                    help="the tidal pass to train under: none or compression")
    ap.add_argument("--compressor", default="none",
                    help="with --pass compression: the compressor spec (default none: plain "
                         "all-reduce, equal to DDP; e.g. powersgd:4 to see what it changes)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--bf16", action="store_true", help="forward under autocast(bfloat16)")
    args = ap.parse_args(argv)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    passes = [] if args.passes == "none" else [args.passes]
    options = {"compressor": args.compressor} if args.passes == "compression" else {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        if dist.is_initialized():   # one directory for every rank
            names = [tmp]
            dist.broadcast_object_list(names, src=0)
            ckpt = Path(names[0])
        out = {}
        for kind in ("tidal", "ddp"):
            first = train(kind, passes, args.steps, args.bf16, ckpt, False, options)
            resumed = train(kind, passes, args.steps, args.bf16, ckpt, True, options)
            out[kind] = (first, resumed)
        if dist.is_initialized():
            dist.barrier()
    if rank == 0:
        for kind, (first, _) in out.items():
            print(f"{kind:5s} losses: " + " ".join(
                f"{v:.4f}" if isinstance(k, int) else f"[eval {v:.4f}]" for k, v in first.items()))
        (first, resumed), (ddp, _) = out["tidal"], out["ddp"]
        diff = max(abs(first[k] - ddp[k]) for k in first)
        resume_diff = max(abs(first[k] - resumed[k]) for k in resumed)
        print(f"max |tidal - DDP| over the losses: {diff:.2e}; resumed from the DCP "
              f"checkpoint vs uninterrupted: {resume_diff:.2e}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

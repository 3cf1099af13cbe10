"""A complete training loop under tidal, beside the same loop under PyTorch DDP.

What an engineer writes: AdamW over two parameter groups, a warm-up + cosine schedule, clipping
by the global gradient norm, gradient accumulation over 4 micro-batches, a ``DataLoader`` with
a ``DistributedSampler`` (each rank passes its own batch: ``compile(..., batch="local")``),
evaluation every few steps in eval mode, a ``torch.distributed.checkpoint`` (DCP) checkpoint
half-way and a resume from it. The loop is the same under every pass (``--pass``: none,
compression, burst_parallel, tick_tock, round_robin): the open step (``compiled.backward``,
``compiled.no_sync``, ``compiled.clip_grad_norm_``: the global norm, every parameter counted
once even where a rank holds only its layers' gradients), the user's optimizer and schedule.
``--bf16`` runs it under ``torch.autocast(bfloat16)``.

The checkpoint is ONE ``dcp.save`` of the model, the optimizer, the scheduler and the plan's
runtime state (``tidal.checkpoint.get_runtime_state_dict``: tick_tock's second wave,
compressor residuals; per-rank entries under rank keys); the resume loads it into a fresh
model and optimizer and trains the second half, and the script prints the resumed losses'
largest difference from the uninterrupted run's (0: bit for bit).

The loop runs twice in one process group, under tidal and under DDP, and prints both runs'
losses and their largest difference: equal (float32: <= 1e-5) under every pass but
tick_tock, which is Wavelet's Eq. 1 (two replicas; each wave averages its gradient with the
other wave's latest), not DDP: its difference from DDP is printed for information
(tests/test_train_loop_example.py compares it with the Eq. 1 reference).

    python examples/train_loop.py                              # one process
    torchrun --nproc-per-node 2 examples/train_loop.py --pass burst_parallel
    tidal run -n 2 examples/train_loop.py --pass tick_tock --bf16   # the same, through tidal's CLI
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint import state_dict as torch_state
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT.parent) not in sys.path and (ROOT / "__init__.py").exists():
    sys.path.insert(0, str(ROOT.parent))

import tidal  # noqa: E402
from tidal.passes.burst_parallel import BurstParallel  # noqa: E402
from tidal.passes.round_robin import RoundRobin  # noqa: E402
from tidal.passes.tick_tock import TickTock  # noqa: E402

LOCAL_BATCH, ACCUM, FEATURES, CLASSES = 8, 4, 16, 4
PASSES = ("none", "compression", "burst_parallel", "tick_tock", "round_robin")
TOL = 1e-5
"""tidal against DDP (float32): the same sums in another order."""


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


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def make_passes(name: str, compressor: str = "none") -> tuple[list, dict]:
    """``compile``'s ``passes`` and options for ``--pass name`` on this world size."""
    world = world_size()
    if name not in PASSES:
        raise ValueError(f"train_loop --pass {name!r}: one of {', '.join(PASSES)}")
    if name == "compression":
        return ["compression"], {"compressor": compressor}
    if name == "burst_parallel":   # the planner picks each layer's ranks for this machine
        cluster = tidal.Cluster(gpus=world, bandwidth_gbps=100, latency_us=5)
        return [BurstParallel()], {"cluster": cluster}
    if name == "tick_tock":
        return [TickTock(ranks=world)], {}
    if name == "round_robin":
        return [RoundRobin(partitions=world)], {}
    return [], {}


class Runner:
    """One way to train: ``backward(x, y, scale)``, ``no_sync()``, ``clip(max_norm)``,
    ``evaluate(x, y)``, ``optimizers(steps)`` and the checkpoint (``save``/``load``)."""

    def __init__(self, kind: str, model: torch.nn.Module, passes: list = (),
                 options: dict = None):
        self.kind, self.module = kind, model
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(model) if dist.is_initialized() else model
        else:
            x, _ = make_data(LOCAL_BATCH)[:]
            self.net = tidal.compile(model, (x,), passes=list(passes), loss_fn=F.cross_entropy,
                                     batch="local", **(options or {}))

    def optimizers(self, steps: int):
        return make_optimizer(self.module.parameters(), steps)

    def backward(self, x, y, scale: float) -> float:
        if self.kind == "ddp":
            loss = F.cross_entropy(self.net(x), y)
            (loss * scale).backward()
            mean = loss.detach().float().clone()
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

    def evaluate(self, x, y) -> float:
        """The mean loss over ``x`` in eval mode, every rank the same batches of the global
        batch's size (under ``burst_parallel`` a forward is for the plan's global batch)."""
        rows = LOCAL_BATCH * world_size()
        total = 0.0
        self.net.eval()
        with torch.no_grad():
            for i in range(0, len(x), rows):
                out = self.net(x[i:i + rows])
                total += float(F.cross_entropy(out.float(), y[i:i + rows], reduction="sum"))
        self.net.train()
        return total / len(x)

    def state(self, opt, sched, template_of: str = None) -> dict:
        """What the checkpoint holds (``template_of``: the checkpoint to load, for the
        runtime state's template)."""
        if self.kind == "ddp":
            model, optim = torch_state.get_state_dict(self.module, opt)
            return {"model": model, "optim": optim, "sched": sched.state_dict()}
        model, optim = tidal.checkpoint.get_state_dict(self.net, opt)   # current on every rank
        runtime = tidal.checkpoint.get_runtime_state_dict(self.net, checkpoint_id=template_of)
        return {"model": model, "optim": optim, "sched": sched.state_dict(), "runtime": runtime}

    def save(self, path: str, opt, sched) -> None:
        """Model, optimizer, scheduler and runtime state in ONE ``dcp.save``."""
        dcp.save(self.state(opt, sched), checkpoint_id=path)

    def load(self, path: str, opt, sched) -> None:
        state = self.state(opt, sched, template_of=path)
        dcp.load(state, checkpoint_id=path)
        setter = torch_state if self.kind == "ddp" else tidal.checkpoint
        setter.set_state_dict(self.module if self.kind == "ddp" else self.net, opt,
                              model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        if self.kind != "ddp":
            tidal.checkpoint.set_runtime_state_dict(self.net, state["runtime"])


def train(make_runner: Callable[[torch.nn.Module], Runner], steps: int, bf16: bool,
          ckpt: str, resume: bool) -> dict:
    """``steps`` optimizer steps; a DCP checkpoint at ``ckpt`` after half of them; with
    ``resume``, a fresh model and optimizer load it and train the second half. Returns the
    losses by step (``(step, "eval")`` for the evaluations)."""
    run = make_runner(make_model())
    opt, sched = run.optimizers(steps)
    data = make_data()
    sampler = DistributedSampler(data, shuffle=True, seed=0) if dist.is_initialized() else None
    loader = DataLoader(data, batch_size=LOCAL_BATCH, sampler=sampler,
                        shuffle=sampler is None, generator=torch.Generator().manual_seed(0),
                        drop_last=True)
    x_val, y_val = data[:64]
    batches = iter(loader)
    losses: dict = {}
    start = steps // 2 if resume else 0
    if resume:
        run.load(ckpt, opt, sched)
        for _ in range(start * ACCUM):   # the loader where the checkpoint left it
            next(batches)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                else contextlib.nullcontext())
    for step in range(start, steps):
        if step == steps // 2 and not resume:
            run.save(ckpt, opt, sched)
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


@dataclass
class Result:
    """The losses of one ``--pass``: tidal's uninterrupted and resumed runs, and DDP's."""
    pass_name: str
    tidal: dict
    resumed: dict
    ddp: dict

    @property
    def versus_ddp(self) -> float:
        return max(abs(self.tidal[k] - self.ddp[k]) for k in self.tidal)

    @property
    def resume_diff(self) -> float:
        return max(abs(self.tidal[k] - self.resumed[k]) for k in self.resumed)


def compare(pass_name: str, steps: int, bf16: bool, ckpt: str, compressor: str = "none"
            ) -> Result:
    """The loop under tidal (``pass_name``; then resumed from its checkpoint) and under DDP,
    in the current process group; checkpoints under the directory ``ckpt`` (the same on
    every rank)."""
    passes, options = make_passes(pass_name, compressor)
    tidal_run = lambda model: Runner("tidal", model, passes, options)   # noqa: E731
    path = os.path.join(ckpt, f"{pass_name}-{'bf16' if bf16 else 'fp32'}")
    first = train(tidal_run, steps, bf16, path, False)
    resumed = train(tidal_run, steps, bf16, path, True)
    ddp = train(lambda model: Runner("ddp", model), steps, bf16, path + "-ddp", False)
    return Result(pass_name, first, resumed, ddp)


def report(result: Result, bf16: bool) -> str:
    """What rank 0 prints: both runs' losses, their largest difference, the resume check."""
    def line(losses: dict) -> str:
        return " ".join(f"{v:.4f}" if isinstance(k, int) else f"[eval {v:.4f}]"
                        for k, v in losses.items())
    out = [f"tidal ({result.pass_name}) losses: {line(result.tidal)}",
           f"ddp losses: {line(result.ddp)}"]
    if result.pass_name == "tick_tock":
        out.append(f"tick_tock is Wavelet's Eq. 1 (two replicas, each wave averaging its "
                   f"gradient with the other wave's latest), not DDP: max |tidal - DDP| = "
                   f"{result.versus_ddp:.2e}, for information")
    else:
        verdict = "equal" if result.versus_ddp <= TOL or bf16 else "NOT EQUAL"
        out.append(f"max |tidal - DDP| over the losses: {result.versus_ddp:.2e} "
                   f"({verdict}; float32 tolerance {TOL:g}"
                   f"{', bf16 autocast: the same casts, other sums' if bf16 else ''})")
    out.append(f"resumed from the DCP checkpoint vs uninterrupted: {result.resume_diff:.2e}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pass", dest="pass_name", default="none", choices=PASSES,
                    help="the tidal pass to train under (default none); tick_tock is "
                         "Wavelet's Eq. 1, not DDP")
    ap.add_argument("--compressor", default="none",
                    help="with --pass compression: the compressor spec (default none: plain "
                         "all-reduce, equal to DDP; e.g. powersgd:4 to see what it changes)")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    ap.add_argument("--bf16", action="store_true", help="forward under autocast(bfloat16)")
    args = ap.parse_args(argv)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    with tempfile.TemporaryDirectory() as tmp:
        names = [tmp]
        if dist.is_initialized():   # one directory for every rank
            dist.broadcast_object_list(names, src=0)
        result = compare(args.pass_name, args.steps, args.bf16, names[0], args.compressor)
        if dist.is_initialized():
            dist.barrier()
    if rank == 0:
        print(report(result, args.bf16))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A DDP communication hook on a process group of one (NCCL on a GPU, gloo on the CPU),
compression off: tidal's ``allreduce`` hook and ``topk`` at 100 % (``tidal.hooks``) against
plain DDP, from the same weights on the same batches: the largest parameter difference after
a few steps and ms/step."""
from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.gpu_check.common import fail, max_param_diff, mlp, ms_per_call, sync
from tidal.runtime.comm.ddp_hooks import allreduce, allreduce_state, topk, topk_state

SUMMARY = ("backend", "plain.ms", "allreduce.ms", "topk_1.0.ms", "allreduce.max_dparam",
           "topk_1.0.max_dparam")
TOL = 1e-6


def _hooked(model: torch.nn.Module, device: torch.device, name: str) -> DDP:
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if name == "allreduce":
        ddp.register_comm_hook(allreduce_state(model), allreduce)
    elif name == "topk_1.0":
        ddp.register_comm_hook(topk_state(model, 1.0), topk)
    return ddp


def run(device: str, quick: bool) -> dict:
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index if dev.index is not None else 0)
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    widths = [32, 64, 10] if quick else [1024, 4096, 4096, 1000]
    figures: dict = {"backend": backend}
    with tempfile.TemporaryDirectory(prefix="ddp-store-") as tmp:
        dist.init_process_group(backend, init_method=f"file://{Path(tmp) / 'store'}",
                                rank=0, world_size=1)
        try:
            base = mlp(widths, seed=0).to(dev)
            g = torch.Generator().manual_seed(0)
            x = torch.randn(32, widths[0], generator=g).to(dev)
            y = torch.randint(0, widths[-1], (32,), generator=g).to(dev)
            models = {}
            for name in ("plain", "allreduce", "topk_1.0"):
                ddp = _hooked(copy.deepcopy(base), dev, name)
                opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

                def step(ddp=ddp, opt=opt):
                    opt.zero_grad(set_to_none=True)
                    torch.nn.functional.cross_entropy(ddp(x), y).backward()
                    opt.step()
                for _ in range(3):
                    step()
                sync(dev)
                models[name] = copy.deepcopy(ddp.module)
                figures[f"{name}.ms"] = ms_per_call(step, dev, 3 if quick else 30)
            for name in ("allreduce", "topk_1.0"):
                diff = max_param_diff(models["plain"], models[name])
                figures[f"{name}.max_dparam"] = diff
                if not diff <= TOL:
                    fail(figures, f"{name} hook differs from plain DDP by {diff:.3g}")
        finally:
            dist.destroy_process_group()
    return figures

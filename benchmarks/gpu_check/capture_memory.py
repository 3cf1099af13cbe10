"""Memory used by a captured training step against eager: the peak during a steady step (after
warm-up and capture) and what stays held, for eager PyTorch and tidal's captured step (one
process's data-parallel program, ``CompressionPass(mode="off")``: the joint forward+backward
graph captured). On a GPU: ``torch.cuda.max_memory_allocated`` over the step
(``MemoryProbe.cuda_peak_bytes``) and ``memory_reserved`` (graph pools included); on the CPU the
process heap's sampled peak (``MemoryProbe(host=True).heap_peak_bytes``)."""
from __future__ import annotations

import copy
import gc

import torch

import tidal
from benchmarks.gpu_check.common import fail, mlp, sync
from tidal.passes.compression import CompressionPass
from tidal.runtime.weights.memory_probe import MemoryProbe

SUMMARY = ("eager.peak_mib", "captured.peak_mib", "captured.vs_eager", "eager.reserved_mib",
           "captured.reserved_mib", "measure")


def _loss(out, y):
    return torch.nn.functional.cross_entropy(out, y)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _eager(model, x, y):
    opt = _sgd(model.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        _loss(model(x), y).backward()
        opt.step()
    return step


def _captured(model, x, y):
    c = tidal.compile(model, (x,), loss_fn=_loss, optimizer=_sgd,
                      passes=[CompressionPass(mode="off")])
    return lambda: c.step((x,), y)


def _measure(step, device: torch.device) -> dict:
    for _ in range(3):  # warm-up and capture
        step()
    sync(device)
    gc.collect()
    cuda = device.type == "cuda"
    with MemoryProbe(host=not cuda, device=device if cuda else None) as probe:
        step()
        sync(device)
    peak = probe.cuda_peak_bytes if cuda else probe.heap_peak_bytes
    out = {"peak_mib": None if peak is None else peak / 2**20}
    if cuda:
        out["held_mib"] = torch.cuda.memory_allocated(device) / 2**20
        out["reserved_mib"] = torch.cuda.memory_reserved(device) / 2**20
    return out


def run(device: str, quick: bool) -> dict:
    dev = torch.device(device)
    widths = [64, 256, 256, 10] if quick else [1024, 4096, 4096, 4096, 1000]
    batch = 32 if quick else 256
    base = mlp(widths, seed=0, norm=True).to(dev)
    x = torch.randn(batch, widths[0], device=dev)
    y = torch.randint(0, widths[-1], (batch,), device=dev)
    figures: dict = {"measure": "cuda max_memory_allocated" if dev.type == "cuda"
                     else "host heap peak (sampled)"}
    for name, make in (("eager", _eager), ("captured", _captured)):
        step = make(copy.deepcopy(base), x, y)
        for k, v in _measure(step, dev).items():
            figures[f"{name}.{k}"] = v
        del step
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    eager, captured = figures["eager.peak_mib"], figures["captured.peak_mib"]
    if eager is None or captured is None:
        fail(figures, f"no peak measured on {dev} ({figures['measure']})")
    elif eager > 0:
        figures["captured.vs_eager"] = captured / eager
    return figures

"""Where a training step's device time goes: ``train_step``'s eager step and tidal's captured
step (``tidal_captured``) at batch 1 under ``torch.profiler``, a few steps each after warm-up:
device time and kernel launches per step, the time and count of memory copies (a captured step
that copies its inputs into static buffers shows them here) and the five costliest kernels.
The full tables go to ``step_profile.txt`` in the check's folder."""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_check.common import mlp, sync
from benchmarks.gpu_check.train_step import VARIANTS

SUMMARY = ("eager.device_ms", "tidal_captured.device_ms", "eager.kernels",
           "tidal_captured.kernels", "eager.memcpy_ms", "tidal_captured.memcpy_ms",
           "tidal_captured.memcpy_count")
STEPS = 5


def _device_us(event) -> float:
    for name in ("device_time_total", "cuda_time_total", "self_device_time_total"):
        value = getattr(event, name, None)
        if value:
            return float(value)
    return 0.0


def _profile(step, device: torch.device) -> tuple[dict, str]:
    for _ in range(3):
        step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        for _ in range(STEPS):
            step()
        sync(device)
    events = [e for e in prof.key_averages() if _device_us(e) > 0 and
              getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
    kernels = [e for e in events if "memcpy" not in e.key.lower() and
               "memset" not in e.key.lower()]
    copies = [e for e in events if "memcpy" in e.key.lower()]
    figures = {
        "device_ms": sum(_device_us(e) for e in events) / STEPS / 1e3,
        "kernels": sum(e.count for e in kernels) / STEPS,
        "memcpy_ms": sum(_device_us(e) for e in copies) / STEPS / 1e3,
        "memcpy_count": sum(e.count for e in copies) / STEPS,
        "top": ", ".join(f"{e.key[:40]}={_device_us(e) / STEPS / 1e3:.3f}ms"
                         for e in sorted(kernels, key=_device_us, reverse=True)[:5]),
    }
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=25)
    except Exception:  # noqa: BLE001 - older/newer profiler column names
        table = prof.key_averages().table(row_limit=25)
    return figures, table


def run(device: str, quick: bool) -> dict:
    dev = torch.device(device)
    widths = [32, 64, 64, 10] if quick else [1024, 4096, 4096, 1000]
    base = mlp(widths, seed=1, norm=True).to(dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, widths[0], generator=g).to(dev)
    y = torch.randint(0, widths[-1], (1,), generator=g).to(dev)
    figures: dict = {"widths": "x".join(map(str, widths)), "batch": 1, "steps": STEPS}
    tables = []
    for name in ("eager", "tidal_captured"):
        step, _ = VARIANTS[name](copy.deepcopy(base), x, y)
        part, table = _profile(step, dev)
        figures.update({f"{name}.{k}": v for k, v in part.items()})
        tables.append(f"== {name} (batch 1, {STEPS} steps) ==\n{table}\n")
    Path("step_profile.txt").write_text("\n".join(tables))
    return figures

"""What several checks share: synchronizing and timing on a device, parameter differences,
percentiles and a small MLP.

Example:
    >>> import torch
    >>> from benchmarks.gpu_check.common import max_param_diff, mlp, percentile
    >>> a, b = mlp([4, 8, 2], seed=0), mlp([4, 8, 2], seed=0)
    >>> max_param_diff(a, b)
    0.0
    >>> percentile([1.0, 2.0, 3.0, 4.0], 50)
    2.5
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch


def sync(device: Any) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def ms_per_call(fn: Callable[[], Any], device: Any, calls: int, warmup: int = 1) -> float:
    """Median milliseconds of ``fn()`` over ``calls`` calls after ``warmup``, each timed from a
    synchronized device to a synchronized device."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest |difference| between the two modules' parameters, in registration order."""
    pa, pb = list(a.parameters()), list(b.parameters())
    if len(pa) != len(pb):
        raise ValueError(f"max_param_diff: {len(pa)} parameters against {len(pb)}")
    return max((float((x.detach().float() - y.detach().float().to(x.device)).abs().max())
                for x, y in zip(pa, pb)), default=0.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (linear interpolation, as numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mlp(widths: Sequence[int], seed: int = 0, norm: bool = False) -> torch.nn.Sequential:
    """``Linear`` layers of ``widths`` with GELU between them (and ``LayerNorm`` before each
    GELU when ``norm``), initialised from ``seed``."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers += [torch.nn.LayerNorm(b)] if norm else []
            layers.append(torch.nn.GELU())
    return torch.nn.Sequential(*layers)


def on_device(t: torch.Tensor, device: Any) -> bool:
    """Whether ``t`` lies on ``device`` (``"cuda"`` matches any CUDA index)."""
    dev = torch.device(device)
    return t.device.type == dev.type and (dev.index is None or t.device.index == dev.index)


def fail(figures: dict, message: str) -> None:
    """Record a failed expectation in ``figures["failures"]`` (the check goes on)."""
    figures.setdefault("failures", []).append(message)

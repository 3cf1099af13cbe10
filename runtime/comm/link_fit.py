"""Measure the link of the current process group: latency and bandwidth of the textbook ring
all-reduce (``ir.comm_cost.ring_allreduce_us``) fitted to timed all-reduces of two sizes.

The performance model and the simulator validation both compare predictions with runs on local
gloo ranks; this is the one place that turns timed all-reduces into the ``(α, BW)`` of a
``Cluster``. Call ``measure_ring_link`` on every rank of an initialised process group (it is a
collective); ``fit_ring_link`` is the pure fit.

Example:
    >>> from tidal.runtime.comm.link_fit import fit_ring_link
    >>> fit = fit_ring_link(4, (4096, 8_392_704), (160.0, 6450.0))
    >>> round(fit.latency_us, 1), round(fit.bytes_per_us)
    (26.2, 2000)
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from tidal.runtime.distributed import collective_device

DEFAULT_SIZES = (4096, 8 * 1024 * 1024)
"""Message sizes (bytes) of the two timed all-reduces: one latency-bound, one bandwidth-bound."""


@dataclass(frozen=True)
class RingLink:
    """A fitted link: per-hop latency (µs) and per-GPU bandwidth (bytes/µs) of a ring."""

    latency_us: float
    bytes_per_us: float

    @property
    def bandwidth_gbps(self) -> float:
        """Bandwidth in Gb/s, the unit ``tidal.Cluster`` takes."""
        return self.bytes_per_us * 8 / 1e3


def fit_ring_link(world: int, sizes: Sequence[float], times_us: Sequence[float]) -> RingLink:
    """Fit ``t = 2(p-1)·α + 2(p-1)/p · b/BW`` through two (bytes, µs) points.

    Raises ``ValueError`` when ``world`` < 2 or the sizes are not two distinct values."""
    if world < 2:
        raise ValueError(f"world={world}: a ring link needs at least 2 ranks")
    if len(sizes) != 2 or len(times_us) != 2 or sizes[0] == sizes[1]:
        raise ValueError(f"sizes={tuple(sizes)}, times_us={tuple(times_us)}: need two distinct "
                         "message sizes with one time each")
    (b0, b1), (t0, t1) = sizes, times_us
    steps = 2 * (world - 1)
    per_byte = max((t1 - t0) / (b1 - b0), 1e-12) / (steps / world)
    latency = max(0.0, (t0 - steps / world * b0 * per_byte) / steps)
    return RingLink(latency_us=latency, bytes_per_us=1.0 / per_byte)


def time_allreduce_us(nbytes: int, repeats: int = 15, warmup: int = 2) -> float:
    """Median time (µs) of a float32 all-reduce of ``nbytes`` on the default group, on the
    group's device (:func:`~tidal.runtime.distributed.collective_device`), each timed after a
    barrier; on CUDA until the device has finished it (NCCL returns before). Collective:
    every rank must call it."""
    device = collective_device()
    t = torch.zeros(max(1, nbytes // 4), device=device)

    def finished() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        dist.all_reduce(t)
    times = []
    for _ in range(repeats):
        finished()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        finished()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure_ring_link(sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 15) -> RingLink:
    """Time all-reduces of ``sizes`` on the default group and fit the ring link. Collective."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("measure_ring_link needs an initialised process group "
                           "(run it under torchrun or tidal.runtime.distributed.spawn)")
    times = [time_allreduce_us(int(b), repeats) for b in sizes]
    return fit_ring_link(dist.get_world_size(), sizes, times)

"""The machine a plan is made for."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # only a type here: the CLI's --help must not import torch
    from tidal.ir.device_profile import DeviceProfile


def _default_gpus() -> int:
    """The world size under torchrun (``WORLD_SIZE``), else 1."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class Cluster:
    """GPUs, per-GPU link bandwidth and latency, and an optional device profile.

    ``gpus`` defaults to the world size under ``torchrun``; ``bandwidth_gbps`` is the per-GPU
    link bandwidth in gigabits per second (100 by default, a 100 Gb/s NIC); ``latency_us`` the
    per-transfer latency; ``profile`` a :class:`DeviceProfile` of per-layer times (None: times
    are derived from FLOPs at ``peak_tflops``); ``memory_gb`` the memory budget of one GPU in
    GiB, which passes that size batches to memory read (None: no budget; ``tick_tock`` then
    keeps the batch it is given).

    Example:
        >>> import tidal
        >>> tidal.Cluster(gpus=8, bandwidth_gbps=100).bytes_per_us
        12500.0
    """

    gpus: int = field(default_factory=_default_gpus)
    bandwidth_gbps: float = 100.0
    latency_us: float = 10.0
    profile: Optional[DeviceProfile] = None
    peak_tflops: float = 100.0
    memory_gb: Optional[float] = None

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"Cluster(gpus={self.gpus!r}): gpus must be a positive integer")
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"Cluster(bandwidth_gbps={self.bandwidth_gbps!r}): must be > 0")
        if self.latency_us < 0:
            raise ValueError(f"Cluster(latency_us={self.latency_us!r}): must be >= 0")
        if not self.peak_tflops > 0:
            raise ValueError(f"Cluster(peak_tflops={self.peak_tflops!r}): must be > 0")
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise ValueError(f"Cluster(memory_gb={self.memory_gb!r}): must be > 0 (GiB per GPU)")

    @property
    def bytes_per_us(self) -> float:
        """Link bandwidth in bytes per microsecond."""
        return self.bandwidth_gbps * 1e9 / 8 / 1e6

    def transfer_us(self, nbytes: float) -> float:
        """Time to send ``nbytes`` over one link: latency plus bytes over bandwidth (0 for 0)."""
        return 0.0 if nbytes <= 0 else self.latency_us + nbytes / self.bytes_per_us

    def compute_us(self, flops: float) -> float:
        """Time of ``flops`` at the cluster's peak throughput (the profile-free estimate)."""
        return flops / (self.peak_tflops * 1e6)

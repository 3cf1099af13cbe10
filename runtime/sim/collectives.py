"""Textbook times of collectives on p GPUs with per-GPU link bandwidth and latency.

Times are in microseconds; ``bytes_per_us`` is the per-GPU link bandwidth.

Example:
    >>> from tidal.runtime.sim.collectives import ring_allreduce_us
    >>> ring_allreduce_us(4e6, p=4, bytes_per_us=1e4, latency_us=10)  # 2(p-1)a + 2(p-1)/p * b/BW
    660.0
"""
from __future__ import annotations


def _check(p: int, bytes_per_us: float) -> None:
    if p < 1:
        raise ValueError(f"collective over p={p} GPUs: need p >= 1")
    if not bytes_per_us > 0:
        raise ValueError(f"bytes_per_us={bytes_per_us}: bandwidth must be > 0")


def ring_allreduce_us(nbytes: float, p: int, bytes_per_us: float, latency_us: float) -> float:
    """Ring all-reduce: ``2(p-1)·α + 2(p-1)/p · b/BW`` (reduce-scatter then all-gather);
    0 on one GPU or for no bytes."""
    _check(p, bytes_per_us)
    if p == 1 or nbytes <= 0:
        return 0.0
    return 2 * (p - 1) * latency_us + 2 * (p - 1) / p * nbytes / bytes_per_us


def all_to_all_us(nbytes_per_gpu: float, p: int, bytes_per_us: float, latency_us: float) -> float:
    """All-to-all where each GPU holds ``nbytes_per_gpu`` and keeps 1/p of it:
    ``(p-1)·α + (p-1)/p · b/BW`` (pairwise exchange, full-duplex links)."""
    _check(p, bytes_per_us)
    if p == 1 or nbytes_per_gpu <= 0:
        return 0.0
    return (p - 1) * latency_us + (p - 1) / p * nbytes_per_gpu / bytes_per_us


def scatter_us(total_bytes: float, p: int, bytes_per_us: float, latency_us: float) -> float:
    """One GPU sends ``(p-1)/p`` of ``total_bytes`` to the others over its own link:
    ``(p-1)·α + (p-1)/p · b/BW``. Gather is the mirror image and costs the same."""
    return all_to_all_us(total_bytes, p, bytes_per_us, latency_us)

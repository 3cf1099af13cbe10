"""Communication cost model shared by planners, the performance model and the simulator:
textbook times of collectives on p GPUs with per-GPU link bandwidth and latency, and DDP-style
gradient buckets.

Times are in microseconds; ``bytes_per_us`` is the per-GPU link bandwidth.

Example:
    >>> from tidal.ir.comm_cost import ring_allreduce_us
    >>> ring_allreduce_us(4e6, p=4, bytes_per_us=1e4, latency_us=10)  # 2(p-1)a + 2(p-1)/p * b/BW
    660.0
"""
from __future__ import annotations

import math
from typing import Hashable, Sequence, TypeVar

T = TypeVar("T")
_NO_KEY = object()  # the key before the first item: every item's key differs from it

DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""PyTorch DDP's default gradient bucket size."""


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


def tree_broadcast_us(nbytes: float, p: int, bytes_per_us: float, latency_us: float) -> float:
    """Binomial-tree broadcast (gloo's algorithm) of ``nbytes`` from one GPU to ``p``:
    ``ceil(log2 p)`` rounds of ``α + b/BW``; 0 on one GPU or for no bytes."""
    _check(p, bytes_per_us)
    if p == 1 or nbytes <= 0:
        return 0.0
    return math.ceil(math.log2(p)) * (latency_us + nbytes / bytes_per_us)


def all_gather_us(nbytes_per_gpu: float, p: int, bytes_per_us: float, latency_us: float) -> float:
    """Ring all-gather of ``nbytes_per_gpu`` from every GPU: ``(p-1)·α + (p-1) · b/BW``."""
    _check(p, bytes_per_us)
    if p == 1 or nbytes_per_gpu <= 0:
        return 0.0
    return (p - 1) * latency_us + (p - 1) * nbytes_per_gpu / bytes_per_us


def bucket_partition(sizes: Sequence[float], cap_bytes: float = DDP_BUCKET_BYTES
                     ) -> tuple[tuple[int, ...], ...]:
    """Indices of ``sizes`` (bytes, in the order gradients become ready) grouped into buckets
    as DDP groups them (``compute_bucket_assignment_by_size``): each gradient joins the open
    bucket, which closes once it holds ``cap_bytes`` or more (so a bucket may pass the cap by
    its last gradient; fewer, larger all-reduces than "at most the cap").

    Example:
        >>> bucket_partition([4, 4, 8, 1], cap_bytes=8)
        ((0, 1), (2,), (3,))
        >>> bucket_partition([1, 10, 1], cap_bytes=8)
        ((0, 1), (2,))
    """
    if not cap_bytes > 0:
        raise ValueError(f"bucket cap {cap_bytes!r} bytes: must be > 0")
    buckets: list[list[int]] = [[]]
    filled = 0.0
    for i, size in enumerate(sizes):
        buckets[-1].append(i)
        filled += size
        if filled >= cap_bytes:
            buckets.append([])
            filled = 0.0
    return tuple(tuple(b) for b in buckets if b)


def gradient_buckets(items: Sequence[tuple[Hashable, T, float]],
                     cap_bytes: float = DDP_BUCKET_BYTES) -> list[tuple[Hashable, list[T]]]:
    """The one gradient-bucket rule (the planner, the runtime's builders and the simulator all
    call it): ``items`` are ``(key, value, bytes)`` in the order the gradients are issued
    (backward order); ``key`` says who syncs them (the set of ranks, and whatever else must not
    share a bucket). Consecutive items with equal keys form a run; an item of 0 bytes is not
    synced (no gradient, or a single rank) but its key still ends the run before it when it
    differs; each run is cut into buckets closed once they hold ``cap_bytes`` or more, as
    DDP closes them (:func:`bucket_partition`). Returns ``(key, values)`` per bucket, in issue order.

    Example:
        >>> gradient_buckets([("ab", "w2", 8), ("ab", "b2", 0), ("a", "w1", 8), ("ab", "w0", 8)],
        ...                  cap_bytes=100)
        [('ab', ['w2']), ('a', ['w1']), ('ab', ['w0'])]
        >>> gradient_buckets([("ab", "w2", 8), ("ab", "w1", 8), ("ab", "w0", 8)], cap_bytes=16)
        [('ab', ['w2', 'w1']), ('ab', ['w0'])]
    """
    runs: list[tuple[Hashable, list[tuple[T, float]]]] = []
    current: object = _NO_KEY
    for key, value, nbytes in items:
        if key != current:
            runs.append((key, []))
            current = key
        if nbytes > 0:
            runs[-1][1].append((value, nbytes))
    return [(key, [run[k][0] for k in part]) for key, run in runs if run
            for part in bucket_partition([b for _, b in run], cap_bytes)]


def ddp_buckets(sizes: Sequence[tuple[str, float]], cap_bytes: float = DDP_BUCKET_BYTES
                ) -> tuple[tuple[str, ...], ...]:
    """DDP's buckets of named gradients: ``sizes`` are ``(name, bytes)`` in registration
    order; backward issues them in reverse and every rank syncs every one, so the one rule
    (:func:`gradient_buckets`) cuts the reversed names into buckets closed at ``cap_bytes``
    (a gradient of 0 bytes has nothing to sync and is in none).

    Example:
        >>> ddp_buckets([("w0", 8), ("b0", 4), ("w1", 8), ("empty", 0)], cap_bytes=12)
        (('w1', 'b0'), ('w0',))
    """
    return tuple(tuple(names) for _, names in gradient_buckets(
        [(None, name, nbytes) for name, nbytes in reversed(sizes)], cap_bytes))

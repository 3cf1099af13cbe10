"""When does gradient compression pay? The performance model of "On the utility of gradient
compression" (dissertation ch. 4, §4.2.4.1, Eq. 4.1).

Sync SGD (DDP): gradients are bucketed (25 MiB by default) and each bucket is all-reduced as
soon as the backward pass has produced it, so all but the last bucket overlap the backward::

    T_obs = max(gamma T_comp, sum_{i<k} T_comm(b_i, p, BW)) + T_comm(b_k, p, BW)
    T_comm(b, p, BW) = 2 alpha (p - 1) + 2 b (p - 1) / (p BW)          (Eq. 4.1, ring all-reduce)

(the paper's ``(k - 1) T_comm(b)`` for k - 1 equal buckets, generalized to unequal ones), where
``gamma`` is the slowdown of a backward pass that overlaps communication (1.04-1.1 observed).
A step is ``T_fwd + T_obs``.

Compressed: compression is not overlapped with the backward (§4.2.1: overlapping is slower on a
GPU, both compete for compute), so a step is ``T_fwd + T_comp + T_encode_decode + T_comm'``,
with ``T_comm'`` the collectives of the compressed buckets: ``rounds`` ring all-reduces for an
all-reduce compatible compressor (PowerSGD: 2), else a ring all-gather,
``alpha (p - 1) + b (p - 1) / BW``, whose cost grows with p.

Units: seconds and bytes; the machine is a :class:`tidal.Cluster` (``gpus``, ``bandwidth_gbps``
per GPU, ``latency_us`` = alpha).

Example:
    >>> from tidal.ir.cluster import Cluster
    >>> from tidal.ir.perf_model import Workload, CompressorCost, sync_sgd_step, compressed_step
    >>> work = Workload.uniform(fwd_s=0.1, bwd_s=0.2, total_bytes=100e6)
    >>> slow = Cluster(gpus=64, bandwidth_gbps=1, latency_us=10)
    >>> ps = CompressorCost.ratio("powersgd:4", work, ratio=100, encode_decode_s=0.05,
    ...                           all_reduce=True, rounds=2)
    >>> sync, comp = sync_sgd_step(work, slow), compressed_step(work, ps, slow)
    >>> round(sync.total_s, 3), round(comp.total_s, 3)
    (1.68, 0.376)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Optional, Sequence

from tidal.ir import comm_cost
from tidal.ir.cluster import Cluster
from tidal.ir.comm_cost import DDP_BUCKET_BYTES

MIB = 2 ** 20

DEFAULT_GAMMA = 1.05
"""Backward slowdown under overlapped all-reduce; the paper observes 1.04 to 1.1."""

PAPER_TABLE_4_1_MS = MappingProxyType({
    "MS-TopK-1%": (103.0, False), "DGC-1%": (221.0, False), "TopK-1%": (273.0, False),
    "RandomK-1%": (163.0, True), "SignSGD": (16.0, False), "QSGD-2bit": (39.0, False),
    "TernGrad": (94.0, False), "PowerSGD-Rank4": (45.0, True), "ATOMO-Rank4": (1586.0, False),
})
"""Table 4.1: encode+decode time (ms) of each method for ResNet-50 on V100 GPUs, and whether it
is all-reduce compatible."""


def ring_all_reduce_s(nbytes: float, cluster: Cluster) -> float:
    """Eq. 4.1: ``2 alpha (p - 1) + 2 b (p - 1) / (p BW)`` (0 with one GPU or no bytes)."""
    return comm_cost.ring_allreduce_us(nbytes, cluster.gpus, cluster.bytes_per_us,
                                       cluster.latency_us) / 1e6


def all_gather_s(nbytes: float, cluster: Cluster) -> float:
    """Ring all-gather of ``nbytes`` per rank: ``alpha (p - 1) + b (p - 1) / BW``."""
    return comm_cost.all_gather_us(nbytes, cluster.gpus, cluster.bytes_per_us,
                                   cluster.latency_us) / 1e6


bucket_partition = comm_cost.bucket_partition


@dataclass(frozen=True)
class Workload:
    """One GPU's forward and backward time at its batch, and the gradient bytes of each bucket
    in the order the backward produces them."""

    fwd_s: float
    bwd_s: float
    bucket_bytes: tuple[float, ...]

    @classmethod
    def uniform(cls, fwd_s: float, bwd_s: float, total_bytes: float,
                cap_bytes: float = DDP_BUCKET_BYTES) -> "Workload":
        """The paper's buckets: ``k - 1`` of size ``b = cap`` and a last one ``b^ <= b``."""
        k = max(1, math.ceil(total_bytes / cap_bytes))
        return cls(fwd_s, bwd_s, (float(cap_bytes),) * (k - 1)
                   + (float(total_bytes - (k - 1) * cap_bytes),))

    @classmethod
    def from_tensors(cls, fwd_s: float, bwd_s: float, tensor_bytes: Sequence[int],
                     cap_bytes: float = DDP_BUCKET_BYTES) -> "Workload":
        """Buckets built by :func:`bucket_partition` from per-tensor gradient bytes."""
        parts = bucket_partition(tensor_bytes, cap_bytes)
        return cls(fwd_s, bwd_s, tuple(float(sum(tensor_bytes[i] for i in b)) for b in parts))

    @property
    def total_bytes(self) -> float:
        """Gradient bytes per step."""
        return sum(self.bucket_bytes)

    def scaled(self, compute: float = 1.0) -> "Workload":
        """The same model on a device ``compute`` times faster."""
        return Workload(self.fwd_s / compute, self.bwd_s / compute, self.bucket_bytes)


@dataclass(frozen=True)
class CompressorCost:
    """What the model needs of a compressor: the payload of each bucket (bytes one rank sends
    per round), its encode+decode time per step, all-reduce compatibility and rounds."""

    name: str
    payload_bytes: tuple[float, ...]
    encode_decode_s: float
    all_reduce: bool
    rounds: int = 1

    @classmethod
    def ratio(cls, name: str, work: Workload, ratio: float, encode_decode_s: float,
              all_reduce: bool, rounds: int = 1) -> "CompressorCost":
        """A compressor that shrinks every bucket ``ratio`` times in total over its rounds."""
        if not ratio > 0:
            raise ValueError(f"compression ratio {ratio!r}: must be > 0")
        return cls(name, tuple(b / ratio / rounds for b in work.bucket_bytes), encode_decode_s,
                   all_reduce, rounds)

    @property
    def total_payload(self) -> float:
        """Bytes one rank sends per step over all rounds."""
        return sum(self.payload_bytes) * self.rounds


@dataclass(frozen=True)
class StepTime:
    """A predicted iteration: total and its parts (seconds). ``comm_s`` is all communication,
    ``exposed_s`` what of the step is not forward or plain backward compute."""

    total_s: float
    fwd_s: float
    bwd_s: float
    comm_s: float
    encode_decode_s: float = 0.0

    @property
    def exposed_s(self) -> float:
        """Time beyond forward + backward compute."""
        return self.total_s - self.fwd_s - self.bwd_s


def sync_sgd_step(work: Workload, cluster: Cluster, gamma: float = DEFAULT_GAMMA) -> StepTime:
    """Predicted DDP step: ``T_fwd + max(gamma T_comp, sum_{i<k} T_comm(b_i)) + T_comm(b_k)``."""
    if cluster.gpus == 1:
        return StepTime(work.fwd_s + work.bwd_s, work.fwd_s, work.bwd_s, 0.0)
    comms = [ring_all_reduce_s(b, cluster) for b in work.bucket_bytes]
    t_obs = max(gamma * work.bwd_s, sum(comms[:-1])) + comms[-1]
    return StepTime(work.fwd_s + t_obs, work.fwd_s, work.bwd_s, sum(comms))


def compressed_step(work: Workload, comp: CompressorCost, cluster: Cluster) -> StepTime:
    """Predicted compressed step: ``T_fwd + T_comp + T_encode_decode + T_comm(compressed)``."""
    if cluster.gpus == 1:
        return StepTime(work.fwd_s + work.bwd_s, work.fwd_s, work.bwd_s, 0.0)
    one: Callable[[float, Cluster], float] = ring_all_reduce_s if comp.all_reduce \
        else all_gather_s
    comm = sum(comp.rounds * one(b, cluster) for b in comp.payload_bytes)
    return StepTime(work.fwd_s + work.bwd_s + comp.encode_decode_s + comm, work.fwd_s,
                    work.bwd_s, comm, comp.encode_decode_s)


def speedup(work: Workload, comp: CompressorCost, cluster: Cluster,
            gamma: float = DEFAULT_GAMMA) -> float:
    """Sync SGD step time over compressed step time (> 1: compression pays)."""
    return sync_sgd_step(work, cluster, gamma).total_s / compressed_step(work, comp,
                                                                         cluster).total_s


def _with_bandwidth(cluster: Cluster, gbps: float) -> Cluster:
    return Cluster(gpus=cluster.gpus, bandwidth_gbps=gbps, latency_us=cluster.latency_us,
                   profile=cluster.profile, peak_tflops=cluster.peak_tflops)


def crossover_bandwidth_gbps(work: Workload, comp: CompressorCost, cluster: Cluster,
                             gamma: float = DEFAULT_GAMMA, lo: float = 1e-3, hi: float = 1e5
                             ) -> Optional[float]:
    """The per-GPU bandwidth (Gb/s) above which sync SGD is faster than the compressor, or None
    when one of them wins over the whole range [lo, hi] (geometric bisection)."""
    def gain(gbps: float) -> float:
        c = _with_bandwidth(cluster, gbps)
        return sync_sgd_step(work, c, gamma).total_s - compressed_step(work, comp, c).total_s

    if cluster.gpus == 1 or not (gain(lo) > 0 > gain(hi)):
        return None
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gain(mid) > 0 else (lo, mid)
    return math.sqrt(lo * hi)


NEAR_LINEAR_TOLERANCE = 0.10
""""Near-linear" scaling: a step at most 10 % longer than the single-GPU step (weak-scaling
efficiency >= 1 / 1.1 = 91 %). The dissertation gives no number; this is the convention here."""


def required_compression(work: Workload, cluster: Cluster, gamma: float = DEFAULT_GAMMA,
                         tolerance: float = NEAR_LINEAR_TOLERANCE, max_ratio: float = 1e6
                         ) -> Optional[float]:
    """The compression ratio needed for near-linear scaling (dissertation Figs. 4.8 and 4.11).

    Weak scaling is linear when a step on p GPUs takes as long as the step on one GPU,
    ``T_fwd + T_comp`` (each GPU keeps its batch, so p GPUs do p times the work). The paper asks
    how much the gradient must shrink for that with an ideal compressor: every bucket sent
    ``c`` times smaller, still all-reduced, bucketed and overlapped with the backward like sync
    SGD (Eq. 4.1 with ``b / c``), at no encode/decode cost. This returns the smallest ``c >= 1``
    with ``T_fwd + max(gamma T_comp, sum_{i<k} T_comm(b_i / c)) + T_comm(b_k / c) <=
    (1 + tolerance)(T_fwd + T_comp)``; 1.0 when sync SGD already scales near-linearly; None when
    no ratio does (latency alone, or ``gamma`` beyond the tolerance, rules it out)."""
    if not tolerance >= 0:
        raise ValueError(f"near-linear tolerance {tolerance!r}: must be >= 0")
    target = (1 + tolerance) * (work.fwd_s + work.bwd_s)

    def step(ratio: float) -> float:
        w = Workload(work.fwd_s, work.bwd_s, tuple(b / ratio for b in work.bucket_bytes))
        return sync_sgd_step(w, cluster, gamma).total_s

    if step(1.0) <= target:
        return 1.0
    if step(max_ratio) > target:
        return None
    lo, hi = 1.0, max_ratio
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if step(mid) > target else (lo, mid)
    return hi

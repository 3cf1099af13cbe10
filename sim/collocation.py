"""A background job packed around a foreground iteration (DeepPool §5).

The foreground runs at high priority, slowed by an ``interference`` factor on every compute
piece (DeepPool measures < 18 % foreground loss). The background job, with its own per-GPU
iteration time and batch, always runs in each GPU's idle compute time. Two models of what it
gets while the foreground computes bracket DeepPool's concurrent priority streams:

* idle time only (``fg_utilization=None``): a lower bound;
* SM sharing: each foreground piece uses a share ``u`` of the GPU's capacity (its throughput
  over the best the layer reaches at any batch, ``kernel_utilization``); the background
  progresses in the rest at ``min(1 - u, U_bg)`` of full capacity, where ``U_bg`` is its own
  utilization alone (it never runs faster than alone). This is an upper bound: it assumes the
  two streams' kernels share the SMs perfectly, which DeepPool's non-preemptive device does not.

Example:
    >>> from tidal.ir.program import COMPUTE, Piece, Program
    >>> from tidal.sim.collocation import BackgroundJob, collocate
    >>> fg = Program((Piece("f", COMPUTE, duration_us=60.0, ranks=(0,)),
    ...               Piece("g", COMPUTE, duration_us=20.0, ranks=(1,))), world=2)
    >>> r = collocate(fg, gpus=2, global_batch=8, bg=BackgroundJob(iteration_us=10.0, batch=4))
    >>> round(r.bg_samples_per_iteration, 2)  # GPU 1 idles 40 us of the 60 us iteration
    16.0
    >>> half = {"f": 0.5, "g": 0.5}  # both pieces leave half the GPU unused
    >>> bg = BackgroundJob(iteration_us=10.0, batch=4, utilization=0.5)
    >>> round(collocate(fg, 2, 8, bg, fg_utilization=half).bg_samples_per_iteration, 2)
    48.0
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional, Sequence

from tidal.ir.program import Program
from tidal.sim.engine import is_compute_lane, lane_of
from tidal.sim.programs import LayerTimes, SimResult, summarize

PROBE_BATCHES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class BackgroundJob:
    """A low-priority job: one iteration of ``batch`` samples takes ``iteration_us`` alone on
    one GPU, using on average ``utilization`` (0..1] of the GPU's capacity."""

    iteration_us: float
    batch: int
    utilization: float = 1.0

    def __post_init__(self) -> None:
        if not self.iteration_us > 0 or self.batch < 1:
            raise ValueError(f"BackgroundJob(iteration_us={self.iteration_us}, "
                             f"batch={self.batch}): need a positive time and batch")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"BackgroundJob(utilization={self.utilization}): must be in (0, 1]")

    def solo_throughput(self, gpus: int) -> float:
        """Samples/s when each of ``gpus`` GPUs runs only this job (DeepPool's "BG only")."""
        return gpus * self.batch / self.iteration_us * 1e6


@dataclass(frozen=True)
class CollocationResult:
    """Foreground timeline with interference, and the background work packed around it."""

    foreground: SimResult
    bg_samples_per_iteration: float

    @property
    def bg_throughput(self) -> float:
        """Background samples per second."""
        it = self.foreground.iteration_us
        return self.bg_samples_per_iteration / it * 1e6 if it else 0.0

    @property
    def cluster_throughput(self) -> float:
        """Foreground plus background samples per second."""
        return self.foreground.throughput + self.bg_throughput


def kernel_utilization(times_at: Callable[[int], LayerTimes], batch: int,
                       probes: Sequence[int] = PROBE_BATCHES) -> dict[str, tuple[float, float]]:
    """Per layer, the (forward, backward) share of the GPU's capacity it uses at ``batch``
    samples: ``batch x (least time per sample over the probe batches) / time at batch``, so 1
    where the layer already runs at its best throughput (or scales linearly, as FLOP-derived
    times do) and small where a small batch leaves the GPU mostly unused."""
    if batch < 1:
        raise ValueError(f"kernel_utilization(batch={batch}): need at least one sample")
    at = times_at(batch)
    best: dict[str, list[float]] = {n: [f / batch, b / batch]
                                    for n, f, b in zip(at.names, at.fwd_us, at.bwd_us)}
    for p in probes:
        lt = times_at(p)
        for n, f, b in zip(lt.names, lt.fwd_us, lt.bwd_us):
            if n in best:
                best[n] = [min(best[n][0], f / p), min(best[n][1], b / p)]

    def share(per_sample: float, t: float) -> float:
        return min(1.0, batch * per_sample / t) if t > 0 else 1.0

    return {n: (share(best[n][0], f), share(best[n][1], b))
            for n, f, b in zip(at.names, at.fwd_us, at.bwd_us)}


def job_utilization(times_at: Callable[[int], LayerTimes], batch: int,
                    probes: Sequence[int] = PROBE_BATCHES) -> float:
    """Time-weighted mean of ``kernel_utilization`` over a whole forward+backward at
    ``batch``: the average share of the GPU the job uses when it runs alone."""
    lt = times_at(batch)
    util = kernel_utilization(times_at, batch, probes)
    total = sum(lt.fwd_us) + sum(lt.bwd_us)
    if total <= 0:
        return 1.0
    used = sum(f * util[n][0] + b * util[n][1] for n, f, b in zip(lt.names, lt.fwd_us, lt.bwd_us))
    # a mean of shares in [0, 1]; summed in another order than ``total`` it can round above 1
    return min(1.0, max(used / total, 1e-6))


def collocate(program: Program, gpus: int, global_batch: int, bg: BackgroundJob,
              interference: float = 1.0,
              fg_utilization: Optional[Mapping[str, float]] = None) -> CollocationResult:
    """Simulate the foreground's placed ``program`` (``tidal.sim.engine``) with compute slowed
    by ``interference`` (>= 1), fill every GPU's idle compute time with background iterations
    and, with ``fg_utilization`` (piece name -> share of the GPU the piece uses; missing names
    count as 1), let the background also use what each foreground piece leaves unused (the
    SM-sharing bound)."""
    if interference < 1:
        raise ValueError(f"interference={interference}: must be >= 1 (1 = no slowdown)")
    slowed = tuple(replace(p, duration_us=p.duration_us * interference)
                   if is_compute_lane(lane_of(p)) else p for p in program.pieces)
    fg = summarize(Program(slowed, program.world), gpus, global_batch)
    idle = sum(max(0.0, fg.iteration_us - b) for b in fg.busy_us)
    iterations = idle / bg.iteration_us
    if fg_utilization is not None:
        shared = sum((i.end_us - i.start_us) * min(1.0 - fg_utilization.get(i.name, 1.0),
                                                   bg.utilization)
                     for i in fg.intervals if is_compute_lane(i.lane))
        iterations += shared / (bg.iteration_us * bg.utilization)
    return CollocationResult(fg, iterations * bg.batch)


def idle_spans(busy: Sequence[tuple[float, float]], start_us: Optional[float] = None,
               end_us: Optional[float] = None) -> list[float]:
    """The lengths of the gaps between ``busy`` ``(start, end)`` intervals of one device (a
    rank's foreground compute pieces, measured or simulated), from ``start_us`` to ``end_us``
    (default: the first start and the last end), in time order.

    >>> idle_spans([(0.0, 2.0), (5.0, 6.0), (1.0, 3.0), (9.0, 10.0)])
    [2.0, 3.0]
    """
    spans: list[float] = []
    ordered = sorted(busy)
    if not ordered:
        return spans
    t = ordered[0][0] if start_us is None else start_us
    for s, e in ordered:
        if s > t:
            spans.append(s - t)
        t = max(t, e)
    stop = t if end_us is None else end_us
    if stop > t:
        spans.append(stop - t)
    return spans


def pieces_that_fit(spans_us: Sequence[float], piece_us: float) -> int:
    """How many background pieces of ``piece_us`` fit in the idle spans when each runs only
    inside one span, as the runtime's ``idle_only`` policy dispatches them.

    >>> pieces_that_fit([10.0, 3.0, 7.5], 2.5)
    8
    """
    if not piece_us > 0:
        raise ValueError(f"pieces_that_fit(piece_us={piece_us!r}): must be > 0")
    return sum(int(s // piece_us) for s in spans_us)


def best_background_batch(spans_us: Sequence[float], step_us: Mapping[int, float],
                          overhead_us: float = 0.0, delay_us: float = math.inf,
                          min_share: float = 0.0) -> tuple[int, float]:
    """The background batch (a key of ``step_us``: batch -> one background step's time alone)
    that turns the most of the idle ``spans_us`` into samples, each step plus ``overhead_us``
    (the dispatch between two pieces) fitting inside one span, and the samples it predicts
    (over the spans given). ``delay_us`` bounds the foreground's delay: a step may overrun
    its span's end at most once per span it runs in, so the steps of a batch that runs in
    ``n`` spans must be no longer than ``delay_us / n``. A batch whose steps would fill less
    than ``min_share`` of the idle time does not pay for its risk to the foreground. Ties go
    to the smaller batch (shorter pieces); ``(0, 0.0)`` when no batch qualifies (run no
    background there).

    >>> best_background_batch([10.0, 3.0], {1: 1.0, 4: 2.5, 16: 12.0})
    (4, 20.0)
    >>> best_background_batch([10.0, 3.0], {1: 1.0, 4: 2.5, 16: 12.0}, delay_us=4.0)
    (1, 13.0)
    >>> best_background_batch([1.0, 0.5], {1: 0.8}, min_share=0.6)
    (0, 0.0)
    """
    if not step_us:
        raise ValueError("best_background_batch: no batch sizes timed")
    idle = sum(spans_us)
    scored = []
    for b, t in step_us.items():
        fits = pieces_that_fit(spans_us, t + overhead_us)
        used = sum(1 for s in spans_us if s >= t + overhead_us)
        if not fits or t > delay_us / used or fits * t < min_share * idle:
            continue
        scored.append((fits * b, -b))
    if not scored:
        return 0, 0.0
    samples, neg = max(scored)
    return -neg, float(samples)


def job_idle_spans(records: Sequence, job: str) -> list[float]:
    """The idle spans of ``job``'s device over its iterations, from a scheduler's trace
    (``tidal.runtime.scheduler.TraceRecord``: ``Runtime.trace``, ``Compiled.train_trace``):
    per iteration, the gaps between its compute pieces from its first piece's start to its
    last piece's end.

    >>> from tidal.runtime.scheduler import TraceRecord
    >>> rec = lambda name, kind, it, s, e: TraceRecord("fg", "high", name, kind, it, s, s, s, e)
    >>> job_idle_spans([rec("f", "compute", 0, 0, 4), rec("x", "point_to_point", 0, 4, 9),
    ...                 rec("g", "compute", 0, 9, 10), rec("f", "compute", 1, 12, 13)], "fg")
    [5.0]
    """
    by_iteration: dict[int, list] = {}
    for r in records:
        if r.job == job and r.error is None:
            by_iteration.setdefault(r.iteration, []).append(r)
    spans: list[float] = []
    for rs in by_iteration.values():
        device = [(float(r.start_us), float(r.end_us)) for r in rs if r.kind == "compute"]
        if device:
            spans += idle_spans(device, min(r.start_us for r in rs), max(r.end_us for r in rs))
    return spans

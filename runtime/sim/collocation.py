"""A background job packed into the idle compute time of a foreground iteration (DeepPool §5).

The foreground runs at high priority, slowed by an ``interference`` factor on every compute
piece (DeepPool measures < 18 % foreground loss); the background job, with its own per-GPU
iteration time and batch, runs in each GPU's idle compute time and completes
``idle / bg_iteration`` of its iterations per foreground iteration.

Example:
    >>> from tidal.runtime.sim.collocation import BackgroundJob, collocate
    >>> from tidal.runtime.sim.engine import Task
    >>> fg = [Task("f", "fg", "compute", (0,), 60.0), Task("g", "fg", "compute", (1,), 20.0)]
    >>> r = collocate(fg, gpus=2, global_batch=8, bg=BackgroundJob(iteration_us=10.0, batch=4))
    >>> round(r.bg_samples_per_iteration, 2)  # GPU 1 idles 40 us of the 60 us iteration
    16.0
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from tidal.runtime.sim.engine import Task
from tidal.runtime.sim.programs import SimResult, summarize


@dataclass(frozen=True)
class BackgroundJob:
    """A low-priority job: one iteration of ``batch`` samples takes ``iteration_us`` alone on
    one GPU."""

    iteration_us: float
    batch: int

    def __post_init__(self) -> None:
        if not self.iteration_us > 0 or self.batch < 1:
            raise ValueError(f"BackgroundJob(iteration_us={self.iteration_us}, "
                             f"batch={self.batch}): need a positive time and batch")

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


def collocate(tasks: Sequence[Task], gpus: int, global_batch: int, bg: BackgroundJob,
              interference: float = 1.0) -> CollocationResult:
    """Simulate foreground ``tasks`` with compute slowed by ``interference`` (>= 1) and fill
    every GPU's idle compute time with background iterations."""
    if interference < 1:
        raise ValueError(f"interference={interference}: must be >= 1 (1 = no slowdown)")
    slowed = [replace(t, duration_us=t.duration_us * interference) if t.kind == "compute" else t
              for t in tasks]
    fg = summarize(slowed, gpus, global_batch)
    idle = sum(max(0.0, fg.iteration_us - b) for b in fg.busy_us)
    return CollocationResult(fg, idle / bg.iteration_us * bg.batch)

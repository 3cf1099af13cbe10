"""What the scheduler reports: per-job statistics (:class:`JobStats`), one
:class:`TraceRecord` per dispatched piece, the per-job summary table (:func:`summary`) and the
device-busy profile (:func:`busy_fraction`).

Example:
    >>> s = JobStats("fg", "high", iterations=4, first_us=0.0, last_us=2e6)
    >>> s.throughput, s.mean_slowdown
    (2.0, 1.0)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from tidal.ir.table import format_table


@dataclass
class JobStats:
    """What a job did: iterations and pieces completed, device-busy µs, iteration times,
    foreground slowdowns per piece (against isolated times), the error that stopped it, and
    when (backend µs) a background job was upgraded to the foreground (``upgraded_us``)."""

    name: str
    priority: str
    iterations: int = 0
    pieces: int = 0
    busy_us: float = 0.0
    first_us: Optional[float] = None
    last_us: Optional[float] = None
    iteration_us: list[float] = field(default_factory=list)
    slowdowns: list[float] = field(default_factory=list)
    max_outstanding: int = 0
    held: int = 0
    feedback_pauses: int = 0
    error: Optional[str] = None
    upgraded_us: Optional[float] = None

    @property
    def throughput(self) -> float:
        """Iterations per second over the job's active span (0 if none)."""
        if not self.iterations or self.first_us is None or self.last_us <= self.first_us:
            return 0.0
        return self.iterations / ((self.last_us - self.first_us) * 1e-6)

    @property
    def mean_slowdown(self) -> float:
        """Mean of the recorded per-piece slowdowns (1.0 if none)."""
        return sum(self.slowdowns) / len(self.slowdowns) if self.slowdowns else 1.0


@dataclass(frozen=True)
class TraceRecord:
    """One dispatched piece: when it was dispatched, became ready, started and ended (µs on
    the backend clock), whether background work was on the device meanwhile (foreground
    pieces), its slowdown against the isolated time, and its error. ``kind``: the piece's
    operator class (``tidal.runtime.scheduling.pieces.operator_class``)."""

    job: str
    priority: str
    piece: str
    kind: str
    iteration: int
    dispatch_us: float
    ready_us: float
    start_us: float
    end_us: float
    collocated: bool = False
    slowdown: Optional[float] = None
    error: Optional[str] = None
    stream: str = ""
    index: int = -1


def summary(handles: Sequence[Any], sensitive: set[tuple[str, str]]) -> str:
    """Per-job table of ``handles`` (``JobHandle``): iterations, throughput, mean iteration
    ms, device-busy share, foreground slowdown, feedback pauses, errors; then the
    ``sensitive`` pieces."""
    rows = []
    for h in handles:
        s = h.stats
        span = (s.last_us - s.first_us) if s.first_us is not None and s.last_us else 0.0
        mean_it = sum(s.iteration_us) / len(s.iteration_us) / 1e3 if s.iteration_us else 0
        rows.append([s.name, s.priority, s.iterations, s.pieces, round(s.throughput, 2),
                     round(mean_it, 3), round(100 * s.busy_us / span, 1) if span else 0.0,
                     round(s.mean_slowdown, 3) if h.foreground else "-",
                     s.max_outstanding, s.feedback_pauses, s.held, s.error or "-"])
    table = format_table(["job", "prio", "iters", "pieces", "iters/s", "iter ms",
                          "busy %", "fg slowdown", "max out", "pauses", "held", "error"], rows)
    if sensitive:
        table += "\nsensitive pieces: " + ", ".join(f"{j}/{p}" for j, p in sorted(sensitive))
    return table


def busy_fraction(trace: Sequence[TraceRecord], stats: Sequence[JobStats]) -> dict[str, float]:
    """The GpuOpManager's profile: each job's device-busy time (``stats``) as a share of the
    run's span (first start to last end in ``trace``), and ``"idle"``: the share no job's
    piece covered (intervals merged).

    Example:
        >>> f = TraceRecord("fg", "high", "f", "compute", 0, 0.0, 0.0, 0.0, 2.0)
        >>> g = TraceRecord("fg", "high", "g", "compute", 0, 3.0, 3.0, 3.0, 4.0)
        >>> busy_fraction([f, g], [JobStats("fg", "high", busy_us=3.0)])
        {'fg': 0.75, 'idle': 0.25}
    """
    if not trace:
        return {"idle": 1.0}
    start = min(r.start_us for r in trace)
    span = max(r.end_us for r in trace) - start
    if span <= 0:
        return {"idle": 1.0}
    shares = {s.name: s.busy_us / span for s in stats}
    covered, reach = 0.0, start
    for r in sorted(trace, key=lambda r: r.start_us):
        lo = max(r.start_us, reach)
        if r.end_us > lo:
            covered += r.end_us - lo
            reach = r.end_us
    shares["idle"] = max(0.0, 1.0 - covered / span)
    return shares


def count_piece(stats: JobStats, uses_device: bool, start_us: float, end_us: float) -> None:
    """Account one piece that ended without error in ``stats``: pieces, device-busy time
    (device pieces), the job's last end."""
    stats.pieces += 1
    if uses_device:
        stats.busy_us += end_us - start_us
    stats.last_us = max(stats.last_us or 0.0, end_us)

"""Durations the scheduler learns and the slowdown feedback loop (DeepPool §5): every
foreground piece's time in isolation (median of its last few runs without background work on
the device), background pieces' recent durations, and the foreground pieces found
*sensitive*: slowed more than ``target_slowdown`` while background work shared the device
(or of a kind declared sensitive). Predictions for the dispatch decisions come from here.

Example:
    >>> t = Timings(sensitive_kinds=(), target_slowdown=1.1, feedback=True)
    >>> for took in (10.0, 30.0, 20.0):
    ...     t.observe(("fg", "f"), took)
    >>> t.isolated_us[("fg", "f")]
    20.0
"""
from __future__ import annotations

import collections
import math
from typing import Callable, Optional, Sequence

from tidal.runtime.scheduling.handle import JobHandle, Queued


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (not empty): the middle one, or the mean of the two middle
    ones for an even count (as ``statistics.median``, without its overhead).

    Example:
        >>> median([3.0, 1.0, 2.0]), median([4.0, 1.0, 3.0, 2.0])
        (2.0, 2.5)
    """
    ordered = sorted(values)
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


class Timings:
    """Isolated and recent durations by (job, piece name), the sensitive pieces, and the
    background's recent device spans (see the module docstring)."""

    def __init__(self, sensitive_kinds: Sequence[str], target_slowdown: float, feedback: bool):
        self.sensitive_kinds = frozenset(sensitive_kinds)
        self.target_slowdown = target_slowdown
        self.feedback = feedback
        self.isolated_us: dict[tuple[str, str], float] = {}
        self.samples: dict[tuple[str, str], collections.deque] = {}
        self.sensitive: set[tuple[str, str]] = set()
        self.background_spans: collections.deque[tuple[float, float]] = \
            collections.deque(maxlen=256)

    def observe(self, key: tuple[str, str], took: float) -> None:
        """Record an isolated duration; the estimate is the median of the last few (robust
        to a noisy host)."""
        samples = self.samples.setdefault(key, collections.deque(maxlen=5))
        samples.append(took)
        self.isolated_us[key] = median(samples)

    def bound(self, h: JobHandle, q: Queued, pick: Callable) -> float:
        """``pick`` (min or max) of the piece's recent isolated durations (0 if none)."""
        samples = self.samples.get((h.name, q.piece.name))
        return pick(samples) if samples else 0.0

    def isolated(self, h: JobHandle, q: Queued) -> float:
        """The piece's isolated duration (its estimated ``duration_us`` before any run)."""
        return self.isolated_us.get((h.name, q.piece.name), q.piece.duration_us)

    def estimate(self, h: JobHandle, q: Queued) -> float:
        """A background piece's duration for the idle-span test: its longest recent one."""
        return self.bound(h, q, max) or h.mean_piece_us() or q.piece.duration_us

    def predicted_end(self, h: JobHandle, q: Queued, now: float) -> float:
        """The earliest end of ``q`` its recent durations support (the shortest of them: a
        background piece that fits before it rarely delays the foreground)."""
        took = self.bound(h, q, min) or self.isolated(h, q)
        if q.launch is None or not q.launch.started:
            return now + took
        return max(now, q.launch.start_us + took)

    def is_sensitive(self, h: JobHandle, q: Queued) -> bool:
        """Whether foreground piece ``q`` of job ``h`` pauses background dispatch."""
        return q.kind in self.sensitive_kinds or (h.name, q.piece.name) in self.sensitive

    def next_sensitive_start(self, fg: JobHandle, now: float) -> float:
        """Predicted start of the foreground's next sensitive piece (inf if none is queued)."""
        running = [q for q in fg.outstanding if not q.launch.done()]
        if running:
            t = max(fg.last_end_us, running[0].dispatch_us)
            for q in running:
                if self.is_sensitive(fg, q):
                    return t
                t += self.isolated(fg, q)
            t = max(t, now)
        else:
            t = now
        for q in fg.queue:
            if self.is_sensitive(fg, q):
                return t
            t += self.isolated(fg, q)
        return math.inf

    def collocated(self, handles: Sequence[JobHandle], ready: float, end: float) -> bool:
        """Whether background device work shared the device between ``ready`` and ``end``."""
        for h in handles:
            if not h.foreground and any(q.dispatch_us < end and q.uses_device
                                        for q in h.outstanding):
                return True
        return any(s < end and e > ready for s, e in self.background_spans)

    def record(self, handles: Sequence[JobHandle], h: JobHandle, q: Queued
               ) -> tuple[bool, Optional[float]]:
        """Learn from piece ``q`` of ``h`` that just ended: a foreground piece's isolated
        time (when nothing shared the device) or slowdown (marking it sensitive past the
        target), a background piece's span and duration. Returns (collocated, slowdown)."""
        launch, key = q.launch, (h.name, q.piece.name)
        collocated, slowdown = False, None
        if h.foreground and launch.error is None:
            took = launch.end_us - launch.ready_us
            collocated = q.uses_device and self.collocated(handles, launch.ready_us,
                                                           launch.end_us)
            if not collocated:
                self.observe(key, took)
            if q.uses_device and self.isolated_us.get(key, 0) > 0:
                slowdown = took / self.isolated_us[key]
                h.stats.slowdowns.append(slowdown)
                if collocated and self.feedback and slowdown > self.target_slowdown:
                    self.sensitive.add(key)
        elif not h.foreground and q.uses_device:
            self.background_spans.append((launch.start_us, launch.end_us))
            if launch.error is None:
                self.observe(key, launch.end_us - launch.start_us)
        return collocated, slowdown

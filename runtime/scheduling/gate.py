"""When a background device piece may be dispatched: within its compute share (AntMan), not
while the foreground's isolated times are being recorded (the first ``calibrate``
iterations), and then either only into the foreground's idle spans (``idle_only``) or only if
predicted to end before the foreground's next sensitive piece starts (the slowdown feedback
loop)."""
from __future__ import annotations

from typing import Optional

from tidal.runtime.scheduling.handle import JobHandle, Queued
from tidal.runtime.scheduling.idle import fits_idle_span
from tidal.runtime.scheduling.timing import Timings


class BackgroundGate:
    """The background admission rule of one runtime (see the module docstring); ``paused``:
    whether the feedback loop held the last background piece it was asked about."""

    def __init__(self, timings: Timings, feedback: bool, idle_only: bool, calibrate: int):
        self.timings = timings
        self.feedback, self.idle_only, self.calibrate = feedback, idle_only, calibrate
        self.paused = False

    def allows(self, fg: Optional[JobHandle], h: JobHandle, now: float, q: Queued) -> bool:
        """Whether background piece ``q`` of ``h`` may go now, beside foreground ``fg``."""
        if h.limits.over_share(h.stats, now):
            return False
        if fg is None or fg.finished or not (self.feedback or self.idle_only):
            return True
        if fg.stats.iterations < self.calibrate and fg.stats.error is None:
            return False  # the foreground's isolated times are being recorded
        if self.idle_only:
            return fits_idle_span(self.timings, fg, h, now, q)
        est = self.timings.isolated_us.get((h.name, q.piece.name), h.mean_piece_us()) \
            or q.piece.duration_us
        allowed = now + est <= self.timings.next_sensitive_start(fg, now)
        if not allowed and not self.paused:
            h.stats.feedback_pauses += 1
        self.paused = not allowed
        return allowed

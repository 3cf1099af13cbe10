"""Fitting background pieces into the foreground's idle spans (``Runtime(idle_only=True)``,
DeepPool's BP+Col): a background piece goes only while no foreground piece occupies the device,
and only if it is predicted to end before the foreground's next device piece can start, which
is when the pieces it waits for (a transfer, a collective) are predicted to end. Both
predictions are conservative (``tidal.runtime.scheduling.timing``): the background piece's
longest recent duration against the foreground pieces' shortest."""
from __future__ import annotations

import math

from tidal.runtime.scheduling.handle import JobHandle, Queued
from tidal.runtime.scheduling.timing import Timings


def idle_until(timings: Timings, fg: JobHandle, now: float) -> float:
    """When the foreground next needs the device: ``now`` while one of its device pieces
    runs or can start; else the predicted end of the pieces its next device piece waits
    for (inf when it has no device piece left)."""
    if any(q.uses_device and q.launch.started and not q.launch.done() for q in fg.outstanding):
        return now
    pending = [q for q in fg.outstanding if q.uses_device and not q.launch.done()]
    pending += [q for q in fg.queue if q.uses_device]
    if not pending:
        running = [timings.predicted_end(fg, q, now) for q in fg.outstanding
                   if not q.launch.done()]
        return max(running) if running else (math.inf if fg.exhausted else now)
    nxt = pending[0]
    deps = [fg.dispatched.get((nxt.iteration, d)) for d in nxt.piece.deps]
    waits = [q for q in deps if q is not None and not q.uses_device]
    return max([now] + [timings.predicted_end(fg, q, now) for q in waits
                        if not q.launch.done()])


def fits_idle_span(timings: Timings, fg: JobHandle, h: JobHandle, now: float,
                   nxt: Queued) -> bool:
    """Whether ``h``'s next piece ``nxt``, after the device pieces it already has outstanding
    (queued behind one another on its stream: ``be_depth`` > 1 saves a dispatch between
    them), is predicted to end before the foreground needs the device (a refusal counts as a
    feedback pause of ``h``)."""
    start = now
    for q in h.outstanding:
        if q.uses_device and not q.launch.done():
            took = timings.estimate(h, q)
            start = max(start, q.launch.start_us + took) if q.launch.started else start + took
    allowed = start + timings.estimate(h, nxt) <= idle_until(timings, fg, now)
    if not allowed:
        h.stats.feedback_pauses += 1
    return allowed

"""A job's queue of pieces: building its iterations (the AntMan memory cap, the job's
``ready``, dependency checks) and picking the next piece to dispatch (a stream runs its pieces
in order; launch pacing; dependencies dispatched with events, or ended)."""
from __future__ import annotations

from typing import Optional

from tidal.runtime.backend import Backend
from tidal.runtime.scheduling.handle import JobHandle, Queued
from tidal.runtime.scheduling.pieces import stream_kind


class Queues:
    """Iteration building and piece picking for the jobs of one runtime on ``backend``
    (``events``: it has events, so a dependency on another stream need not have ended;
    ``inline_host``: see ``Runtime``)."""

    def __init__(self, backend: Backend, events: bool, inline_host: bool):
        self.backend, self.events, self.inline_host = backend, events, inline_host

    def refill(self, h: JobHandle) -> bool:
        """Queue ``h``'s next iteration when its queue is empty; whether it has pieces."""
        return bool(h.queue) or self.append_iteration(h)

    def look_ahead(self, h: JobHandle) -> bool:
        """Queue ``h``'s next iteration behind the one queued (at most two), when the job
        lets it be built now (its ``ready``); whether it did."""
        return bool(h.queue) and h.queue[-1].iteration == h.queue[0].iteration and \
            self.append_iteration(h)

    def append_iteration(self, h: JobHandle) -> bool:
        """Queue ``h``'s next iteration unless the job is done, held by its memory cap or not
        ready for it; a job that cannot produce valid pieces fails alone. Whether it did."""
        if h.exhausted or h.stats.error is not None:
            return False
        if h.limits.holds(getattr(h.job, "memory_bytes", 0) or 0):
            if not h.held:
                h.stats.held += 1
            h.held = True
            return False
        h.held = False
        ready = getattr(h.job, "ready", None)
        if ready is not None and not ready(h.next_index):
            return False  # the job builds this iteration once the previous one has ended
        try:
            pieces = h.job.iteration(h.next_index)
            if pieces is not None and not pieces:
                raise ValueError(f"iteration {h.next_index} has no pieces")
        except Exception as e:  # a job that cannot even produce its pieces fails alone
            h.fail(e)
            return False
        if pieces is None:
            h.exhausted = True
            return False
        pieces = list(pieces)
        if self.events:  # its inputs were made on the caller's stream: its streams wait
            origin = self.backend.event()
            self.backend.record(self.backend.current_stream(), origin)
            h.origins[h.next_index] = (origin, set())
        for i, (piece, fn) in enumerate(pieces):
            if any(not 0 <= d < i for d in piece.deps):
                h.fail(ValueError(f"iteration {h.next_index}: piece {piece.name!r} waits "
                                  f"for {piece.deps}, not all earlier pieces"))
                return False
            h.queue.append(Queued(piece, fn, h.next_index, i == len(pieces) - 1, index=i))
        h.next_index += 1
        return True

    def deps_ready(self, h: JobHandle, q: Queued) -> bool:
        """Whether ``q`` may be dispatched as far as the pieces it waits for go: once they
        are dispatched with events (its stream waits for them), else once they ended."""
        deps = [h.dispatched.get((q.iteration, d)) for d in q.piece.deps]
        if any(d is None for d in deps):
            return False
        return self.events or all(d.launch.done() for d in deps)

    def blocks_dispatcher(self, q: Queued) -> bool:
        """Whether dispatching ``q`` blocks the dispatcher until it ends: a host piece on a
        stream shared with device pieces (a compute stream) on an ``inline_host`` backend."""
        return self.inline_host and not q.uses_device and stream_kind(q.piece.stream)[1]

    def pick(self, h: JobHandle, depth: Optional[int]) -> Optional[Queued]:
        """The queued piece of ``h`` to dispatch next: the first, in queue order, that is the
        earliest queued piece of its stream (a stream runs its pieces in order), whose stream
        has fewer than ``depth`` device pieces outstanding (device pieces only) and whose
        dependencies allow it (:meth:`deps_ready`). Pieces of other streams, and of the next
        iteration, may so go before a piece that waits."""
        seen: set[str] = set()
        for q in h.queue:
            stream = q.piece.stream
            if stream in seen:
                continue
            seen.add(stream)
            if depth is not None and q.uses_device and h.device_outstanding(stream) >= depth:
                continue
            if self.blocks_dispatcher(q) and any(
                    not o.launch.done() for o in h.outstanding if o.piece.stream == stream):
                continue  # runs in stream order: once the pieces before it have ended
            if self.deps_ready(h, q):
                return q
        return None

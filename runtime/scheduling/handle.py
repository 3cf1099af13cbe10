"""A submitted job as the scheduler keeps it (:class:`JobHandle`): its limits, statistics,
queued and outstanding pieces (:class:`Queued`), and the events of its dispatched pieces.

Example:
    >>> from tidal.runtime.scheduling.jobs import step_job
    >>> h = JobHandle(step_job("fg", lambda: None, iterations=1), True, Limits(), None)
    >>> h, h.finished
    (JobHandle('fg', high), False)
"""
from __future__ import annotations

import collections
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tidal.ir.program import Piece
from tidal.runtime.backend import Launch
from tidal.runtime.scheduling.jobs import Job
from tidal.runtime.scheduling.limits import Limits
from tidal.runtime.scheduling.pieces import operator_class, uses_device
from tidal.runtime.scheduling.records import JobStats


@dataclass
class Queued:
    """A piece of iteration ``iteration`` (at ``index`` in its list; ``last``: the
    iteration's last piece) with ``fn``, what runs it, and what the scheduler derived from it
    (``uses_device``, operator class ``kind``); once dispatched, when (``dispatch_us``), its
    ``launch`` and its dispatch order ``seq``."""

    piece: Piece
    fn: Callable[[], Any]
    iteration: int
    last: bool
    index: int = 0
    dispatch_us: float = 0.0
    launch: Optional[Launch] = None
    seq: int = 0

    def __post_init__(self) -> None:
        self.uses_device = uses_device(self.piece)
        self.kind = operator_class(self.piece)


class JobHandle:
    """A submitted job: its ``limits`` (adjustable), ``stats`` and ``finished`` state."""

    def __init__(self, job: Job, foreground: bool, limits: Limits,
                 on_iteration: Optional[Callable[["JobHandle", int], None]]):
        self.job = job
        self.name = job.name
        self.foreground = foreground
        self.limits = limits
        self.on_iteration = on_iteration
        self.stats = JobStats(job.name, "high" if foreground else "low")
        self.queue: collections.deque[Queued] = collections.deque()
        self.outstanding: collections.deque[Queued] = collections.deque()
        self.next_index = 0
        self.exhausted = False
        self.held = False
        self.last_end_us = 0.0
        self.iteration_start: Optional[float] = None
        self.upgradable = False
        self.failure: Optional[BaseException] = None
        # dispatched pieces by (iteration, index), of the iterations still queued or running
        self.dispatched: dict[tuple[int, int], Queued] = {}
        self.events: dict[tuple[int, int], Any] = {}  # ... and the event each one records
        # by iteration: the event recorded on the stream current when its pieces were made
        # (what produced its inputs), and the streams that already wait for it
        self.origins: dict[int, tuple[Any, set[int]]] = {}

    def device_outstanding(self, stream: Optional[str] = None) -> int:
        """Outstanding pieces that occupy the device (what launch pacing counts): all of
        them, or those on the job's ``stream`` (a piece's ``stream`` name)."""
        return sum(1 for q in self.outstanding if q.uses_device and
                   (stream is None or q.piece.stream == stream))

    @property
    def finished(self) -> bool:
        """Done (no more iterations) or failed, with nothing queued or outstanding."""
        return (self.exhausted or self.stats.error is not None) and not self.outstanding \
            and not (self.queue and self.stats.error is None)

    def mean_piece_us(self) -> float:
        """Mean device time of this job's pieces so far (0 before the first)."""
        return self.stats.busy_us / self.stats.pieces if self.stats.pieces else 0.0

    def fail(self, error: BaseException) -> None:
        """Stop the job with ``error`` (reported in its stats); the others keep running."""
        self.failure = error
        self.stats.error = "".join(traceback.format_exception_only(type(error), error)).strip()
        self.queue.clear()
        self.exhausted = True

    def forget_finished(self) -> None:
        """Drop the dispatch records of iterations that have ended."""
        oldest = min([q.iteration for q in self.queue] + [q.iteration for q in self.outstanding],
                     default=self.next_index)
        for key in [k for k in self.dispatched if k[0] < oldest]:
            del self.dispatched[key]
            self.events.pop(key, None)
        for it in [i for i in self.origins if i < oldest]:
            del self.origins[it]

    def __repr__(self) -> str:
        return f"JobHandle({self.name!r}, {'high' if self.foreground else 'low'})"

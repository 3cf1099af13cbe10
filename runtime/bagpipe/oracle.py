"""Bagpipe's Oracle Cacher: the lookahead algorithm (§5.2.2) with LRPP caches and delayed sync.

Pure Python: no process, no tensor. For one embedding table, :class:`Lookahead` turns the ids
each trainer uses per batch into a :class:`TableDecision` per batch:

- ``fetch[r]``: ids trainer ``r`` prefetches for the batch (used by the batch, not cached);
- TTL: an id used at batch ``x`` is cached until the last batch of x's window that uses it (a
  cached id seen again gets a TTL update); ids whose TTL is ``x`` are evicted after ``x``. The
  window of lookahead ``L`` is the batch and the ``L`` batches beyond it, ``x .. x+L`` (§5.2.2
  defines L as "the number of batches beyond the current batch"; the paper's Fig. 5.5 labels
  its example "lookahead 2" but its TTLs follow a window of two batches, which is ``L = 1``
  here), cut at the end of a checkpoint segment and of the run; ``L = 0`` caches nothing;
- LRPP (§5.2.3): an id fetched while only one trainer uses it in the window is LOCAL to that
  trainer (fetched, updated without all-reduce and written back by it alone); otherwise it is
  SHARED (held by every trainer, gradient all-reduced, written back by trainer ``id % T``). A
  local id that another trainer will use while it is still cached is *promoted* to shared
  before the batch whose window reveals that user (its owner contributes the value to an
  all-reduce, the others zeros);
- delayed sync: shared ids updated at ``x`` that batch ``x+1`` uses are synced on the critical
  path, the others in the background (overlapping ``x+1``'s forward); when nothing of ``x``
  may stay cached (``L = 0``, end of a checkpoint segment or of the run) every sync is
  critical, since the write-backs must precede the next prefetch;
- consistency: ``written_through`` is the last batch whose write-backs must have completed on
  every trainer before the prefetch for the batch is issued (``x - L - 1``: an id evicted
  after batch ``y`` is next used at ``y + L + 1`` or later, so batch ``x``'s prefetch may run
  ``L`` batches ahead; the first batch of a segment waits for the flush of the previous one).

:class:`LruPlanner` gives the same decisions for the plain replicated LRU baseline (and the
"no cache" baseline with zero rows).

Example (Fig. 5.5 of the dissertation: its "lookahead 2" window of two batches, one trainer):
    >>> o = Lookahead(trainers=1, lookahead=1, stop=4)
    >>> trace = [[{3, 9}], [{3, 4}], [{3, 6}], [{6, 1}]]
    >>> ds = [d for x, b in enumerate(trace) for d in o.feed(x, b)]
    >>> [d.fetch[0] for d in ds]
    [(3, 9), (4,), (6,), (1,)]
    >>> [dict(d.ttl) for d in ds]
    [{3: 1, 9: 0}, {3: 2, 4: 1}, {3: 2, 6: 3}, {1: 3, 6: 3}]
    >>> [d.dropped for d in ds]
    [(9,), (4,), (3,), (1, 6)]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

__all__ = ["TableDecision", "Lookahead", "LruPlanner", "segment_start", "segment_end"]


@dataclass(frozen=True)
class TableDecision:
    """What every trainer does for one table around one batch (ids are sorted tuples).

    ``uses[r]``: ids trainer r's shard uses; ``fetch[r]``: ids it prefetches; ``local[r]``: ids
    it updates without sync (it owns them); ``promote``: (id, owner) pairs made shared before
    this batch (owner's value all-reduced with zeros); ``critical``/``background``: shared ids
    updated at this batch, synced before the next batch / in the background; ``writeback[r]``:
    ids trainer r writes back after the batch (and its syncs); ``dropped``: every id leaving the
    caches after the batch; ``ttl``: (id, ttl) of the ids this batch uses; ``written_through``:
    write-backs of batches up to this one must be complete on every trainer before this batch's
    prefetch; ``deferred``: True when the write-back may wait for the background sync (the
    next batch's prefetch does not depend on it).
    """

    batch: int
    uses: tuple[tuple[int, ...], ...]
    fetch: tuple[tuple[int, ...], ...]
    local: tuple[tuple[int, ...], ...]
    promote: tuple[tuple[int, int], ...]
    critical: tuple[int, ...]
    background: tuple[int, ...]
    writeback: tuple[tuple[int, ...], ...]
    dropped: tuple[int, ...]
    ttl: tuple[tuple[int, int], ...]
    written_through: int
    deferred: bool


def segment_start(x: int, start: int, segment: Optional[int]) -> int:
    """First batch of the checkpoint segment holding batch ``x`` (segments are multiples of
    ``segment`` batches; the run's ``start`` also opens one)."""
    if not segment:
        return start
    return max(start, (x // segment) * segment)


def segment_end(x: int, stop: int, segment: Optional[int]) -> int:
    """Last batch of the checkpoint segment holding ``x`` (no later than ``stop - 1``)."""
    if not segment:
        return stop - 1
    return min(stop - 1, (x // segment + 1) * segment - 1)


def _as_sets(batch: Sequence[Iterable[int]]) -> list[set[int]]:
    return [set(int(i) for i in ids) for ids in batch]


@dataclass
class _Entry:
    ttl: int
    owner: int  # trainer index for a local id, -1 for a shared one


@dataclass
class Lookahead:
    """Stateful lookahead over one table. ``feed(x, uses)`` with batches in order (``uses[r]``
    the ids trainer r's shard uses at batch x) returns the decisions that became ready: the
    decision of batch x needs batches up to ``x + L`` (cut at the end of x's checkpoint segment
    of ``segment`` batches and at ``stop``)."""

    trainers: int
    lookahead: int
    stop: int
    start: int = 0
    segment: Optional[int] = None
    _pending: dict = field(default_factory=dict)
    _next: int = -1
    _cache: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.trainers < 1:
            raise ValueError(f"bagpipe.oracle: trainers must be >= 1, got {self.trainers}")
        if self.lookahead < 0:
            raise ValueError(f"bagpipe.oracle: lookahead must be >= 0, got {self.lookahead}")
        self._next = self.start

    def horizon(self, x: int) -> int:
        """Last batch of the window of batch ``x``."""
        return min(x + self.lookahead, segment_end(x, self.stop, self.segment))

    def feed(self, x: int, uses: Sequence[Iterable[int]]) -> list[TableDecision]:
        """Add batch ``x`` (batches in order); return the decisions now ready."""
        if len(uses) != self.trainers:
            raise ValueError(f"bagpipe.oracle: batch {x} has {len(uses)} shards, expected "
                             f"{self.trainers} trainers")
        if x != self._next + len(self._pending):
            raise ValueError(f"bagpipe.oracle: batch {x} fed out of order (expected "
                             f"{self._next + len(self._pending)})")
        self._pending[x] = _as_sets(uses)
        out = []
        while self._next in self._pending and self.horizon(self._next) in self._pending:
            out.append(self._decide(self._next))
            del self._pending[self._next]
            self._next += 1
        return out

    def _decide(self, x: int) -> TableDecision:
        T, W = self.trainers, self.lookahead + 1
        hz = self.horizon(x)
        now = self._pending[x]
        used = set().union(*now)
        users: dict[int, set[int]] = {i: set() for i in used}
        last: dict[int, int] = {i: x for i in used}
        for b in range(x, hz + 1):
            for r, ids in enumerate(self._pending[b]):
                for i in ids & used:
                    users[i].add(r)
                    last[i] = b
        nxt = set().union(*self._pending[x + 1]) if hz > x else set()
        fetch = [set() for _ in range(T)]
        promote = []
        for i in sorted(used):
            e = self._cache.get(i)
            if e is None:
                owner = next(iter(users[i])) if len(users[i]) == 1 else -1
                e = self._cache[i] = _Entry(ttl=last[i], owner=owner)
                for r in (range(T) if owner < 0 else [owner]):
                    fetch[r].add(i)
            else:
                if e.owner >= 0 and users[i] != {e.owner}:
                    promote.append((i, e.owner))
                    e.owner = -1
                e.ttl = max(e.ttl, last[i])
        local = [set() for _ in range(T)]
        shared = set()
        for i in used:
            o = self._cache[i].owner
            (local[o] if o >= 0 else shared).add(i)
        if hz == x:
            critical, background = shared, set()
        else:
            critical, background = shared & nxt, shared - nxt
        dropped = sorted(i for i in used if self._cache[i].ttl == x)
        writeback = [set() for _ in range(T)]
        for i in dropped:
            o = self._cache.pop(i).owner
            writeback[o if o >= 0 else i % T].add(i)
        ttl = tuple((i, self._cache[i].ttl if i in self._cache else x) for i in sorted(used))
        seg0 = segment_start(x, self.start, self.segment)
        return TableDecision(
            batch=x, uses=tuple(tuple(sorted(u)) for u in now),
            fetch=tuple(tuple(sorted(f)) for f in fetch),
            local=tuple(tuple(sorted(v)) for v in local), promote=tuple(promote),
            critical=tuple(sorted(critical)), background=tuple(sorted(background)),
            writeback=tuple(tuple(sorted(w)) for w in writeback), dropped=tuple(dropped),
            ttl=ttl, written_through=max(x - W, seg0 - 1), deferred=hz > x)

    @property
    def resident(self) -> dict[int, tuple[int, int]]:
        """Cached ids now: id -> (ttl, owner) with owner -1 for shared ids."""
        return {i: (e.ttl, e.owner) for i, e in self._cache.items()}


@dataclass
class LruPlanner:
    """Decisions of a plain LRU cache of ``rows`` rows replicated on every trainer: misses of
    the whole batch fetched by every trainer on the critical path, every used row all-reduced
    on the critical path, the least recently used rows beyond ``rows`` evicted (written back by
    trainer ``id % T``) after the batch, everything at the end of a segment or of the run.
    ``rows=0`` is the "no cache" baseline. Decisions are ready at once (no lookahead)."""

    trainers: int
    rows: int
    stop: int
    start: int = 0
    segment: Optional[int] = None
    _order: dict = field(default_factory=dict)  # id -> last batch used (insertion order = age)

    def feed(self, x: int, uses: Sequence[Iterable[int]]) -> list[TableDecision]:
        """Decide batch ``x``; returns ``[decision]``."""
        T = self.trainers
        now = _as_sets(uses)
        used = sorted(set().union(*now))
        miss = tuple(i for i in used if i not in self._order)
        for i in used:
            self._order.pop(i, None)
            self._order[i] = x
        over = max(0, len(self._order) - self.rows)
        if x == segment_end(x, self.stop, self.segment):
            over = len(self._order)
        dropped = sorted(list(self._order)[:over])
        for i in dropped:
            del self._order[i]
        writeback = [set() for _ in range(T)]
        for i in dropped:
            writeback[i % T].add(i)
        return [TableDecision(
            batch=x, uses=tuple(tuple(sorted(u)) for u in now), fetch=(miss,) * T,
            local=((),) * T, promote=(), critical=tuple(used), background=(),
            writeback=tuple(tuple(sorted(w)) for w in writeback), dropped=tuple(dropped),
            ttl=tuple((i, x) for i in used), written_through=x - 1, deferred=False)]

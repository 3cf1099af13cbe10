"""Schedules as explicit data: a list of actions per rank that a runtime executes.

An ``Action`` is one thing a rank does in one lane (a stream, or a thread on the CPU backend):
a forward ``F`` or backward ``B`` of a (partition, batch) in a wave, a weight-gradient ``W``
(the weight half of a backward split as zero-bubble schedules do; ``B`` is then the input
gradient), a weight switch ``S`` (loading a partition), an activation transfer ``X``, an explicit
point-to-point ``SEND`` or ``RECV`` (``moves`` says what: ``F`` an activation forward, ``B`` a
gradient backward; ``peer`` the other rank), an all-reduce ``A`` or an optimizer update ``U``,
each with a predicted start and duration. Actions print compactly: ``T:F0`` is the tick
wave's forward of batch 0, ``K:B1`` the tock wave's backward of batch 1, ``F2,1`` the forward of
partition 2 on batch 1, ``S2`` loading partition 2, ``A2`` all-reducing it. The pipeline form
(``1F0``, ``1SEND_F0>2``, parsed back) and the builders and deadlock checker of GPipe, 1F1B,
tick-tock and round-robin schedules live in ``tidal.ir.pipeline_schedules``.

A ``Schedule`` is a ``Plan`` (exact JSON round trip) with checks: no rank does two things at
once in one lane, every (partition, batch) is run exactly once forward and once backward, and
dependencies hold (a partition's forward after the previous partition's forward of the same
batch, backward after the next partition's backward and after its own forward).
``gantt_svg()`` draws it per rank. ``split_batch`` cuts a global batch into the schedule's
equal batches. :func:`schedule_program` lowers a schedule to the one Program type
(``tidal.ir.program``) of the whole cluster, each action a piece placed on its rank (an
all-reduce or a transfer on all the ranks it joins), as the simulator runs it; the runtime's
builders lower a plan's schedule to each rank's Program with the graph's segments.

Example:
    >>> from tidal.ir.schedule import Action, Schedule
    >>> s = Schedule(name="toy", ranks=((Action("F", 0, start_us=0, dur_us=1),
    ...                                   Action("B", 0, start_us=1, dur_us=2)),),
    ...              partitions=1, batches=1)
    >>> print(s.table())
    toy: 1 rank(s), 1 partition(s), 1 batch(es), makespan 3 us
    rank 0: F0 B0
    >>> s.check()
    >>> Schedule.from_json(s.to_json()) == s
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tidal.ir.errors import PlanError
from tidal.ir.plan import Plan
from tidal.ir.plot import Bar, Key, Row, color, gantt_chart
from tidal.ir.program import (COLLECTIVE, COMM, COMPUTE, LOAD, OPTIMIZER, POINT_TO_POINT,
                              SEGMENT, Piece, Program)

_KINDS = ("F", "B", "S", "X", "A", "U", "W", "SEND", "RECV")
_KIND_NAMES = {"F": "forward", "B": "backward", "S": "weight switch", "X": "transfer",
               "A": "all-reduce", "U": "update", "W": "weight gradient", "SEND": "send",
               "RECV": "receive"}
_P2P = ("SEND", "RECV")
LINK_ACTIONS = ("X", "A", "S", *_P2P)
"""Action kinds that use a rank's link (transfers, all-reduces, weight switches); the rest
compute."""
_PIECE_KINDS = {"F": SEGMENT, "B": SEGMENT, "W": SEGMENT, "U": OPTIMIZER, "A": COLLECTIVE,
                "X": POINT_TO_POINT, "SEND": POINT_TO_POINT, "RECV": POINT_TO_POINT, "S": LOAD}
_MOVES = ("F", "B")
_EPS = 1e-6


@dataclass(frozen=True)
class Action:
    """One step of a rank: ``kind`` in F/B/S/X/A/U/W/SEND/RECV, the ``batch`` (or iteration)
    and ``partition`` it works on, the ``wave`` (``T`` tick, ``K`` tock, '' none), the ``lane``
    it runs in (concurrent lanes of one rank may overlap), and its predicted ``start_us`` and
    ``dur_us``. A ``SEND``/``RECV`` also says what ``moves`` (``F``: the activation ``partition``
    sends forward or receives as its input; ``B``: the gradient it sends backward or receives
    from the next partition) and the ``peer`` rank (-1: not given, inferred by the checker from
    where the partitions run); other kinds leave both at their defaults."""

    kind: str
    batch: int = 0
    partition: int = 0
    wave: str = ""
    lane: str = ""
    start_us: float = 0.0
    dur_us: float = 0.0
    peer: int = -1
    moves: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise PlanError(f"Action(kind={self.kind!r}): kind must be one of {_KINDS}")
        if self.dur_us < 0:
            raise PlanError(f"Action {self.kind}: dur_us={self.dur_us!r} is negative")
        if self.kind in _P2P and self.moves not in _MOVES:
            raise PlanError(f"Action {self.kind}: moves={self.moves!r} must be 'F' (activation "
                            f"forward) or 'B' (gradient backward)")
        if self.kind not in _P2P and (self.moves or self.peer != -1):
            raise PlanError(f"Action {self.kind}: only SEND/RECV name a peer and what moves "
                            f"(got peer={self.peer!r}, moves={self.moves!r})")
        if self.peer < -1:
            raise PlanError(f"Action {self.kind}: peer={self.peer!r} is not a rank")

    @property
    def end_us(self) -> float:
        """When the action ends."""
        return self.start_us + self.dur_us

    def label(self, partitioned: bool) -> str:
        """The short name: ``T:F0``, ``F2,1``, ``S2``, ``A2``, ``W2,1``, ``SEND_F2,1>3``."""
        prefix = f"{self.wave}:" if self.wave else ""
        if self.kind in ("F", "B", "X", "W", *_P2P):
            body = f"{self.partition},{self.batch}" if partitioned else f"{self.batch}"
        elif self.kind in ("S", "A"):
            body = f"{self.partition}" if partitioned else f"{self.batch}"
        else:
            body = f"{self.batch}"
        if self.kind in _P2P:
            peer = "" if self.peer < 0 else (">" if self.kind == "SEND" else "<") + str(self.peer)
            return f"{prefix}{self.kind}_{self.moves}{body}{peer}"
        return f"{prefix}{self.kind}{body}"


@dataclass(frozen=True)
class Schedule(Plan):
    """Actions per rank (``ranks[i]`` in execution order) for ``partitions`` model partitions
    and ``batches`` batches (or iterations). ``data_parallel``: every rank runs every
    (partition, batch) on its own shard, so coverage is checked per rank. ``notes`` are
    key/value facts the builder recorded (predicted times, switch counts)."""

    name: str
    ranks: tuple[tuple[Action, ...], ...]
    partitions: int = 1
    batches: int = 1
    notes: tuple[tuple[str, float], ...] = ()
    data_parallel: bool = False

    @property
    def makespan_us(self) -> float:
        """End of the last action on any rank."""
        return max((a.end_us for acts in self.ranks for a in acts), default=0.0)

    def note(self, key: str, default: float = 0.0) -> float:
        """A recorded fact by name."""
        return dict(self.notes).get(key, default)

    def summary(self) -> str:
        return (f"{self.name}: {len(self.ranks)} ranks, {self.partitions} partitions, "
                f"{self.batches} batches, makespan {self.makespan_us:.3g} us")

    def line(self, rank: int) -> str:
        """Rank ``rank``'s actions as one line (``T:F0 T:B0 K:F1 ...``)."""
        part = self.partitions > 1
        return " ".join(a.label(part) for a in self.ranks[rank])

    def table(self) -> str:
        head = (f"{self.name}: {len(self.ranks)} rank(s), {self.partitions} partition(s), "
                f"{self.batches} batch(es), makespan {self.makespan_us:.3g} us")
        rows = [f"rank {i}: {self.line(i)}" for i in range(len(self.ranks))]
        extra = [f"  {k} = {v:.4g}" for k, v in self.notes]
        return "\n".join([head, *rows, *extra])

    def for_rank(self, rank: int, lane: str | None = None) -> tuple[Action, ...]:
        """Rank ``rank``'s actions (only those of ``lane`` when given)."""
        if not 0 <= rank < len(self.ranks):
            raise PlanError(f"schedule {self.name!r} has no rank {rank} "
                            f"({len(self.ranks)} ranks)")
        acts = self.ranks[rank]
        return acts if lane is None else tuple(a for a in acts if a.lane == lane)

    # -- checks -------------------------------------------------------------------------
    def check_no_overlap(self) -> None:
        """Raise ``PlanError`` if a rank does two things at once in one lane."""
        for r, acts in enumerate(self.ranks):
            lanes: dict[str, list[Action]] = {}
            for a in acts:
                lanes.setdefault(a.lane, []).append(a)
            for lane, items in lanes.items():
                items = sorted(items, key=lambda a: (a.start_us, a.end_us))
                for prev, cur in zip(items, items[1:]):
                    if cur.start_us < prev.end_us - _EPS and cur.dur_us > 0 and prev.dur_us > 0:
                        raise PlanError(
                            f"schedule {self.name!r}: rank {r} lane {lane!r} runs "
                            f"{cur.label(self.partitions > 1)} at {cur.start_us:.3g} us while "
                            f"{prev.label(self.partitions > 1)} runs until {prev.end_us:.3g} us")

    def check_coverage(self) -> None:
        """Raise ``PlanError`` unless every (partition, batch) is run exactly once forward and
        once backward over all ranks (on every rank for a data-parallel schedule)."""
        groups = ([[r] for r in range(len(self.ranks))] if self.data_parallel
                  else [list(range(len(self.ranks)))])
        want = {(p, b) for p in range(self.partitions) for b in range(self.batches)}
        for group in groups:
            seen: dict[tuple[str, int, int], int] = {}
            for r in group:
                for a in self.ranks[r]:
                    if a.kind not in ("F", "B"):
                        continue
                    key = (a.kind, a.partition, a.batch)
                    if key in seen:
                        raise PlanError(
                            f"schedule {self.name!r}: {a.label(self.partitions > 1)} runs "
                            f"twice (ranks {seen[key]} and {r})")
                    seen[key] = r
            for kind in ("F", "B"):
                got = {(p, b) for (k, p, b) in seen if k == kind}
                if got != want:
                    where = f" on rank {group[0]}" if self.data_parallel else ""
                    raise PlanError(
                        f"schedule {self.name!r}{where}: {kind} misses (partition, batch) "
                        f"{sorted(want - got)[:3]} / has unexpected {sorted(got - want)[:3]}")

    def check_dependencies(self) -> None:
        """Raise ``PlanError`` if a forward starts before the previous partition's forward of
        its batch ended, or a backward before the next partition's backward (or its own
        forward) ended."""
        end: dict[tuple, float] = {}
        start: dict[tuple, float] = {}
        for r, acts in enumerate(self.ranks):
            tag = r if self.data_parallel else -1
            for a in acts:
                if a.kind in ("F", "B"):
                    end[(a.kind, tag, a.partition, a.batch)] = a.end_us
                    start[(a.kind, tag, a.partition, a.batch)] = a.start_us
        for (kind, tag, p, b), t0 in start.items():
            deps = ([("F", tag, p - 1, b)] if kind == "F"
                    else [("B", tag, p + 1, b), ("F", tag, p, b)])
            for d in deps:
                if d in end and t0 < end[d] - _EPS:
                    raise PlanError(f"schedule {self.name!r}: {kind}{p},{b} starts at "
                                    f"{t0:.3g} us before {d[0]}{d[2]},{d[3]} ends at "
                                    f"{end[d]:.3g} us")

    def check(self) -> None:
        """All checks: no overlap in a lane, exact coverage, dependencies."""
        self.check_no_overlap()
        self.check_coverage()
        self.check_dependencies()

    # -- drawing -------------------------------------------------------------------------
    def gantt_svg(self, width: int = 900, row_h: int = 22) -> str:
        """A per-rank (and per-lane) Gantt chart of the schedule as an SVG string: one row per
        rank and lane, one bar per action (coloured by kind, the tock wave paler), a legend of
        the kinds used."""
        rows: list[Row] = []
        part = self.partitions > 1
        for r, acts in enumerate(self.ranks):
            lanes: dict[str, list[Action]] = {}
            for a in acts:
                lanes.setdefault(a.lane, []).append(a)
            for lane, items in lanes.items():
                bars = tuple(Bar(a.start_us, a.end_us, color(_KINDS.index(a.kind)), a.label(part),
                                 opacity=0.6 if a.wave == "K" else 1.0) for a in items)
                rows.append(Row(f"rank {r}" + (f" {lane}" if lane else ""), bars))
        used = {a.kind for acts in self.ranks for a in acts}
        keys = [Key(f"{k} {_KIND_NAMES[k]}", color(i)) for i, k in enumerate(_KINDS) if k in used]
        return gantt_chart(rows, title=self.summary(), span=self.makespan_us or 1.0,
                           legend=keys, width=width, row_h=row_h)


def schedule_program(schedule: Schedule) -> Program:
    """The schedule as one Program of the whole cluster (``tidal.ir.program``), each action a
    piece of its predicted duration, so that the simulator (not the schedule's builder) decides
    when each runs: forward, backward, weight gradient and update on the rank's one ``compute``
    stream (the waves of a rank contend for it); transfers, weight switches and all-reduces on
    its ``comm`` stream (its link); an all-reduce (same wave, batch and partition on every
    rank) as one collective on all ranks; a transfer ``X`` of a partitioned schedule on its
    rank's link, awaited by the next rank; a ``SEND`` and its matching ``RECV`` as one
    point-to-point piece on both ranks. A piece waits, on every rank it occupies, for the last
    action of each of the schedule's lanes there that the builder ended no later than it
    started (the builder's happens-before); pieces are in start order.

    Example:
        >>> s = Schedule("toy", ranks=((Action("F", dur_us=1), Action("A", start_us=2, dur_us=1)),
        ...                           (Action("F", dur_us=2), Action("A", start_us=2, dur_us=1))))
        >>> [(p.name, p.kind, p.ranks, p.deps) for p in schedule_program(s).pieces]
        [('F0', 'segment', (0,), ()), ('F0', 'segment', (1,), ()), ('A0', 'collective', (0, 1), (0, 1))]
    """
    part = schedule.partitions > 1
    items = _schedule_items(schedule)
    order = sorted(items, key=lambda key: (items[key]["start"], items[key]["end"], str(key)))
    pieces: list[Piece] = []
    for i, key in enumerate(order):
        it, a = items[key], items[key]["a"]
        deps = set()
        for g in it["gpus"]:
            last: dict[tuple[int, str], int] = {}
            for j in range(i):  # the latest finished action of each lane of GPU g
                other = items[order[j]]
                if g in other["seen"] and other["end"] <= it["start"] + 1e-9:
                    for r, lane in other["lanes"]:
                        last[(r, lane)] = j
            deps.update(last.values())
        link = a.kind in LINK_ACTIONS
        pieces.append(Piece(a.label(part), COMM if link else COMPUTE, tuple(sorted(deps - {i})),
                            kind=_PIECE_KINDS[a.kind], duration_us=a.dur_us,
                            ranks=it["gpus"] if link else it["gpus"][:1]))
    return Program(tuple(pieces), len(schedule.ranks))


def _schedule_items(schedule: Schedule) -> dict[tuple, dict]:
    """The schedule's actions by what they are across ranks (one all-reduce of every rank, one
    transfer of a SEND/RECV pair): the first action, the GPUs it occupies, the GPUs whose later
    actions wait for it (``seen``), the (rank, lane) pairs it runs in, its start and end."""
    part = schedule.partitions > 1
    n = len(schedule.ranks)
    items: dict[tuple, dict] = {}
    for rank, actions in enumerate(schedule.ranks):
        for k, a in enumerate(actions):
            seen = None  # GPUs whose later actions wait for this one (default: where it runs)
            if a.kind == "A":
                key: tuple = ("A", a.wave, a.batch, a.partition)
                gpus = tuple(range(n))
            elif a.kind == "X" and part:  # sent on this rank's link, awaited by the next rank
                key, gpus, seen = ("X", rank, k), (rank,), tuple(sorted({rank, (rank + 1) % n}))
            elif a.kind in _P2P and a.peer >= 0:  # one transfer on both links
                pair = (rank, a.peer) if a.kind == "SEND" else (a.peer, rank)
                key = ("P2P", pair, a.moves, a.wave, a.batch)  # one per pair and micro-batch
                gpus = tuple(sorted(set(pair)))
            else:
                key, gpus = (a.kind, rank, k), (rank,)
            it = items.setdefault(key, {"a": a, "gpus": gpus, "seen": seen or gpus,
                                        "lanes": set(), "start": a.start_us, "end": a.end_us})
            it["lanes"].add((rank, a.lane))
            it["start"], it["end"] = min(it["start"], a.start_us), max(it["end"], a.end_us)
    return items


def split_batch(values: Any, parts: int, what: str = "batch") -> list[Any]:
    """Cut every tensor in ``values`` (a tensor, tuple/list or dict of them) along dim 0 into
    ``parts`` equal slices; non-tensors are repeated. Raises ``ValueError`` naming the batch
    size when it is not divisible by ``parts``."""
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"split_batch(parts={parts!r}): must be a positive integer")
    sizes = {v.shape[0] for v in _tensors(values) if v.dim() > 0}
    if len(sizes) > 1:
        raise ValueError(f"{what}: tensors disagree on the batch dimension: sizes {sorted(sizes)}")
    size = sizes.pop() if sizes else None
    if size is not None and size % parts:
        raise ValueError(f"{what} size {size} is not divisible by {parts} (the schedule needs "
                         f"{parts} equal shards); use a multiple of {parts}")
    step = (size or 0) // parts

    def cut(v: Any, i: int) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v[i * step:(i + 1) * step]
        if isinstance(v, (tuple, list)):
            return type(v)(cut(x, i) for x in v)
        if isinstance(v, dict):
            return {k: cut(x, i) for k, x in v.items()}
        return v

    return [cut(values, i) for i in range(parts)]


def _tensors(v: Any) -> Sequence[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in _tensors(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _tensors(x)]
    return []

"""GPipe, 1F1B, tick-tock and round-robin schedules in one action vocabulary, with a compact
text form, CSV, and a static checker that proves a schedule cannot deadlock.

Every schedule is a :class:`~tidal.ir.schedule.Schedule`: per rank, a list of
:class:`~tidal.ir.schedule.Action` run in order (forward ``F``, backward ``B``, weight-gradient
``W``, point-to-point ``SEND``/``RECV``, all-reduce ``A``, switch ``S``, update ``U``; the older
ring transfer ``X`` is understood too). The compact form follows torch.distributed.pipelining's
action strings, ``{stage}{kind}{micro-batch}``, stage being the partition:

===============  ===========================================================================
``1F0``          forward of stage 1 on micro-batch 0 (``B`` backward, ``W`` weight gradient)
``1SEND_F0>2``   stage 1 sends its activation of micro-batch 0 to rank 2 (a blocking send)
``2RECV_F0<1``   stage 2 receives its input activation of micro-batch 0 from rank 1
``2SEND_B1>1``   stage 2 sends the gradient of its input (micro-batch 1) back to rank 1
``1RECV_B1<2``   stage 1 receives the gradient of its output (micro-batch 1) from rank 2
``0A`` ``0U``    all-reduce / update of stage 0 (a micro-batch, when not 0, follows: ``0A3``)
``1S``           switch to (load the weights of) partition 1
``T:0F2@comm``   a wave prefix (``T`` tick, ``K`` tock) and a lane suffix (default: the wave)
===============  ===========================================================================

The peer (``>2``, ``<1``) may be left out, as torch writes it; the checker then infers it from
where the neighbouring stage runs. Parsing and printing round-trip every field of an action
except its predicted times (``start_us``, ``dur_us``); a CSV file holds one row per rank and one
compact action per cell, so it round-trips the action lists and nothing else (the schedule's
name, notes, and whether it is data-parallel are arguments or inferred when read back).

Builders (any N ranks, M micro-batches): :func:`gpipe`, :func:`one_f_one_b` (stage r on rank
r, explicit SEND/RECV between stages, one update per stage at the end), :func:`round_robin`
(Wavelet Fig. 10) and :func:`tick_tock` (Wavelet Fig. 9). Transfers are placed by
:func:`with_transfers`, which runs the compute order with predicted times and lists every
transfer on both ranks at the same point of one global order, so blocking sends never wait on
each other in a cycle. :func:`check_deadlock_free` runs the per-rank lists as sequential
programs with blocking rendezvous sends and collectives and raises ``PlanError`` naming every
stuck rank, or any send without a receive (or the reverse).

Example:
    >>> from tidal.ir.pipeline_schedules import (check_deadlock_free, format_schedule,
    ...                                          one_f_one_b, parse_action, parse_schedule)
    >>> s = one_f_one_b(2, 2)
    >>> print(format_schedule(s))
    rank 0: 0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1 0U
    rank 1: 1RECV_F0<0 1F0 1RECV_F1<0 1B0 1SEND_B0>0 1F1 1B1 1SEND_B1>0 1U
    >>> check_deadlock_free(s)
    >>> parse_action("1SEND_F0>2")
    Action(kind='SEND', batch=0, partition=1, wave='', lane='', start_us=0.0, dur_us=0.0, \
peer=2, moves='F')
    >>> parse_schedule(format_schedule(s), name=s.name) == strip_timing(s)
    True
    >>> bad = parse_schedule("rank 0: 0F0 0RECV_B0<1 0SEND_F0>1 0B0\\n"
    ...                      "rank 1: 1RECV_F0<0 1F0 1B0 1SEND_B0>0")
    >>> check_deadlock_free(bad)
    Traceback (most recent call last):
    ...
    tidal.ir.errors.PlanError: schedule 'parsed' deadlocks: rank 0 waits at action 1 \
(0RECV_B0<1): blocking receive from rank 1, which waits at action 0 (1RECV_F0<0); rank 1 \
waits at action 0 (1RECV_F0<0): blocking receive from rank 0, which waits at action 1 \
(0RECV_B0<1)
"""
from __future__ import annotations

import csv
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Optional, Sequence

from tidal.ir.errors import PlanError
from tidal.ir.schedule import Action, Schedule

_P2P = ("SEND", "RECV")
_WITH_BATCH = ("F", "B", "W", "X", *_P2P)   # kinds whose compact form always names a batch
_COMPUTE = ("F", "B", "W")
_TOKEN = re.compile(r"(?:(?P<wave>[A-Za-z]+):)?(?P<stage>\d+)"
                    r"(?P<kind>SEND_[FB]|RECV_[FB]|[FBWSXAU])(?P<batch>\d+)?"
                    r"(?:(?P<dir>[<>])(?P<peer>\d+))?(?:@(?P<lane>[\w.-]*))?")
_LANE = re.compile(r"[\w.-]*")
_RANK_LINE = re.compile(r"\s*rank\s+(\d+)\s*:(.*)")


# -- compact form ------------------------------------------------------------------------------
def format_action(a: Action) -> str:
    """``a`` in the compact form (``1F0``, ``1SEND_F0>2``, ``T:0A1``, ``2A@comm``); drops the
    predicted times. Raises ``ValueError`` if a field cannot be written (a negative stage).

    Example:
        >>> format_action(Action("RECV", 3, 2, peer=1, moves="B"))
        '2RECV_B3<1'
    """
    if a.partition < 0 or a.batch < 0:
        raise ValueError(f"{a!r}: a negative stage or micro-batch has no compact form")
    if a.wave and not a.wave.isalpha():
        raise ValueError(f"{a!r}: wave {a.wave!r} must be letters to print compactly")
    if not _LANE.fullmatch(a.lane):
        raise ValueError(f"{a!r}: lane {a.lane!r} must be letters, digits, '_', '.' or '-'")
    wave = f"{a.wave}:" if a.wave else ""
    kind = f"{a.kind}_{a.moves}" if a.kind in _P2P else a.kind
    batch = str(a.batch) if a.kind in _WITH_BATCH or a.batch else ""
    peer = "" if a.peer < 0 else (">" if a.kind == "SEND" else "<") + str(a.peer)
    lane = "" if a.lane == a.wave else f"@{a.lane}"
    return f"{wave}{a.partition}{kind}{batch}{peer}{lane}"


def parse_action(text: str) -> Action:
    """The action a compact token names (the reverse of :func:`format_action`; times are 0).
    Raises ``ValueError`` naming the token when it is not one.

    Example:
        >>> parse_action("K:0B3") == Action("B", 3, 0, wave="K", lane="K")
        True
        >>> parse_action("1Q0")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: bad action token '1Q0': expected [wave:]stage kind... (e.g. 1F0, ...)
    """
    m = _TOKEN.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"bad action token {text!r}: expected [wave:]stage kind[micro-batch]"
                         f"[>peer|<peer][@lane] with kind one of F B W S X A U SEND_F SEND_B "
                         f"RECV_F RECV_B (e.g. 1F0, 2SEND_F0>3)")
    kind, moves = (m["kind"].split("_") + [""])[:2]
    if kind in _WITH_BATCH and m["batch"] is None:
        raise ValueError(f"bad action token {text!r}: {m['kind']} needs a micro-batch "
                         f"(e.g. {m['stage']}{m['kind']}0)")
    peer = -1
    if m["dir"]:
        want = {"SEND": ">", "RECV": "<"}.get(kind)
        if m["dir"] != want:
            raise ValueError(f"bad action token {text!r}: only a SEND names its peer with '>' "
                             f"and only a RECV with '<'")
        peer = int(m["peer"])
    wave = m["wave"] or ""
    try:
        return Action(kind, int(m["batch"] or 0), int(m["stage"]), wave=wave,
                      lane=wave if m["lane"] is None else m["lane"], peer=peer, moves=moves)
    except PlanError as e:
        raise ValueError(f"bad action token {text!r}: {e}") from None


def format_schedule(schedule: Schedule) -> str:
    """Each rank's actions as one line of compact tokens, ``rank 0: 0F0 0SEND_F0>1 ...``."""
    return "\n".join(f"rank {r}: {' '.join(format_action(a) for a in acts)}".rstrip()
                     for r, acts in enumerate(schedule.ranks))


def parse_schedule(text: str, name: str = "parsed",
                   data_parallel: Optional[bool] = None) -> Schedule:
    """The schedule :func:`format_schedule` printed (blank lines are skipped; the ranks must be
    0, 1, ... in order). Partitions and batches are inferred (:func:`from_actions`). Raises
    ``ValueError`` naming the line or token at fault."""
    ranks: list[list[Action]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _RANK_LINE.fullmatch(line)
        if m is None or int(m[1]) != len(ranks):
            raise ValueError(f"schedule line {line!r}: expected 'rank {len(ranks)}: <actions>'")
        ranks.append([parse_action(tok) for tok in m[2].split()])
    return from_actions(name, ranks, data_parallel)


def schedule_to_csv(schedule: Schedule, path: str | Path) -> None:
    """Write ``schedule`` as CSV: one row per rank, one compact action per cell (as torch's
    ``_dump_csv``). Times, notes, the name and the data-parallel flag are not written."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for acts in schedule.ranks:
            writer.writerow([format_action(a) for a in acts])


def schedule_from_csv(path: str | Path, name: Optional[str] = None,
                      data_parallel: Optional[bool] = None) -> Schedule:
    """Read a schedule written by :func:`schedule_to_csv` (or torch's ``_dump_csv``; empty
    cells are skipped). ``name`` defaults to the file's stem; partitions, batches and (unless
    given) ``data_parallel`` are inferred. Raises ``ValueError`` naming row, column and token.

    Example:
        >>> import os, tempfile
        >>> s = gpipe(3, 2)
        >>> path = os.path.join(tempfile.mkdtemp(), "gpipe.csv")
        >>> schedule_to_csv(s, path)
        >>> schedule_from_csv(path) == strip_timing(s)
        True
    """
    ranks: list[list[Action]] = []
    with open(path, newline="") as f:
        for r, row in enumerate(csv.reader(f)):
            acts = []
            for c, cell in enumerate(row):
                if not cell.strip():
                    continue
                try:
                    acts.append(parse_action(cell))
                except ValueError as e:
                    raise ValueError(f"{path}: row {r + 1} column {c + 1}: {e}") from None
            ranks.append(acts)
    return from_actions(Path(path).stem if name is None else name, ranks, data_parallel)


def from_actions(name: str, ranks: Sequence[Sequence[Action]],
                 data_parallel: Optional[bool] = None) -> Schedule:
    """A schedule of the given per-rank actions: ``partitions`` is one more than the largest
    stage named, ``batches`` one more than the largest micro-batch of an F/B/W (of any action
    when there is none); ``data_parallel`` (when None) is whether some forward runs on two
    ranks."""
    acts = [a for r in ranks for a in r]
    compute = [a for a in acts if a.kind in _COMPUTE] or acts
    if data_parallel is None:
        seen = Counter((a.partition, a.batch, a.wave) for a in acts if a.kind == "F")
        owners = {(a.partition, a.batch, a.wave, r) for r, rs in enumerate(ranks)
                  for a in rs if a.kind == "F"}
        data_parallel = len(owners) > len(seen)
    return Schedule(name=name, ranks=tuple(tuple(r) for r in ranks),
                    partitions=1 + max((a.partition for a in acts), default=0),
                    batches=1 + max((a.batch for a in compute), default=0),
                    data_parallel=data_parallel)


def strip_timing(schedule: Schedule) -> Schedule:
    """``schedule`` as the compact form and CSV keep it: times zeroed, notes dropped."""
    ranks = tuple(tuple(replace(a, start_us=0.0, dur_us=0.0) for a in acts)
                  for acts in schedule.ranks)
    return replace(schedule, ranks=ranks, notes=())


def peak_in_flight(schedule: Schedule, rank: int) -> int:
    """The most forwards rank ``rank`` holds at once whose backward has not run yet (the
    activations it keeps): ``N - rank`` for 1F1B, ``M`` for GPipe."""
    peak = live = 0
    for a in schedule.for_rank(rank):
        live += {"F": 1, "B": -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


# -- builders ----------------------------------------------------------------------------------
def _count(fn: str, what: str, value: object, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{fn}({what}={value!r}): need an integer >= {least}")
    return value


def _times(fn: str, **values: float) -> None:
    for what, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{fn}({what}={v!r}): need a positive time")


def _backward(stage: int, mb: int, split: bool) -> list[Action]:
    return [Action("B", mb, stage), Action("W", mb, stage)] if split else [Action("B", mb, stage)]


def _durations(fwd_us: float, bwd_us: float, split: bool) -> dict[str, float]:
    return {"F": fwd_us, "B": bwd_us / 2 if split else bwd_us, "W": bwd_us / 2}


def gpipe(ranks: int, microbatches: int, *, split_backward: bool = False,
          fwd_us: float = 1.0, bwd_us: float = 2.0) -> Schedule:
    """GPipe on ``ranks`` stages (stage r on rank r): every rank runs all ``microbatches``
    forwards, then all backwards in the same order, then updates its stage (``rU``); transfers
    are explicit SEND/RECV. ``split_backward`` runs each backward as ``B`` (input gradient, sent
    on at once) then ``W`` (weight gradient). Times are predicted from ``fwd_us``/``bwd_us``.

    Example:
        >>> print(format_schedule(gpipe(2, 2)))
        rank 0: 0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1 0U
        rank 1: 1RECV_F0<0 1F0 1RECV_F1<0 1F1 1B0 1SEND_B0>0 1B1 1SEND_B1>0 1U
    """
    n = _count("gpipe", "ranks", ranks)
    m = _count("gpipe", "microbatches", microbatches)
    _times("gpipe", fwd_us=fwd_us, bwd_us=bwd_us)
    compute = [[*(Action("F", i, r) for i in range(m)),
                *(b for i in range(m) for b in _backward(r, i, split_backward)),
                Action("U", partition=r)] for r in range(n)]
    return with_transfers("gpipe", compute, n, m,
                          _durations(fwd_us, bwd_us, split_backward))


def one_f_one_b(ranks: int, microbatches: int, *, split_backward: bool = False,
                fwd_us: float = 1.0, bwd_us: float = 2.0) -> Schedule:
    """1F1B (PipeDream-flush) on ``ranks`` stages (stage r on rank r): rank r warms up with
    ``min(N-1-r, M)`` forwards, then alternates one forward and one backward, then cools down
    with the remaining backwards and updates its stage; so it holds at most ``N - r``
    micro-batches' activations (GPipe holds ``M``). Otherwise as :func:`gpipe`.

    Example:
        >>> s = one_f_one_b(4, 8)
        >>> [peak_in_flight(s, r) for r in range(4)]
        [4, 3, 2, 1]
    """
    n = _count("one_f_one_b", "ranks", ranks)
    m = _count("one_f_one_b", "microbatches", microbatches)
    _times("one_f_one_b", fwd_us=fwd_us, bwd_us=bwd_us)
    compute = []
    for r in range(n):
        warm = min(n - 1 - r, m)
        acts = [Action("F", i, r) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i, r), *_backward(r, i, split_backward)]
        for i in range(m - warm, m):
            acts += _backward(r, i, split_backward)
        compute.append(acts + [Action("U", partition=r)])
    return with_transfers("1f1b", compute, n, m, _durations(fwd_us, bwd_us, split_backward))


def round_robin(ranks: int, *, fwd_us: float = 1.0, bwd_us: float = 2.0) -> Schedule:
    """Wavelet's round-robin schedule (Fig. 10) on ``ranks`` = N partitions and N micro-batches:
    at forward cycle c rank i switches to partition c (``cS``) and runs it on micro-batch
    ``(i - c) mod N``, sending the activation to rank i+1 (mod N); the backward mirrors it from
    partition N-1 down (gradients go to rank i-1), each partition all-reduced (``pA``) on every
    rank after its backward; every rank then updates every partition.

    Example:
        >>> print(format_schedule(round_robin(2)))
        rank 0: 0S 0F0 0SEND_F0>1 1RECV_F1<1 1S 1F1 1B1 1SEND_B1>1 0RECV_B0<1 1A 0S 0B0 0A 0U 1U
        rank 1: 0S 0F1 1RECV_F0<0 0SEND_F1>0 1S 1F0 1B0 0RECV_B1<0 1SEND_B0>0 1A 0S 0B1 0A 0U 1U
    """
    n = _count("round_robin", "ranks", ranks)
    _times("round_robin", fwd_us=fwd_us, bwd_us=bwd_us)
    compute = []
    for i in range(n):
        acts = [a for c in range(n) for a in (Action("S", partition=c),
                                               Action("F", (i - c) % n, c))]
        for d in range(n):
            p = n - 1 - d
            acts += [Action("S", partition=p)] if d else []
            acts += [Action("B", (i - p) % n, p), Action("A", partition=p)]
        compute.append(acts + [Action("U", partition=p) for p in range(n)])
    return with_transfers("round_robin", compute, n, n, {"F": fwd_us, "B": bwd_us})


def tick_tock(ranks: int, steps: int = 1, *, fwd_us: float = 1.0, bwd_us: float = 2.0,
              allreduce_us: float = 0.0) -> Schedule:
    """Wavelet's tick-tock schedule (Fig. 9, App. B.1.1) of ``steps`` steps on ``ranks``
    data-parallel ranks: the tick wave (``T``, lane ``T``) runs the even iterations, the tock
    wave (``K``) the odd ones, a tock forward starting when the tick's forward of its step ends;
    each iteration m ends with its wave's all-reduce ``A m`` (which waits for the other wave's
    gradient, Eq. 1) and update ``U m``. The same schedule as the ``tick_tock`` pass builds.

    Example:
        >>> print(format_schedule(tick_tock(1)))
        rank 0: T:0F0 T:0B0 K:0F1 K:0B1 T:0A T:0U K:0A1 K:0U1
    """
    n = _count("tick_tock", "ranks", ranks)
    steps = _count("tick_tock", "steps", steps)
    _times("tick_tock", fwd_us=fwd_us, bwd_us=bwd_us)
    acts: list[Action] = []
    f_end, b_end = {-1: 0.0}, {-1: 0.0}
    u_end = {"T": 0.0, "K": 0.0}
    for m in range(2 * steps):
        wave = "TK"[m % 2]
        f0 = max(f_end[m - 1], u_end[wave])
        f_end[m] = f0 + fwd_us
        b_end[m] = f_end[m] + bwd_us
        a0 = max(b_end[m], b_end[m - 1] if m else 0.0)
        u_end[wave] = a0 + allreduce_us
        acts += [Action("F", m, wave=wave, lane=wave, start_us=f0, dur_us=fwd_us),
                 Action("B", m, wave=wave, lane=wave, start_us=f_end[m], dur_us=bwd_us),
                 Action("A", m, wave=wave, lane=wave, start_us=a0, dur_us=allreduce_us),
                 Action("U", m, wave=wave, lane=wave, start_us=u_end[wave])]
    acts.sort(key=lambda a: (a.start_us, a.lane != "T", a.batch))
    gang = 2 * steps * (fwd_us + bwd_us + allreduce_us)
    return Schedule(name="tick_tock", ranks=tuple(tuple(acts) for _ in range(n)), partitions=1,
                    batches=2 * steps, data_parallel=True,
                    notes=(("offset_us", float(fwd_us)), ("gang_us", float(gang))))


# -- transfers ---------------------------------------------------------------------------------
def with_transfers(name: str, compute: Sequence[Sequence[Action]], partitions: int,
                   batches: int, durations: Mapping[str, float]) -> Schedule:
    """The schedule of per-rank ``compute`` orders (F/B/W/S/A/U; where a forward runs, its
    backward runs too) with explicit transfers: a SEND on the producing rank and a RECV on the
    consuming one wherever consecutive stages of a micro-batch run on different ranks. It runs
    the orders with ``durations`` (by kind; missing ones 0), picking at each step the event that
    can start first (a transfer when it ties), and lists every event on its ranks in that one
    global order, so the result is deadlock-free by construction; the times it predicts are
    kept, and the note ``bubble_fraction`` says how much of ranks x makespan is idle. Raises
    ``PlanError`` if the compute orders themselves deadlock."""
    placed = _placement(compute)
    run = _Run(compute, partitions, data_parallel=False)
    n = len(compute)
    out: list[list[Action]] = [[] for _ in range(n)]
    clock = [0.0] * n
    pending: list[tuple[str, int, int, int, int, str]] = []  # moves, src, dst, stage, mb, wave
    while pending or not run.finished():
        events = [(max(clock[t[1]], clock[t[2]]), 0, t[1], k) for k, t in enumerate(pending)]
        for r in range(n):
            group = run.group(r)
            if group and group[0] == r:
                events.append((max(clock[q] for q in group), 1, r, -1))
        if not events:
            raise PlanError(f"{name}: the compute orders deadlock: {run.stuck()}")
        start, kind, r, k = min(events)
        if kind == 0:
            moves, src, dst, stage, mb, wave = pending.pop(k)
            recv_stage = stage + 1 if moves == "F" else stage - 1
            out[src].append(Action("SEND", mb, stage, wave, wave, start, peer=dst, moves=moves))
            out[dst].append(Action("RECV", mb, recv_stage, wave, wave, start, peer=src,
                                   moves=moves))
            clock[src] = clock[dst] = start
            run.sim.have[dst].add((moves, stage, mb, wave))
            continue
        group = run.group(r)
        for q, a in zip(group, run.advance(group)):
            dur = float(durations.get(a.kind, 0.0))
            out[q].append(replace(a, start_us=start, dur_us=dur))
            clock[q] = start + dur
            pending += _transfers_after(a, q, placed, partitions)
    span = max(clock, default=0.0)
    busy = sum(a.dur_us for acts in out for a in acts)
    notes = (("bubble_fraction", 1 - busy / (n * span) if span else 0.0),)
    return Schedule(name=name, ranks=tuple(tuple(r) for r in out), partitions=partitions,
                    batches=batches, notes=notes)


def _placement(compute: Sequence[Sequence[Action]]) -> dict[tuple[int, int, str], int]:
    """The rank of each (stage, micro-batch, wave)'s forward; raises unless it runs once and
    its backward (and weight gradient) runs on the same rank."""
    where: dict[tuple[int, int, str], int] = {}
    for r, acts in enumerate(compute):
        for a in acts:
            if a.kind in _P2P or a.kind == "X":
                raise PlanError(f"with_transfers: rank {r} lists {format_action(a)}; give "
                                f"compute only, transfers are added")
            key = (a.partition, a.batch, a.wave)
            if a.kind == "F":
                if key in where:
                    raise PlanError(f"with_transfers: {format_action(a)} runs on ranks "
                                    f"{where[key]} and {r}")
                where[key] = r
    for r, acts in enumerate(compute):
        for a in acts:
            if a.kind in ("B", "W") and where.get((a.partition, a.batch, a.wave)) != r:
                raise PlanError(f"with_transfers: rank {r} runs {format_action(a)} but its "
                                f"forward runs on rank "
                                f"{where.get((a.partition, a.batch, a.wave), 'none')}")
    return where


def _transfers_after(a: Action, rank: int, placed: Mapping[tuple[int, int, str], int],
                     partitions: int) -> list[tuple[str, int, int, int, int, str]]:
    """The transfer ``a`` (just run on ``rank``) makes necessary: its activation to the next
    stage's rank, or its input gradient to the previous stage's rank."""
    step = {"F": 1, "B": -1}.get(a.kind)
    if step is None or not 0 <= a.partition + step < partitions:
        return []
    dst = placed.get((a.partition + step, a.batch, a.wave), rank)
    return [] if dst == rank else [(a.kind, rank, dst, a.partition, a.batch, a.wave)]


# -- the checker -------------------------------------------------------------------------------
class _Sim:
    """What each rank has done and holds while its action list runs: computed F/B/W, the
    activations and gradients it holds (tokens ``(moves, producing stage, mb, wave)``), and the
    F/B/W/A it has still to run per partition (per partition and batch when data-parallel)."""

    def __init__(self, ranks: Sequence[Sequence[Action]], partitions: int,
                 data_parallel: bool) -> None:
        self.partitions = partitions
        self.dp = data_parallel
        self.done: list[set[tuple[str, int, int, str]]] = [set() for _ in ranks]
        self.have: list[set[tuple[str, int, int, str]]] = [set() for _ in ranks]
        self.todo = [Counter((a.kind, self._scope(a)) for a in acts) for acts in ranks]

    def _scope(self, a: Action) -> tuple[int, int]:
        return (a.partition, a.batch if self.dp else -1)

    def need(self, r: int, a: Action) -> str:
        """Why rank ``r`` cannot run ``a`` yet ('' when it can), leaving rendezvous aside."""
        s, m, w = a.partition, a.batch, a.wave
        wants: list[tuple[set, tuple[str, int, int, str], str]] = []
        if a.kind == "F" and s > 0:
            wants.append((self.have[r], ("F", s - 1, m, w), "the activation of"))
        elif a.kind == "B":
            wants.append((self.done[r], ("F", s, m, w), "its own"))
            if s < self.partitions - 1:
                wants.append((self.have[r], ("B", s + 1, m, w), "the gradient of"))
        elif a.kind == "W":
            wants.append((self.done[r], ("B", s, m, w), "its own"))
        elif a.kind == "SEND":
            wants.append((self.done[r], (a.moves, s, m, w), "its own"))
        elif a.kind == "X":
            wants.append((self.done[r], ("F", s, m, w), "its own"))
        for pool, key, what in wants:
            if key not in pool:
                return f"needs {what} {format_action(Action(key[0], m, key[1], w, w))}"
        if a.kind in ("A", "U"):
            left = [k for k in ("B", "W", "A")[:3 if a.kind == "U" else 2]
                    if self.todo[r][(k, self._scope(a))]]
            if left:
                of = f" micro-batch {m}" if self.dp else ""
                return (f"needs every {'/'.join(left)} of stage {s}{of} on this rank first "
                        f"(some run later)")
        return ""

    def run(self, r: int, a: Action) -> None:
        """Rank ``r`` ran ``a`` (a RECV's token is added by the caller, who knows the peer)."""
        self.todo[r][(a.kind, self._scope(a))] -= 1
        key = (a.kind, a.partition, a.batch, a.wave)
        if a.kind in _COMPUTE:
            self.done[r].add(key)
        if a.kind in ("F", "B"):
            self.have[r].add(key)
        if a.kind == "RECV":
            stage = a.partition - 1 if a.moves == "F" else a.partition + 1
            self.have[r].add((a.moves, stage, a.batch, a.wave))


def _collectives(ranks: Sequence[Sequence[Action]]) -> dict[tuple, tuple[int, ...]]:
    """Per collective instance (its key and occurrence), the ranks taking part; raises if
    ranks run one a different number of times. An ``A`` is keyed by wave, stage and batch; an
    ``X`` (a ring transfer of every rank's latest output) by wave and stage."""
    counts: dict[tuple, Counter] = {}
    for r, acts in enumerate(ranks):
        for a in acts:
            if a.kind in ("A", "X"):
                counts.setdefault(_coll_key(a), Counter())[r] += 1
    out: dict[tuple, tuple[int, ...]] = {}
    for key, per_rank in counts.items():
        if len(set(per_rank.values())) > 1:
            times = ", ".join(f"{c} time(s) on rank {r}" for r, c in sorted(per_rank.items()))
            raise PlanError(f"collective {key[0]} of stage {key[2]} (wave {key[1]!r}) runs "
                            f"{times}: every rank must join each one")
        for occ in range(next(iter(per_rank.values()))):
            out[(key, occ)] = tuple(sorted(per_rank))
    return out


def _coll_key(a: Action) -> tuple:
    return (a.kind, a.wave, a.partition, a.batch if a.kind == "A" else -1)


def _instances(ranks: Sequence[Sequence[Action]]) -> list[list[tuple]]:
    """Per rank and action, which shared event it is: ``(key, occurrence)`` of a collective
    (``_coll_key``) or of a transfer (``_p2p_key``, counted per kind: the k-th SEND of a key
    meets the k-th RECV of it); () for a local action."""
    out = []
    for r, acts in enumerate(ranks):
        seen: Counter = Counter()
        row: list[tuple] = []
        for a in acts:
            if a.kind in ("A", "X", *_P2P):
                key = _coll_key(a) if a.kind in ("A", "X") else _p2p_key(r, a)
                row.append((key, seen[(a.kind, key)]))
                seen[(a.kind, key)] += 1
            else:
                row.append(())
        out.append(row)
    return out


class _Run:
    """Per-rank action lists being run: program counters, state, shared-event instances."""

    def __init__(self, ranks: Sequence[Sequence[Action]], partitions: int,
                 data_parallel: bool) -> None:
        self.ranks = ranks
        self.pc = [0] * len(ranks)
        self.sim = _Sim(ranks, partitions, data_parallel)
        self.inst = _instances(ranks)
        self.colls = _collectives(ranks)

    def next(self, r: int) -> Optional[Action]:
        return self.ranks[r][self.pc[r]] if self.pc[r] < len(self.ranks[r]) else None

    def finished(self) -> bool:
        return all(self.next(r) is None for r in range(len(self.ranks)))

    def _at(self, q: int, kind: str, inst: tuple) -> bool:
        """Rank ``q`` waits at instance ``inst`` (of an action of ``kind``) and can run it."""
        b = self.next(q)
        return b is not None and b.kind == kind and self.inst[q][self.pc[q]] == inst \
            and not self.sim.need(q, b)

    def group(self, r: int) -> tuple[int, ...]:
        """The ranks that run rank ``r``'s next action together now: ``(r,)`` for a ready local
        action, ``(r, peer)`` for a transfer both sides wait at, every participant of a
        collective all of them wait at; () when it cannot run now."""
        a = self.next(r)
        if a is None or self.sim.need(r, a):
            return ()
        inst = self.inst[r][self.pc[r]]
        if a.kind in _P2P:
            other = "RECV" if a.kind == "SEND" else "SEND"
            return (r, a.peer) if self._at(a.peer, other, inst) else ()
        if a.kind in ("A", "X"):
            members = self.colls[inst]
            return members if all(self._at(q, a.kind, inst) for q in members) else ()
        return (r,)

    def advance(self, group: Sequence[int]) -> list[Action]:
        """Run the next action of every rank of ``group`` (one event); returns them."""
        acts = [self.ranks[q][self.pc[q]] for q in group]
        if acts[0].kind == "X":  # every member receives every member's latest output
            got = {("B" if ("B", a.partition, a.batch, a.wave) in self.sim.done[q] else "F",
                    a.partition, a.batch, a.wave) for q, a in zip(group, acts)}
            for q in group:
                self.sim.have[q] |= got
        for q, a in zip(group, acts):
            self.sim.run(q, a)
            self.pc[q] += 1
        return acts

    def where(self, r: int) -> str:
        a = self.next(r)
        return "has finished" if a is None else \
            f"waits at action {self.pc[r]} ({format_action(a)})"

    def stuck(self) -> str:
        """One clause per unfinished rank: where it waits and on what."""
        parts = []
        for r in range(len(self.ranks)):
            a = self.next(r)
            if a is None:
                continue
            why = self.sim.need(r, a)
            if not why and a.kind in _P2P:
                verb = "send to" if a.kind == "SEND" else "receive from"
                why = f"blocking {verb} rank {a.peer}, which {self.where(a.peer)}"
            elif not why and a.kind in ("A", "X"):
                inst = self.inst[r][self.pc[r]]
                late = [f"rank {q} {self.where(q)}" for q in self.colls[inst]
                        if not self._at(q, a.kind, inst)]
                why = f"collective over ranks {list(self.colls[inst])}: {', '.join(late)}"
            parts.append(f"rank {r} {self.where(r)}: {why}")
        return "; ".join(parts)


def _resolve_peers(schedule: Schedule) -> list[list[Action]]:
    """The ranks' actions with every SEND/RECV's peer given (inferred from where the
    neighbouring stage's F or B runs when it is -1); raises for a peer that is not another
    rank or a transfer past the first or last stage."""
    n, last = len(schedule.ranks), schedule.partitions - 1
    runs: dict[tuple[str, int, int, str], set[int]] = {}
    for r, acts in enumerate(schedule.ranks):
        for a in acts:
            if a.kind in ("F", "B"):
                runs.setdefault((a.kind, a.partition, a.batch, a.wave), set()).add(r)
    out = []
    for r, acts in enumerate(schedule.ranks):
        fixed = []
        for a in acts:
            if a.kind in _P2P:
                step = (1 if a.moves == "F" else -1) * (1 if a.kind == "SEND" else -1)
                other = a.partition + step
                if not 0 <= other <= last:
                    raise PlanError(f"schedule {schedule.name!r}: rank {r}'s "
                                    f"{format_action(a)} moves past the first or last stage "
                                    f"(0..{last})")
                if a.peer < 0:
                    peers = runs.get((a.moves, other, a.batch, a.wave), set())
                    if len(peers) != 1:
                        raise PlanError(f"schedule {schedule.name!r}: cannot infer the peer of "
                                        f"rank {r}'s {format_action(a)}: {a.moves}{other},"
                                        f"{a.batch} runs on ranks {sorted(peers)}")
                    a = replace(a, peer=peers.pop())
                if a.peer == r or a.peer >= n:
                    raise PlanError(f"schedule {schedule.name!r}: rank {r}'s "
                                    f"{format_action(a)} names peer {a.peer}, not another rank "
                                    f"of {n}")
            fixed.append(a)
        out.append(fixed)
    return out


def _p2p_key(r: int, a: Action) -> tuple:
    """What a SEND/RECV moves: (src, dst, moves, producing stage, micro-batch, wave)."""
    if a.kind == "SEND":
        return (r, a.peer, a.moves, a.partition, a.batch, a.wave)
    stage = a.partition - 1 if a.moves == "F" else a.partition + 1
    return (a.peer, r, a.moves, stage, a.batch, a.wave)


def _check_matched(name: str, ranks: Sequence[Sequence[Action]]) -> None:
    """Raise ``PlanError`` listing every send without its receive and receive without its
    send (matched by what moves, between which ranks, and how many times)."""
    count = {kind: Counter(_p2p_key(r, a) for r, acts in enumerate(ranks) for a in acts
                           if a.kind == kind) for kind in _P2P}
    faults = []
    for r, acts in enumerate(ranks):
        for a in acts:
            if a.kind not in _P2P:
                continue
            key = _p2p_key(r, a)
            other = "RECV" if a.kind == "SEND" else "SEND"
            if count[a.kind][key] > count[other][key]:
                count[a.kind][key] -= 1
                what = "receive" if a.kind == "SEND" else "send"
                faults.append(f"rank {r}'s {format_action(a)} has no matching {what} on "
                              f"rank {a.peer}")
    if faults:
        raise PlanError(f"schedule {name!r}: " + "; ".join(faults))


def check_deadlock_free(schedule: Schedule) -> None:
    """Prove ``schedule`` runs to the end: run each rank's actions in order, a SEND/RECV as a
    blocking rendezvous with the matching RECV/SEND on its peer, an ``A`` (or ``X``) as a
    collective of every rank that lists it, and every action only once what it needs is there
    (F of stage s>0 the activation of stage s-1 from its own F or a RECV_F; B its own F and the
    gradient of stage s+1 unless last; W its B; a SEND what it sends; A every B/W of its stage
    on the rank, U also every A; per micro-batch for a data-parallel schedule). The run does
    not depend on timing, so passing means no interleaving can deadlock.

    Raises ``PlanError`` naming every send without a receive (or the reverse), or, when no rank
    can go on, each stuck rank, the action it waits at and on what.

    Example:
        >>> for n in range(1, 5):
        ...     check_deadlock_free(one_f_one_b(n, 2 * n))
        >>> bad = parse_schedule("rank 0: 0F0 0SEND_F0>1 0B0\\nrank 1: 1F0 1B0")
        >>> check_deadlock_free(bad)
        Traceback (most recent call last):
        ...
        tidal.ir.errors.PlanError: schedule 'parsed': rank 0's 0SEND_F0>1 has no matching \
receive on rank 1
    """
    for r, acts in enumerate(schedule.ranks):
        for a in acts:
            if a.partition >= schedule.partitions:
                raise PlanError(f"schedule {schedule.name!r}: rank {r}'s {format_action(a)} "
                                f"names stage {a.partition} of {schedule.partitions}")
    ranks = _resolve_peers(schedule)
    _check_matched(schedule.name, ranks)
    run = _Run(ranks, schedule.partitions, schedule.data_parallel)
    moved = True
    while moved:
        moved = False
        for r in range(len(ranks)):
            while group := run.group(r):
                run.advance(group)
                moved = True
    if not run.finished():
        raise PlanError(f"schedule {schedule.name!r} deadlocks: {run.stuck()}")

"""The program of one round-robin step (Wavelet §3.3) from the plan's schedule: pure layout, no
tensors.

:func:`round_robin_program` turns the per-rank action lists of a ``RoundRobinPlan``'s schedule
into the pieces of the ranks run here (one rank with a process group, all N without), in
schedule order with each all-reduce after the transfer that follows it, and a :class:`Slot`
per piece saying what it does. ``S p`` switches to partition p (``load`` stream), ``F``/``B``
run a partition's segments (``compute``), ``X`` moves activations or their gradients to the
next or previous rank and ``A p`` all-reduces partition p's gradients (``comm``), ``loss``
all-reduces the loss once the last forward ran. With a process group a switch moves partitions
in and out (:class:`Residency` says which and what it waits for), each partition is updated on
its own (``U p``, on the ``update`` stream, after its all-reduce and before the switch that
evicts it) and the step ends with the ``restore`` of every partition; in one process ``U``
steps the optimizer once, after every all-reduce. The open step (``Compiled.backward``:
``finish``, the name of its last piece) has no ``U`` piece: it ends with ``finish`` (after the
``restore`` with a process group; a partition is then kept only while its compute or its
all-reduce needs it), and inside ``no_sync`` (``sync`` False) each ``A p`` is ``buffers p``,
which averages the partition's buffers and syncs no gradient. When the micro-batches differ
in shape (a global batch that does not cut into N equal ones), ``batch_nodes`` gives each
micro-batch's own segments (their captures differ; one may run eagerly).

Example:
    >>> from tidal.ir.schedule import Action, Schedule
    >>> acts = tuple(Action(kind) for kind in "SFBAU")     # one partition, one rank
    >>> program, slots = round_robin_program(Schedule("one", (acts,)), 1, (0,), 1,
    ...                                      [("f",)], [("b",)])
    >>> [(p.name, p.stream, p.deps) for p in program.pieces]  # doctest: +NORMALIZE_WHITESPACE
    [('r0:S0', 'load', ()), ('r0:F0,0', 'compute', (0,)), ('r0:B0,0', 'compute', (0, 1)),
     ('A0', 'comm', (2,)), ('U', 'compute', (2, 3))]
    >>> slots[-1]
    Slot(kind='U', rank=0, partition=-1, batch=0, backward=False, keep=())
    >>> opened, _ = round_robin_program(Schedule("one", (acts,)), 1, (0,), 1, [("f",)],
    ...                                 [("b",)], finish="accumulate", sync=False)
    >>> [p.name for p in opened.pieces]
    ['r0:S0', 'r0:F0,0', 'r0:B0,0', 'buffers 0', 'accumulate']
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from tidal.ir.program import COMM, COMPUTE, LOAD, OPTIMIZER, POINT_TO_POINT, Piece, Program
from tidal.ir.schedule import Action, Schedule

UPDATE = "update"
"""The stream of the per-partition optimizer steps (a compute stream of its own: an update
overlaps the backward of the next partition down, as Wavelet's Fig. 10 runs it)."""


class Slot(NamedTuple):
    """What a piece does: the schedule action ``kind`` ('S', 'F', 'B', 'X', 'A', 'U', 'L' for
    the loss all-reduce, 'R' for the end-of-step restore or 'G' for the open step's last piece)
    of ``rank`` on (``partition``, ``batch``); ``backward`` tells a backward transfer or switch
    from a forward one. With a process group, ``keep`` is the partitions a switch leaves
    resident and 'U' updates ``partition`` alone; without one, 'U' (``partition`` -1) updates
    them all."""

    kind: str
    rank: int
    partition: int = 0
    batch: int = 0
    backward: bool = False
    keep: tuple[int, ...] = ()


class Residency:
    """Which partitions one rank keeps resident while the program is laid out: a switch to
    ``p`` keeps ``p``, the partition of the latest compute piece (the first switch: the next
    one's, so that it need not load it again) and the partition all-reduced but not yet
    updated, and evicts the others; it waits for every piece that used a partition it evicts
    since that partition was loaded (``users``)."""

    def __init__(self, n: int, switches: Sequence[int]):
        self.resident = set(range(n))   # a step starts whole (the last one's restore)
        self.users: dict[int, list[int]] = {q: [] for q in range(n)}
        self.switches = list(switches)  # the partitions of the switches still to lay out
        self.last: Optional[int] = None
        self.pending: Optional[int] = None

    def use(self, p: int, piece: int, compute: bool = False) -> None:
        self.users[p].append(piece)
        if compute:
            self.last = p

    def switch(self, p: int) -> tuple[tuple[int, ...], list[int]]:
        """(partitions kept, pieces to wait for) of the next switch, to partition ``p``."""
        self.switches.pop(0)
        keep = {p} | ({self.last} if self.last is not None else set(self.switches[:1]))
        keep |= {self.pending} if self.pending is not None else set()
        evicted = self.resident - keep
        deps = sorted(i for q in evicted for i in self.users[q])
        for q in evicted:
            self.users[q] = []
        self.resident = keep
        return tuple(sorted(keep)), deps


def transfer_first(actions: Sequence[Action]) -> list[int]:
    """The indices of ``actions`` with each ``A`` moved after the ``X`` that follows it (the
    transfer goes first on the comm stream, so the next backward waits only for it)."""
    order = list(range(len(actions)))
    for k in range(len(order) - 1):
        if actions[order[k]].kind == "A" and actions[order[k + 1]].kind == "X":
            order[k], order[k + 1] = order[k + 1], order[k]
    return order


class _Layout:
    """The pieces and slots of :func:`round_robin_program`, laid out action by action."""

    def __init__(self, n: int, here: tuple[int, ...], world: int, switches: Sequence[int],
                 forward: Sequence[Sequence[str]], backward: Sequence[Sequence[str]],
                 finish: str = "", sync: bool = True,
                 batch_nodes: Optional[Sequence[tuple[Sequence[Sequence[str]],
                                                      Sequence[Sequence[str]]]]] = None):
        self.n, self.here, self.one, self.world = n, here, world == 1, world
        self.open, self.sync = finish, sync
        # per micro-batch, per kind, per partition: the segment's joint-graph nodes
        self.nodes = [{"F": f, "B": b} for f, b in (batch_nodes or [(forward, backward)] * n)]
        self.pieces: list[Piece] = []
        self.slots: list[Slot] = []
        self.compute: dict[int, Optional[int]] = dict.fromkeys(here)
        self.load: dict[int, Optional[int]] = dict.fromkeys(here)
        self.ran: dict[tuple[str, int, int], int] = {}   # (kind, rank, partition) -> piece
        self.shared: list[int] = []                      # all-reduces and the loss, for U
        self.updates: list[int] = []
        self.in_backward: set[int] = set()
        self.res = None if self.one else Residency(n, switches)

    def add(self, name: str, stream: str, deps: Sequence[Optional[int]], slot: Slot,
            nodes: Sequence[str] = (), kind: str = "") -> int:
        self.pieces.append(Piece(name, stream, tuple(sorted({d for d in deps if d is not None})),
                                 tuple(nodes), kind=kind))
        self.slots.append(slot)
        return len(self.pieces) - 1

    def action(self, r: int, a: Action) -> None:
        """Lay out rank ``r``'s action ``a``."""
        pre = f"r{r}:" if self.one else ""
        backward = r in self.in_backward
        if a.kind == "S":
            self.switch(r, a, pre, backward)
        elif a.kind in "FB":
            self.run(r, a, pre)
        elif a.kind == "X":
            self.transfer(r, a, pre, backward)
        elif a.kind == "A" and r == self.here[0]:  # one collective for the ranks here
            self.all_reduce(r, a.partition)
        elif a.kind == "U" and r == self.here[0]:
            self.finish(r)

    def switch(self, r: int, a: Action, pre: str, backward: bool) -> None:
        p = a.partition
        keep, deps = self.res.switch(p) if self.res is not None else ((), [])
        self.load[r] = self.add(f"{pre}S{p}{' bwd' if backward else ''}", LOAD, deps,
                                Slot("S", r, p, a.batch, backward, keep))
        if self.res is not None:
            self.update(r)

    def run(self, r: int, a: Action, pre: str) -> None:
        """``F p,b`` or ``B p,b``: after the switch, the rank's previous compute piece and the
        transfer that brought its input (and, for ``B``, its own ``F``)."""
        p, b, kind, n = a.partition, a.batch, a.kind, self.n
        if kind == "F":
            src = (r - 1) % n if self.one else r
            deps = [self.load[r], self.compute[r], self.ran.get(("Xf", src, p - 1))]
        else:
            self.in_backward.add(r)
            src = (r + 1) % n if self.one else r
            deps = [self.load[r], self.compute[r], self.ran[("F", r, p)],
                    self.ran.get(("Xb", src, p + 1))]
        self.compute[r] = self.ran[(kind, r, p)] = self.add(
            f"{pre}{kind}{p},{b}", COMPUTE, deps, Slot(kind, r, p, b), self.nodes[b][kind][p])
        if self.res is not None:
            self.res.use(p, self.compute[r], compute=True)
        if kind == "F" and p == n - 1 and not self.one:
            self.shared.append(self.add("loss", COMM, [self.compute[r]], Slot("L", r)))

    def transfer(self, r: int, a: Action, pre: str, backward: bool) -> None:
        p, tag = a.partition, "Xb" if backward else "Xf"
        after = self.ran[("B" if backward else "F", r, p)]
        self.ran[(tag, r, p)] = self.add(f"{pre}X{p} {'bwd' if backward else 'fwd'}", COMM,
                                         [after], Slot("X", r, p, a.batch, backward),
                                         kind=POINT_TO_POINT)
        if self.res is not None and not backward:  # what it sends may view a weight
            self.res.use(p, self.ran[(tag, r, p)])

    def all_reduce(self, r: int, p: int) -> None:
        name = f"A{p}" if self.sync else f"buffers {p}"
        self.ran[("A", r, p)] = self.add(name, COMM, [self.ran[("B", q, p)] for q in self.here],
                                         Slot("A", r, p))
        self.shared.append(self.ran[("A", r, p)])
        if self.res is not None:
            self.res.use(p, self.ran[("A", r, p)])
            if not self.open:  # kept resident until its update
                self.res.pending = p

    def update(self, r: int) -> None:
        """``U p`` of the partition all-reduced last (a process group)."""
        q, self.res.pending = self.res.pending, None
        if q is not None:
            self.updates.append(self.add(f"U{q}", UPDATE, [self.ran[("A", r, q)]],
                                         Slot("U", r, q), kind=OPTIMIZER))
            self.res.use(q, self.updates[-1])

    def finish(self, r: int) -> None:
        """The schedule's ``U``: in one process the one optimizer step; with a process group
        the last partition's update, then the ``restore`` of every partition. The open step:
        its ``finish`` piece in place of the updates (after the restore)."""
        if self.res is None:
            if self.open:
                self.add(self.open, COMPUTE, [*self.shared, *self.compute.values()],
                         Slot("G", r, -1))
            else:
                self.add("U", COMPUTE, [*self.shared, *self.compute.values()], Slot("U", r, -1),
                         kind=OPTIMIZER)
            return
        self.update(r)
        used = [i for q in range(self.n) for i in self.res.users[q]]
        restore = self.add("restore", LOAD, [*self.updates, *used, self.compute[r]],
                           Slot("R", r))
        if self.open:
            self.add(self.open, COMPUTE, [restore, *self.shared], Slot("G", r))


def round_robin_program(schedule: Schedule, n: int, here: tuple[int, ...], world: int,
                        forward: Sequence[Sequence[str]], backward: Sequence[Sequence[str]],
                        finish: str = "", sync: bool = True,
                        batch_nodes: Optional[Sequence[tuple[Sequence[Sequence[str]],
                                                             Sequence[Sequence[str]]]]] = None
                        ) -> tuple[Program, tuple[Slot, ...]]:
    """The program of the ranks ``here`` (see the module docstring) on ``world`` ranks, and
    what each piece does. ``forward[p]``/``backward[p]``: the joint-graph nodes of partition
    ``p``'s ``F`` and ``B`` segments (empty: the partition runs eagerly). ``finish``: the name
    of the open step's last piece, in place of the updates ('': the closed step, with them);
    ``sync`` False: the open step inside ``no_sync`` (no gradient all-reduce).
    ``batch_nodes``: per micro-batch b, its own ``(forward, backward)`` in their place (the
    micro-batches of an uneven global batch differ in shape and so in capture)."""
    actions = schedule.ranks
    switches = [a.partition for a in actions[here[0]] if a.kind == "S"]
    layout = _Layout(n, here, world, switches, forward, backward, finish, sync, batch_nodes)
    for k in transfer_first(actions[0]):
        for r in here:
            layout.action(r, actions[r][k])
    return Program(tuple(layout.pieces), world), tuple(layout.slots)

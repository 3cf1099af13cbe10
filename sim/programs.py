"""Programs of execution strategies, built from per-layer costs, and their summary.

Everything here is the one Program type (``tidal.ir.program``) *placed* on the cluster, as the
engine (``tidal.sim.engine``) runs it: each piece on the GPUs it occupies, with its modelled
duration. ``LayerTimes`` holds, for one per-GPU batch size, each layer's forward and backward
time and its parameter bytes; ``layer_times(gm, cluster, batch)`` reads them from an annotated
graph (measured or DeepPool profile when ``cluster.profile`` has the layer, FLOPs otherwise).
``data_parallel`` builds one training iteration of data parallelism by the one data-parallel
schedule (``tidal.ir.program.data_parallel_program``, which the runtime builds from a captured
step): ring all-reduces of DDP-style gradient buckets that overlap the rest of backward. A
burst-parallel plan becomes a Program either under the planner's own cost model
(``burst_parallel``: per layer, transfer, forward + backward, gradient sync) or from per-layer
costs (``burst_execution``: all forwards, all backwards, the gradient sync per set of ranks in
buckets of the one bucket rule, ``tidal.ir.comm_cost.gradient_buckets``). ``schedule_result``
turns a Wavelet schedule into timelines (through its Program, ``tidal.ir.schedule.
schedule_program``, with ``contention``). ``join_ranks`` places the runtime's own per-rank
Programs (the pieces the executor runs) on the cluster, with durations from a model or a
measured trace; ``simulated_order`` compares such a run with the executor's trace
(``trace_order``) in one call.

Example:
    >>> from tidal.sim.programs import LayerTimes, data_parallel, summarize
    >>> lt = LayerTimes(("a", "b"), (10.0, 20.0), (20.0, 40.0), (4000, 0))
    >>> r = summarize(data_parallel(lambda b: lt, gpus=1, global_batch=8), gpus=1, global_batch=8)
    >>> r.iteration_us
    90.0
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

import torch.fx as fx

from tidal.ir import cost
from tidal.ir.burst_sync import ranks_label
from tidal.ir.cluster import Cluster
from tidal.ir.comm_cost import DDP_BUCKET_BYTES, gradient_buckets, ring_allreduce_us
from tidal.ir.node_runner import COMPUTE_OPS
from tidal.ir.program import (COLLECTIVE, COMM, COMPUTE, OPTIMIZER, POINT_TO_POINT, SEGMENT,
                              Piece, Program, data_parallel_program, node_pieces)
from tidal.ir.schedule import LINK_ACTIONS, schedule_program
from tidal.runtime.program import PieceTrace
from tidal.sim.engine import (LINK, PEER, Interval, Jobs, is_compute_lane, lane_of,
                              simulate)


@dataclass(frozen=True)
class LayerTimes:
    """Per-layer forward/backward microseconds at one per-GPU batch, and parameter bytes."""

    names: tuple[str, ...]
    fwd_us: tuple[float, ...]
    bwd_us: tuple[float, ...]
    param_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.names)
        if not (len(self.fwd_us) == len(self.bwd_us) == len(self.param_bytes) == n):
            raise ValueError("LayerTimes: names, fwd_us, bwd_us and param_bytes differ in length")


def layer_times(gm: fx.GraphModule, cluster: Cluster, batch: int) -> LayerTimes:
    """The compute nodes of an annotated graph, in execution order, with their times at
    ``batch`` samples per GPU on ``cluster``'s device (see ``tidal.ir.cost.node_time_us``)."""
    from tidal.ir import meta

    names, fwd, bwd, pbytes = [], [], [], []
    times = cost.node_times_us(gm, batch, cluster)
    for n in gm.graph.nodes:
        if n.op not in COMPUTE_OPS:
            continue
        f, b = times[n.name]
        c = meta.get_cost(n)
        names.append(n.name)
        fwd.append(f)
        bwd.append(b)
        pbytes.append(c.param_bytes if c else 0)
    return LayerTimes(tuple(names), tuple(fwd), tuple(bwd), tuple(pbytes))


def output_bytes(gm: fx.GraphModule) -> float:
    """Bytes of the tensors the graph returns (from its tensor metadata), per iteration."""
    from tidal.ir import meta

    out = next(n for n in gm.graph.nodes if n.op == "output")
    return float(sum(t.nbytes for a in out.all_input_nodes for t in meta.get_tensors(a)))


def data_parallel(times_at: Callable[[int], LayerTimes], gpus: int, global_batch: int,
                  cluster: Cluster | None = None, bucket_bytes: float = DDP_BUCKET_BYTES,
                  update_us: float = 0.0) -> Program:
    """One data-parallel training iteration on ``gpus`` GPUs: every GPU runs all layers
    forward (``F:<layer>``) then backward (``B:<layer>``) on ``global_batch / gpus`` samples;
    gradients are all-reduced (ring) in DDP-style buckets of ``bucket_bytes`` (``AR:<first
    layer>..<last>``), each as soon as every GPU finished the backward of the bucket's last
    layer, overlapping the rest of backward: the one data-parallel schedule
    (``tidal.ir.program.data_parallel_program``) over the layers' forwards and backwards, one
    piece each. ``update_us`` > 0 adds the optimizer step (``update``) on every GPU after its
    backward and all all-reduces."""
    if gpus < 1:
        raise ValueError(f"data_parallel(gpus={gpus}): need at least one GPU")
    if global_batch % gpus:
        raise ValueError(f"data_parallel: global batch {global_batch} is not divisible by "
                         f"{gpus} GPUs")
    cluster = cluster or Cluster(gpus=gpus)
    lt = times_at(global_batch // gpus)
    n = len(lt.names)
    units = [f"F:{name}" for name in lt.names] + [f"B:{name}" for name in reversed(lt.names)]
    us = dict(zip(units, lt.fwd_us + tuple(reversed(lt.bwd_us))))
    issued = [(i, lt.param_bytes[i], 2 * n - 1 - i) for i in reversed(range(n))] \
        if gpus > 1 else []  # one GPU syncs nothing
    rank = node_pieces(data_parallel_program(units, issued, gpus, bucket_bytes), us.__getitem__)

    def modelled(p: Piece) -> Piece:
        if p.kind == OPTIMIZER:
            return replace(p, name="update", duration_us=update_us)
        if p.grads:
            nbytes = sum(lt.param_bytes[i] for i in p.grads)
            return replace(p, name=f"AR:{lt.names[p.grads[0]]}..{lt.names[p.grads[-1]]}",
                           duration_us=ring_allreduce_us(nbytes, gpus, cluster.bytes_per_us,
                                                         cluster.latency_us))
        return p

    pieces = tuple(modelled(p) for p in rank.pieces)
    if update_us <= 0:  # no optimizer step modelled: the last piece goes
        pieces = pieces[:-1]
    return join_ranks(Program(pieces, gpus))


@dataclass(frozen=True)
class SimResult:
    """Timelines and summary of a simulated run of ``steps`` training steps (usually one
    iteration) of ``global_batch`` samples each; ``iteration_us`` is the time of the whole run."""

    intervals: tuple[Interval, ...]
    gpus: int
    global_batch: int
    iteration_us: float
    busy_us: tuple[float, ...]
    steps: int = 1

    @property
    def samples(self) -> int:
        """Samples the run processes: ``steps`` x ``global_batch``."""
        return self.steps * self.global_batch

    @property
    def gpu_sec(self) -> float:
        """GPU-seconds the iteration holds: iteration time x GPUs."""
        return self.iteration_us * self.gpus / 1e6

    @property
    def busy_fraction(self) -> float:
        """Share of GPU compute time that is busy during the iteration."""
        total = self.iteration_us * self.gpus
        return sum(self.busy_us) / total if total else 0.0

    @property
    def throughput(self) -> float:
        """Foreground samples per second."""
        return self.samples / self.iteration_us * 1e6 if self.iteration_us else 0.0

    def summary(self) -> str:
        """One line for reports."""
        run = (f"iteration {self.iteration_us / 1e3:.3f} ms" if self.steps == 1 else
               f"{self.steps} steps in {self.iteration_us / 1e3:.3f} ms")
        return (f"{self.gpus} GPUs, global batch {self.global_batch}: {run}, "
                f"{self.throughput:.1f} samples/s, {self.gpu_sec:.4f} GPU-s, "
                f"busy {self.busy_fraction:.0%}")


def summarize(jobs: Jobs, gpus: int, global_batch: int, cores: float | None = None,
              link_load: Callable[[Piece], float] | None = None) -> SimResult:
    """Simulate ``jobs`` (a placed Program, or several by job name: ``tidal.sim.engine``;
    compute lanes sharing ``cores`` processors when given, links slowed by computation beside
    them by ``link_load``, see :func:`link_load`) and summarise them."""
    intervals = simulate(jobs, cores, link_load)
    end = max((i.end_us for i in intervals), default=0.0)
    spans: list[list[tuple[float, float]]] = [[] for _ in range(gpus)]
    for i in intervals:  # several compute lanes of a GPU (tick, tock) may overlap
        if is_compute_lane(i.lane):
            spans[i.gpu].append((i.start_us, i.end_us))
    return SimResult(tuple(intervals), gpus, global_batch, end, tuple(map(_covered, spans)))


def link_load(program: Program, loaded: Program) -> Callable[[Piece], float]:
    """``simulate(link_load=)`` from one step built twice: ``program`` with its link pieces'
    durations on idle processors, ``loaded`` with those beside computation (the same builder
    given a link fitted to collectives issued beside a training step). Pieces pair by
    position; raises ``ValueError`` when the two are not the same pieces.

    Example:
        >>> from tidal.ir.program import COMM
        >>> idle = Program((Piece("ar", COMM, duration_us=4.0, ranks=(0, 1)),), world=2)
        >>> busy = Program((Piece("ar", COMM, duration_us=9.0, ranks=(0, 1)),), world=2)
        >>> link_load(idle, busy)(idle.pieces[0])
        9.0
    """
    if [(p.name, p.ranks, p.deps) for p in program.pieces] != \
            [(p.name, p.ranks, p.deps) for p in loaded.pieces]:
        raise ValueError("link_load: the idle and loaded Programs are not the same pieces "
                         f"({len(program.pieces)} vs {len(loaded.pieces)}; build both with "
                         "the same plan)")
    # beside computation a link is never faster than on idle processors: two noisy fits may
    # cross for some size, which is clipped
    table = {p: max(p.duration_us, q.duration_us)
             for p, q in zip(program.pieces, loaded.pieces)}
    return lambda piece: table.get(piece, piece.duration_us)


class _Placing:
    """A placed Program being built, piece by piece (``add`` returns the piece's index)."""

    def __init__(self) -> None:
        self.pieces: list[Piece] = []

    def add(self, name: str, ranks: Sequence[int], us: float, deps: Sequence[int] = (),
            kind: str = SEGMENT) -> int:
        """A piece of ``kind`` (a segment or the optimizer computes on its one rank; a transfer
        or collective uses the links of all ``ranks``) after the pieces ``deps``."""
        stream = COMPUTE if kind in (SEGMENT, OPTIMIZER) else COMM
        self.pieces.append(Piece(name, stream, tuple(sorted(set(deps))), kind=kind,
                                 duration_us=us, ranks=tuple(ranks)))
        return len(self.pieces) - 1

    def program(self, world: int) -> Program:
        return Program(tuple(self.pieces), world)


def burst_parallel(plan, preds: dict[str, Sequence[str]], overlap_sync: bool = False
                   ) -> Program:
    """One iteration of a burst-parallel plan (``tidal.ir.plans.burst.BurstPlan``) under the
    planner's own cost model: per layer, in order, the transfer of samples from its
    predecessors' GPUs (``X:<layer>``, ``comm_us``, on the links of both GPU sets), the layer's
    forward+backward on each of its ranks (``FB:<layer>``, ``comp_us``) and the all-reduce of
    its gradients on its ranks (``AR:<layer>``, ``sync_us``). Layers on disjoint ranks
    (parallel branches) overlap. ``preds`` maps each layer to the layers whose output it reads.
    ``overlap_sync``: the next layers do not wait for a layer's all-reduce, which runs on the
    link lanes while they compute (as a runtime with an asynchronous communication stream
    does); by default each all-reduce ends its layer, the planner's assumption (DeepPool §4)."""
    out = _Placing()
    last: dict[str, tuple[int, ...]] = {}  # layer -> pieces that end it
    ranks_of = {p.layer: p.ranks for p in plan.layers}
    for p in plan.layers:
        deps = tuple(d for q in preds.get(p.layer, ()) for d in last.get(q, ()))
        if p.comm_us > 0:
            gpus = sorted(set(p.ranks).union(*(ranks_of[q] for q in preds.get(p.layer, ())
                                                if q in ranks_of)))
            deps = (out.add(f"X:{p.layer}", gpus, p.comm_us, deps, POINT_TO_POINT),)
        ends = [out.add(f"FB:{p.layer}", (r,), p.comp_us, deps) for r in p.ranks]
        if p.sync_us > 0 and len(p.ranks) > 1:
            ar = out.add(f"AR:{p.layer}", p.ranks, p.sync_us, ends, COLLECTIVE)
            if not overlap_sync:
                ends = [ar]
        last[p.layer] = tuple(ends)
    return out.program(plan.world)


def burst_execution(plan, preds: dict[str, Sequence[str]],
                    times_at: Callable[[int], LayerTimes], cluster: Cluster,
                    out_bytes: float = 0.0, update_us: float = 0.0, sync: str = "end",
                    bucket_bytes: float = DDP_BUCKET_BYTES,
                    buffer_bytes: Mapping[str, float] = MappingProxyType({}),
                    dispatch_us: float = 0.0) -> Program:
    """One training step of a burst-parallel plan from per-layer costs, as the runtime's burst
    program runs it (``tidal.runtime.programs.burst``; ``join_ranks`` of that program object
    models it piece by piece): the forward of every layer on its ranks (``F:<layer>``, per-GPU
    batch ``ceil(B / gpus)``, times from ``times_at``) after the transfer of its input where the
    GPU set changes (``X:<layer>``, half of the plan's ``comm_us``), the model output
    (``out_bytes``) gathered to every rank, the backward in reverse order (``B:<layer>``) with
    the mirror transfers (``Xb:<layer>``), the gradient syncs and ``update_us`` of optimizer
    step on every rank (after its syncs). ``preds`` maps each layer to the layers it reads.
    Each rank holds only its layers' weights (nothing is broadcast): in backward order, the
    gradients of consecutive layers on the same two or more ranks go into buckets closed at
    ``bucket_bytes`` by the one bucket rule (a ring all-reduce on those ranks each,
    :func:`sync_buckets`). ``sync="end"`` issues every bucket after the whole backward (the
    program's ``overlap=False``); ``sync="overlap"`` issues each as soon as its layers'
    backward ended on all their ranks, overlapping the rest of backward. On a data-parallel
    plan ``"overlap"`` is ``data_parallel``'s iteration."""
    if sync not in ("end", "overlap"):
        raise ValueError(f"burst_execution(sync={sync!r}): expected 'end' or 'overlap'")
    step = _BurstStep(plan, preds, times_at, cluster)
    head = step.forward()
    bwd_all, syncs = step.backward(head, out_bytes, bucket_bytes, overlap=sync == "overlap")
    step.buffer_syncs(buffer_bytes, bwd_all)
    for r in range(plan.world):
        step.out.add("update", (r,), update_us,
                     [d for d in syncs + bwd_all if r in step.out.pieces[d].ranks], OPTIMIZER)
    if dispatch_us:
        pieces = step.out.pieces
        step.out.pieces = [replace(q, duration_us=q.duration_us + dispatch_us)
                           if q.kind != SEGMENT or not q.deps
                           or any(pieces[d].kind != SEGMENT for d in q.deps) else q
                           for q in pieces]
    return step.out.program(plan.world)


class _BurstStep:
    """The pieces of one burst-parallel training step being placed (``burst_execution``)."""

    def __init__(self, plan, preds: dict[str, Sequence[str]],
                 times_at: Callable[[int], LayerTimes], cluster: Cluster):
        self.plan, self.preds, self.times_at, self.cluster = plan, preds, times_at, cluster
        self.out = _Placing()
        self.layers = {p.layer: p for p in plan.layers}
        self.succs: dict[str, list[str]] = {p.layer: [] for p in plan.layers}
        for name in self.layers:
            for q in preds.get(name, ()):
                if q in self.succs:
                    self.succs[q].append(name)
        self.tables: dict[int, tuple[LayerTimes, dict[str, int]]] = {}

    def times(self, gpus: int) -> tuple[LayerTimes, dict[str, int]]:
        """The layer times at the per-GPU batch of a layer on ``gpus`` GPUs, and each layer's
        index in them."""
        b = -(-self.plan.batch // gpus)
        if b not in self.tables:
            t = self.times_at(b)
            self.tables[b] = (t, {n: i for i, n in enumerate(t.names)})
        return self.tables[b]

    def moved(self, p) -> tuple[int, ...]:
        """The GPUs a transfer into layer ``p`` occupies: its own and its inputs'."""
        return tuple(sorted(set(p.ranks).union(*(self.layers[q].ranks
                                                 for q in self.preds.get(p.layer, ())
                                                 if q in self.layers))))

    def layer_us(self, p, pass_us: str) -> float:
        t, ix = self.times(p.gpus)
        return getattr(t, pass_us)[ix[p.layer]] if p.layer in ix else 0.0

    def forward(self) -> list[int]:
        """Every layer's forward after its input's transfer; the pieces that end forward
        (the output gathered to every rank where the last layers do not run on all)."""
        fwd_end: dict[str, list[int]] = {}
        for p in self.plan.layers:
            deps = [d for q in self.preds.get(p.layer, ()) for d in fwd_end.get(q, ())]
            if p.comm_us > 0:
                deps = [self.out.add(f"X:{p.layer}", self.moved(p), p.comm_us / 2, deps,
                                     POINT_TO_POINT)]
            us = self.layer_us(p, "fwd_us")
            fwd_end[p.layer] = [self.out.add(f"F:{p.layer}", (r,), us, deps) for r in p.ranks]
        self.sinks = [p for p in self.plan.layers if not self.succs[p.layer]]
        return [d for p in self.sinks for d in fwd_end[p.layer]]

    def backward(self, head: list[int], out_bytes: float, bucket_bytes: float,
                 overlap: bool) -> tuple[list[int], list[int]]:
        """The backward in reverse layer order with the mirror transfers and the gradient
        syncs (each after its bucket's last backward, or all after the whole backward);
        returns the pieces that end backward and the syncs."""
        everyone = tuple(range(self.plan.world))
        c = self.cluster
        bwd_ready: dict[str, list[int]] = {}
        gather = any(p.ranks != everyone for p in self.sinks)
        out_us = c.latency_us + out_bytes / c.bytes_per_us if gather else 0.0
        if gather:  # the output is gathered to every rank (and its gradient sent back)
            head = [self.out.add("X:output", everyone, out_us, head, POINT_TO_POINT)]
        for p in self.sinks:
            bwd_ready[p.layer] = [self.out.add("Xb:output", everyone, out_us, head,
                                               POINT_TO_POINT)] if gather else head
        bwd_all: list[int] = []
        bwd_of: dict[str, list[int]] = {}
        syncs: list[int] = []
        buckets = sync_buckets(self.plan, self.times, bucket_bytes)
        closes = {names[-1]: (ranks, names, nbytes) for ranks, names, nbytes in buckets}

        def add_sync(ranks, names, nbytes, deps) -> None:
            syncs.append(self.out.add(f"AR:{names[0]}..{names[-1]}", ranks, ring_allreduce_us(
                nbytes, len(ranks), c.bytes_per_us, c.latency_us), deps, COLLECTIVE))

        for p in reversed(self.plan.layers):
            deps = list(bwd_ready.get(p.layer, ()))
            for s in self.succs[p.layer]:
                deps += bwd_ready[f"<in>{s}"]
            us = self.layer_us(p, "bwd_us")
            ends = bwd_of[p.layer] = [self.out.add(f"B:{p.layer}", (r,), us, deps)
                                      for r in p.ranks]
            if p.comm_us > 0:
                ends = [self.out.add(f"Xb:{p.layer}", self.moved(p), p.comm_us / 2, ends,
                                     POINT_TO_POINT)]
            bwd_ready[f"<in>{p.layer}"] = ends
            bwd_all += ends
            if overlap and p.layer in closes:  # issued as soon as its last layer's backward is
                ranks, names, nbytes = closes[p.layer]
                add_sync(ranks, names, nbytes, [d for n in names for d in bwd_of[n]])
        for ranks, names, nbytes in () if overlap else buckets:  # after the backward
            add_sync(ranks, names, nbytes, bwd_all)
        return bwd_all, syncs

    def buffer_syncs(self, buffer_bytes: Mapping[str, float], bwd_all: list[int]) -> None:
        """One all-reduce per set of two or more ranks whose layers hold buffers, after the
        backward pieces on those ranks (see ``burst_execution``)."""
        by_ranks: dict[tuple[int, ...], float] = {}
        for p in self.plan.layers:
            if buffer_bytes.get(p.layer) and len(p.ranks) > 1:
                key = tuple(sorted(p.ranks))
                by_ranks[key] = by_ranks.get(key, 0.0) + buffer_bytes[p.layer]
        c = self.cluster
        for ranks, nbytes in by_ranks.items():
            deps = [d for d in bwd_all if set(self.out.pieces[d].ranks) & set(ranks)]
            self.out.add(f"AR:buffers {ranks_label(ranks)}", ranks, ring_allreduce_us(
                nbytes, len(ranks), c.bytes_per_us, c.latency_us), deps, COLLECTIVE)


def layer_buffer_bytes(gm: fx.GraphModule) -> dict[str, float]:
    """Per compute node of an annotated graph (``tidal.ir.cost.annotate``), the bytes of the
    buffers it owns (BatchNorm's running statistics), for :func:`burst_execution`."""
    from tidal.ir import meta

    out = {}
    for n in gm.graph.nodes:
        c = meta.get_cost(n)
        if n.op in COMPUTE_OPS and c is not None and c.buffer_bytes:
            out[n.name] = float(c.buffer_bytes)
    return out


def sync_buckets(plan, times: Callable[[int], tuple[LayerTimes, dict[str, int]]],
                 bucket_bytes: float) -> list[tuple[tuple[int, ...], list[str], float]]:
    """A burst-parallel plan's gradient buckets as (ranks, layer names in backward order,
    bytes), by the one bucket rule (``tidal.ir.comm_cost.gradient_buckets``) as the runtime
    makes them: in backward order, runs of consecutive layers on the same ranks (a layer on
    one GPU, or without parameters on another set, ends a run), each cut into buckets of at
    most ``bucket_bytes``; a layer on one GPU syncs nothing. ``times(gpus)``: the layer times
    at the per-GPU batch of a layer on ``gpus`` GPUs and each layer's index in them."""
    items = []
    for p in reversed(plan.layers):
        t, ix = times(p.gpus)
        nbytes = t.param_bytes[ix[p.layer]] if p.layer in ix and len(p.ranks) > 1 else 0
        items.append((tuple(p.ranks), (p.layer, nbytes), nbytes))
    return [(ranks, [name for name, _ in bucket], float(sum(b for _, b in bucket)))
            for ranks, bucket in gradient_buckets(items, bucket_bytes)]


def _covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``spans``."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def schedule_steps(schedule) -> int:
    """Training steps of the global batch that a Wavelet schedule runs: a data-parallel
    (tick-tock) schedule runs ``batches`` wave iterations of half the global batch each, two
    per step; a partitioned (round-robin) cycle runs one step as ``batches`` micro-batches."""
    return max(1, schedule.batches // 2) if schedule.data_parallel else 1


def schedule_result(schedule, global_batch: int, job: str = "fg", contention: bool = False
                    ) -> SimResult:
    """A Wavelet schedule (``tidal.ir.schedule.Schedule``, from the tick_tock or round_robin
    pass) whose steps each process ``global_batch`` samples (``schedule_steps``), as simulated
    timelines. By default each action becomes an interval on its rank's compute lane (forward,
    backward, update) or link lane (transfer, all-reduce, weight switch) at the start and
    duration the schedule's builder predicted from the cost model; a rank is busy while any of
    its waves computes. With ``contention``, the engine re-runs the schedule's Program
    (``tidal.ir.schedule.schedule_program``): the waves of a rank share its one compute lane,
    so tick and tock no longer overlap at full speed."""
    steps = schedule_steps(schedule)
    if contention:
        r = summarize({job: schedule_program(schedule)}, len(schedule.ranks), global_batch)
        return replace(r, steps=steps)
    intervals = []
    busy = []
    part = schedule.partitions > 1
    for rank, actions in enumerate(schedule.ranks):
        spans = []
        for a in actions:
            lane = LINK if a.kind in LINK_ACTIONS else "compute"
            intervals.append(Interval(rank, lane, f"{job}:{a.wave or '-'}", a.label(part),
                                      a.start_us, a.end_us))
            if lane == "compute":
                spans.append((a.start_us, a.end_us))
        busy.append(_covered(spans))
    return SimResult(tuple(intervals), len(schedule.ranks), global_batch, schedule.makespan_us,
                     tuple(busy), steps)


def rank_programs(programs: "Program | Mapping[int, Program]") -> dict[int, Program]:
    """``{rank: Program}`` of what :func:`join_ranks` takes: one Program that every one of
    its ``world`` ranks runs, or the mapping itself in rank order.

    Example:
        >>> sorted(rank_programs(Program((Piece("f", "compute"),), world=2)))
        [0, 1]
    """
    if isinstance(programs, Program):
        return {r: programs for r in range(programs.world)}
    if not programs:
        raise ValueError("join_ranks: no program given (an empty mapping of ranks)")
    return {r: programs[r] for r in sorted(programs)}


def _is_shared(piece: Piece) -> bool:
    """Whether ``piece`` may join the pieces of its name on other ranks: communication on the
    network or peer link (a collective, a transfer)."""
    return lane_of(piece) in (LINK, PEER)


def join_ranks(programs: "Program | Mapping[int, Program]",
               durations_us: Callable[[int, str], float] | None = None) -> Program:
    """One step of the runtime's programs (``tidal.ir.program.Program``, the same objects the
    executor runs) placed on the cluster, as the engine runs it. ``programs`` is one Program
    that every one of its ``world`` ranks runs, or ``{rank: Program}`` (each rank its own).
    ``durations_us(rank, piece name)`` gives each piece's modelled (or measured) duration on
    that rank (None: the pieces' own ``duration_us``).

    Each rank's piece is placed on that rank (on the lane its stream names,
    ``tidal.sim.engine.lane_of``: ``compute``, a wave's ``tick``/``tock``, which are separate
    compute resources of the rank and so may overlap each other; ``load`` the host-to-device
    link, ``transfer`` the peer link). The ``comm`` (or ``transfer``) pieces with the same
    name on several ranks (the k-th one of that name on each rank, when a name repeats) are
    *one* piece across exactly those ranks (its ``ranks``), occupying all their links at once,
    after the pieces it depends on on every one of them; its duration is the least of the
    ranks' durations (a measured rank that reached the collective early also timed its wait
    for the others). A comm piece on one rank only is a transfer or collective on that rank's
    link. Each rank's pieces of one stream are placed in program order (a stream is a FIFO).

    Raises ``ValueError`` for programs whose collectives cannot be matched (ranks that order
    them differently would hang), naming where each rank is stuck.

    Example: rank 1 receives what rank 0 sends (one piece named ``x`` on both), rank 0 loads
    its weights meanwhile:
        >>> p0 = Program((Piece("f", "compute"), Piece("x", "comm", (0,)),
        ...               Piece("w", "load")), world=2)
        >>> p1 = Program((Piece("x", "comm"), Piece("g", "compute", (0,))), world=2)
        >>> placed = join_ranks({0: p0, 1: p1}, lambda rank, name: 2.0 if name == "x" else 5.0)
        >>> [(p.name, p.ranks, p.deps) for p in placed.pieces]  # doctest: +NORMALIZE_WHITESPACE
        [('f', (0,), ()), ('x', (0, 1), (0,)), ('w', (0,), ()), ('g', (1,), (1,))]
        >>> [(i.gpu, i.name, i.start_us) for i in simulate(placed) if i.name in ("w", "g")]
        [(0, 'w', 0.0), (1, 'g', 7.0)]
    """
    by_rank = rank_programs(programs)
    group, ready = _rank_groups(by_rank)
    placed: dict[tuple[int, int], int] = {}
    pieces: list[Piece] = []

    def duration(q: int, j: int) -> float:
        piece = by_rank[q].pieces[j]
        return piece.duration_us if durations_us is None else durations_us(q, piece.name)

    total = sum(len(p.pieces) for p in by_rank.values())
    while len(placed) < total:
        issued = len(placed)
        for r, program in by_rank.items():
            for i, piece in enumerate(program.pieces):
                members = group(r, i)
                if (r, i) in placed or not all(ready(q, j, placed) for q, j in members):
                    continue
                deps = tuple(sorted({placed[(q, d)] for q, j in members
                                     for d in by_rank[q].pieces[j].deps}))
                pieces.append(replace(piece, deps=deps, ranks=tuple(q for q, _ in members),
                                      duration_us=min(duration(q, j) for q, j in members)))
                for m in members:
                    placed[m] = len(pieces) - 1
        if len(placed) == issued:
            raise ValueError("join_ranks: the ranks' collectives do not match (each rank "
                             "would wait forever): " + _stuck(by_rank, placed, group))
    world = max([max(by_rank) + 1] + [p.world for p in by_rank.values()])
    return Program(tuple(pieces), world)


def shared_keys(program: Program) -> dict[int, tuple[str, int]]:
    """The pieces of ``program`` that :func:`join_ranks` joins with the pieces of the same key
    on other ranks (communication on the network or peer link: collectives, transfers), by
    index: ``(name, k)`` for the k-th such piece of that name.

    Example:
        >>> shared_keys(Program((Piece("f", "compute"), Piece("x", "comm"),
        ...                      Piece("x", "transfer"))))
        {1: ('x', 0), 2: ('x', 1)}
    """
    seen: dict[str, int] = {}
    out: dict[int, tuple[str, int]] = {}
    for i, piece in enumerate(program.pieces):
        if _is_shared(piece):
            out[i] = (piece.name, seen.get(piece.name, 0))
            seen[piece.name] = out[i][1] + 1
    return out


def _rank_groups(by_rank: Mapping[int, Program]) -> tuple[Callable, Callable]:
    """For :func:`join_ranks`: ``group(r, i)``, the (rank, piece) pairs that piece ``i`` of
    rank ``r`` is one piece with (the k-th shared piece of its name on every rank that has
    one; else itself alone), and ``ready(r, i, placed)``, whether what it waits for on its
    rank (its dependencies, the piece before it on its stream) is placed."""
    members: dict[tuple[str, int], list[tuple[int, int]]] = {}  # shared piece -> (rank, i)
    key_of: dict[tuple[int, int], tuple[str, int]] = {}
    before: dict[tuple[int, int], int | None] = {}  # the rank's previous piece on the stream
    for r, program in by_rank.items():
        last: dict[str, int] = {}
        for i, piece in enumerate(program.pieces):
            before[(r, i)], last[piece.stream] = last.get(piece.stream), i
        for i, key in shared_keys(program).items():
            key_of[(r, i)] = key
            members.setdefault(key, []).append((r, i))

    def group(r: int, i: int) -> list[tuple[int, int]]:
        return members[key_of[(r, i)]] if (r, i) in key_of else [(r, i)]

    def ready(r: int, i: int, placed: Mapping[tuple[int, int], int]) -> bool:
        prev = before[(r, i)]
        return all((r, d) in placed for d in by_rank[r].pieces[i].deps) and \
            (prev is None or (r, prev) in placed)

    return group, ready


def _stuck(by_rank: Mapping[int, Program], placed: Mapping[tuple[int, int], int],
           group: Callable[[int, int], list[tuple[int, int]]]) -> str:
    """Where each unfinished rank waits: its first piece not issued, and who shares it."""
    out = []
    for r, program in by_rank.items():
        i = next((i for i in range(len(program.pieces)) if (r, i) not in placed), None)
        if i is not None:
            ranks = [q for q, _ in group(r, i)]
            out.append(f"rank {r} waits at piece {i} {program.pieces[i].name!r} "
                       f"({program.pieces[i].stream}, on ranks {ranks})")
    return "; ".join(out)


def measured_durations(traces: Mapping[int, Sequence[PieceTrace]]
                       ) -> Callable[[int, str], float]:
    """``durations_us(rank, piece name)`` for :func:`join_ranks` from measured traces
    (``{rank: [tidal.runtime.program.PieceTrace]}``, e.g. ``ProgramExecutor.last_trace`` of
    each rank): the mean of the piece's measured durations on that rank. The function raises
    ``KeyError`` naming the rank and piece when the trace has no such piece."""
    spans: dict[tuple[int, str], list[float]] = {}
    for r, trace in traces.items():
        for t in trace:
            spans.setdefault((r, t.name), []).append(t.end_us - t.start_us)

    def durations_us(rank: int, name: str) -> float:
        if (rank, name) not in spans:
            raise KeyError(f"measured_durations: the trace of rank {rank} has no piece {name!r}")
        times = spans[(rank, name)]
        return sum(times) / len(times)

    return durations_us


def trace_order(traces: Mapping[int, Sequence[PieceTrace]]) -> dict[int, dict[str, list[str]]]:
    """``{rank: {stream: piece names in start order}}`` of measured traces (ties in the order
    the trace lists them, which is program order)."""
    out: dict[int, dict[str, list[str]]] = {}
    for r in sorted(traces):
        per: dict[str, list[str]] = {}
        for t in sorted(traces[r], key=lambda t: t.start_us):
            per.setdefault(t.stream, []).append(t.name)
        out[r] = dict(sorted(per.items()))
    return out


def simulated_order(programs: "Program | Mapping[int, Program]",
                    traces: Mapping[int, Sequence[PieceTrace]], job: str = "fg",
                    cores: float | None = None) -> dict[int, dict[str, list[str]]]:
    """Simulate ``programs`` (as :func:`join_ranks` takes them) with the durations measured
    in ``traces`` (:func:`measured_durations`; ``cores`` as ``simulate`` takes it) and return,
    in :func:`trace_order`'s shape, ``{rank: {stream: piece names in simulated start order}}``,
    so that a test compares the simulator's run of the executor's own Program objects with the
    executor's trace in one call.

    Example: two ranks of one data-parallel step, the all-reduce overlapping backward:
        >>> from tidal.runtime.program import PieceTrace
        >>> p = Program((Piece("backward 0", "compute"), Piece("all_reduce", "comm", (0,)),
        ...              Piece("backward 1", "compute", (0,)),
        ...              Piece("optimizer", "compute", (1, 2))), world=2)
        >>> run = [PieceTrace("backward 0", "compute", 0, 4),
        ...        PieceTrace("all_reduce", "comm", 4, 9),
        ...        PieceTrace("backward 1", "compute", 4, 7),
        ...        PieceTrace("optimizer", "compute", 9, 10)]
        >>> traces = {0: run, 1: run}
        >>> simulated_order(p, traces)  # doctest: +NORMALIZE_WHITESPACE
        {0: {'comm': ['all_reduce'], 'compute': ['backward 0', 'backward 1', 'optimizer']},
         1: {'comm': ['all_reduce'], 'compute': ['backward 0', 'backward 1', 'optimizer']}}
        >>> simulated_order(p, traces) == trace_order(traces)
        True
    """
    by_rank = rank_programs(programs)
    missing = sorted(set(by_rank) - set(traces))
    if missing:
        raise ValueError(f"simulated_order: no trace for rank(s) {missing} of the programs")
    stream_of = {(r, lane_of(p)): p.stream for r, program in by_rank.items()
                 for p in program.pieces}
    intervals = simulate({job: join_ranks(by_rank, measured_durations(traces))}, cores)
    out: dict[int, dict[str, list[str]]] = {r: {} for r in by_rank}
    for iv in sorted(intervals, key=lambda iv: iv.start_us):  # stable: a lane's FIFO order
        out[iv.gpu].setdefault(stream_of[(iv.gpu, iv.lane)], []).append(iv.name)
    return {r: dict(sorted(per.items())) for r, per in out.items()}

"""Task lists for execution strategies, built from per-layer costs, and their summary.

``LayerTimes`` holds, for one per-GPU batch size, each layer's forward and backward time and
its parameter bytes; ``layer_times(gm, cluster, batch)`` reads them from an annotated graph
(measured or DeepPool profile when ``cluster.profile`` has the layer, FLOPs otherwise).
``data_parallel`` builds one training iteration of data parallelism with ring all-reduces of
DDP-style gradient buckets that overlap the rest of backward. A burst-parallel plan becomes tasks
either under the planner's own cost model (``burst_parallel``: per layer, transfer, forward +
backward, gradient sync) or from per-layer costs (``burst_execution``: all forwards, all backwards,
then the gradient sync per set of ranks; the runtime's own program now issues each set's sync
as soon as backward has finished it, and ``program_tasks`` of that program models it exactly). ``schedule_result`` turns a Wavelet schedule
into timelines. ``program_tasks`` simulates the runtime's own ``Program`` objects (the pieces the
executor runs; one Program for every rank or one per rank), with durations from a model or a
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
from typing import Callable, Mapping, Sequence

import torch.fx as fx

from tidal.ir import cost
from tidal.ir.cluster import Cluster
from tidal.ir.node_runner import COMPUTE_OPS
from tidal.ir.comm_cost import DDP_BUCKET_BYTES, bucket_partition, ring_allreduce_us
from tidal.runtime.program import TRANSFER, PieceTrace, Program, stream_kind
from tidal.sim.engine import H2D, LINK, PEER, Interval, Task, is_compute_lane, simulate

LOAD = "load"
"""The runtime's stream of weight loads (``tidal.runtime.program.STREAMS``)."""


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


def gradient_buckets(lt: LayerTimes, bucket_bytes: float) -> list[list[int]]:
    """Layers with parameters grouped into DDP-style buckets of ``bucket_bytes`` in backward
    (reverse) order (``tidal.ir.comm_cost.bucket_partition``)."""
    order = [i for i in reversed(range(len(lt.names))) if lt.param_bytes[i]]
    parts = bucket_partition([lt.param_bytes[i] for i in order], bucket_bytes)
    return [[order[k] for k in part] for part in parts]


def data_parallel(times_at: Callable[[int], LayerTimes], gpus: int, global_batch: int,
                  cluster: Cluster | None = None, job: str = "fg",
                  bucket_bytes: float = DDP_BUCKET_BYTES, update_us: float = 0.0
                  ) -> list[Task]:
    """One data-parallel training iteration on ``gpus`` GPUs: every GPU runs all layers
    forward then backward on ``global_batch / gpus`` samples; gradients are all-reduced (ring)
    in DDP-style buckets of ``bucket_bytes``, each as soon as every GPU finished the backward of
    the bucket's last layer, overlapping the rest of backward. ``update_us`` > 0 adds the
    optimizer step on every GPU after its backward and all all-reduces."""
    if gpus < 1:
        raise ValueError(f"data_parallel(gpus={gpus}): need at least one GPU")
    if global_batch % gpus:
        raise ValueError(f"data_parallel: global batch {global_batch} is not divisible by "
                         f"{gpus} GPUs")
    cluster = cluster or Cluster(gpus=gpus)
    lt = times_at(global_batch // gpus)
    tasks: list[Task] = []
    bwd_index: dict[tuple[int, int], int] = {}
    last: dict[int, tuple[int, ...]] = {}  # GPU -> its last backward task
    for g in range(gpus):
        prev: tuple[int, ...] = ()
        for i, name in enumerate(lt.names):
            tasks.append(Task(f"F:{name}", job, "compute", (g,), lt.fwd_us[i], prev))
            prev = (len(tasks) - 1,)
        for i in reversed(range(len(lt.names))):
            tasks.append(Task(f"B:{lt.names[i]}", job, "compute", (g,), lt.bwd_us[i], prev))
            prev = (len(tasks) - 1,)
            bwd_index[(g, i)] = len(tasks) - 1
        last[g] = prev
    if gpus > 1:
        for bucket in gradient_buckets(lt, bucket_bytes):
            nbytes = sum(lt.param_bytes[i] for i in bucket)
            t = ring_allreduce_us(nbytes, gpus, cluster.bytes_per_us, cluster.latency_us)
            deps = tuple(bwd_index[(g, bucket[-1])] for g in range(gpus))
            tasks.append(Task(f"AR:{lt.names[bucket[0]]}..{lt.names[bucket[-1]]}", job, "comm",
                              tuple(range(gpus)), t, deps))
    if update_us > 0:
        syncs = tuple(i for i, t in enumerate(tasks) if t.kind == "comm")
        for g in range(gpus):
            tasks.append(Task("update", job, "compute", (g,), update_us, syncs + last[g]))
    return tasks


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


def summarize(tasks: Sequence[Task], gpus: int, global_batch: int,
              cores: float | None = None) -> SimResult:
    """Simulate ``tasks`` (compute lanes sharing ``cores`` processors when given, see
    ``tidal.sim.engine.simulate``) and summarise them."""
    intervals = simulate(tasks, cores)
    end = max((i.end_us for i in intervals), default=0.0)
    spans: list[list[tuple[float, float]]] = [[] for _ in range(gpus)]
    for i in intervals:  # several compute lanes of a GPU (tick, tock) may overlap
        if is_compute_lane(i.lane):
            spans[i.gpu].append((i.start_us, i.end_us))
    return SimResult(tuple(intervals), gpus, global_batch, end, tuple(map(_covered, spans)))


def burst_parallel(plan, preds: dict[str, Sequence[str]], job: str = "fg",
                   overlap_sync: bool = False) -> list[Task]:
    """The tasks of one iteration of a burst-parallel plan (``tidal.ir.plans.burst.BurstPlan``)
    under the planner's own cost model: per layer, in order, the transfer of
    samples from its predecessors' GPUs (``comm_us``, on the links of both GPU sets), the
    layer's forward+backward on each of its ranks (``comp_us``) and the all-reduce of its
    gradients on its ranks (``sync_us``). Layers on disjoint ranks (parallel branches) overlap.
    ``preds`` maps each layer to the layers whose output it reads. ``overlap_sync``: the next
    layers do not wait for a layer's all-reduce, which runs on the link lanes while they
    compute (as a runtime with an asynchronous communication stream does); by default each
    all-reduce ends its layer, the planner's assumption (DeepPool §4)."""
    tasks: list[Task] = []
    last: dict[str, tuple[int, ...]] = {}  # layer -> tasks that end it
    ranks_of = {p.layer: p.ranks for p in plan.layers}
    for p in plan.layers:
        deps = tuple(d for q in preds.get(p.layer, ()) for d in last.get(q, ()))
        if p.comm_us > 0:
            gpus = tuple(sorted(set(p.ranks).union(*(ranks_of[q] for q in preds.get(p.layer, ())
                                                      if q in ranks_of))))
            tasks.append(Task(f"X:{p.layer}", job, "comm", gpus, p.comm_us, deps))
            deps = (len(tasks) - 1,)
        ends = []
        for r in p.ranks:
            tasks.append(Task(f"FB:{p.layer}", job, "compute", (r,), p.comp_us, deps))
            ends.append(len(tasks) - 1)
        if p.sync_us > 0 and len(p.ranks) > 1:
            tasks.append(Task(f"AR:{p.layer}", job, "comm", tuple(p.ranks), p.sync_us,
                              tuple(ends)))
            if not overlap_sync:
                ends = [len(tasks) - 1]
        last[p.layer] = tuple(ends)
    return tasks


def burst_execution(plan, preds: dict[str, Sequence[str]],
                    times_at: Callable[[int], LayerTimes], cluster: Cluster,
                    out_bytes: float = 0.0, update_us: float = 0.0,
                    job: str = "fg", sync: str = "end",
                    bucket_bytes: float = DDP_BUCKET_BYTES) -> list[Task]:
    """One training step of a burst-parallel plan from per-layer costs, as the runtime's burst
    program runs it (``tidal.runtime.programs.burst``; ``program_tasks`` of that program object
    models it piece by piece): the forward of every layer on its ranks (per-GPU batch
    ``ceil(B / gpus)``, times from ``times_at``) after the transfer of its input where the GPU
    set changes (half of the plan's ``comm_us``), the model output (``out_bytes``) gathered to
    every rank, the backward in reverse order with the mirror transfers, the gradient syncs and
    ``update_us`` of optimizer step on every rank (after its syncs). ``preds`` maps each layer
    to the layers it reads. Each rank holds only its layers' weights (nothing is broadcast):
    in backward order, the gradients of consecutive layers on the same two or more ranks go
    into buckets of at most ``bucket_bytes`` (a ring all-reduce on those ranks each).
    ``sync="end"`` issues every bucket after the whole backward (the program's
    ``overlap=False``); ``sync="overlap"`` issues each as soon as its layers' backward ended on
    all their ranks, overlapping the rest of backward. On a data-parallel plan ``"overlap"``
    is ``data_parallel``'s iteration."""
    if sync not in ("end", "overlap"):
        raise ValueError(f"burst_execution(sync={sync!r}): expected 'end' or 'overlap'")
    world = plan.world
    everyone = tuple(range(world))
    tables: dict[int, LayerTimes] = {}
    index: dict[int, dict[str, int]] = {}

    def lt(g: int) -> tuple[LayerTimes, dict[str, int]]:
        b = -(-plan.batch // g)
        if b not in tables:
            tables[b] = times_at(b)
            index[b] = {n: i for i, n in enumerate(tables[b].names)}
        return tables[b], index[b]

    tasks: list[Task] = []

    def add(name: str, kind: str, gpus: Sequence[int], us: float, deps: Sequence[int]) -> int:
        tasks.append(Task(name, job, kind, tuple(gpus), us, tuple(sorted(set(deps)))))
        return len(tasks) - 1

    layers = {p.layer: p for p in plan.layers}
    succs: dict[str, list[str]] = {p.layer: [] for p in plan.layers}
    for name in layers:
        for q in preds.get(name, ()):
            if q in succs:
                succs[q].append(name)

    def moved(p) -> tuple[int, ...]:
        return tuple(sorted(set(p.ranks).union(*(layers[q].ranks for q in preds.get(p.layer, ())
                                                 if q in layers))))

    fwd_end: dict[str, list[int]] = {}
    for p in plan.layers:
        deps = [d for q in preds.get(p.layer, ()) for d in fwd_end.get(q, ())]
        if p.comm_us > 0:
            deps = [add(f"X:{p.layer}", "comm", moved(p), p.comm_us / 2, deps)]
        t, ix = lt(p.gpus)
        us = t.fwd_us[ix[p.layer]] if p.layer in ix else 0.0
        fwd_end[p.layer] = [add(f"F:{p.layer}", "compute", (r,), us, deps) for r in p.ranks]
    sinks = [p for p in plan.layers if not succs[p.layer]]
    head = [d for p in sinks for d in fwd_end[p.layer]]
    gather = [p for p in sinks if p.ranks != everyone]
    if gather:  # the output is gathered to every rank (and its gradient sent back)
        out_us = cluster.latency_us + out_bytes / cluster.bytes_per_us
        head = [add("X:output", "comm", everyone, out_us, head)]
    else:
        out_us = 0.0
    bwd_ready: dict[str, list[int]] = {}
    for p in sinks:
        bwd_ready[p.layer] = [add("Xb:output", "comm", everyone, out_us, head)] if gather \
            else head
    bwd_all: list[int] = []
    bwd_of: dict[str, list[int]] = {}
    syncs: list[int] = []
    buckets = _sync_buckets(plan, lt, bucket_bytes)
    closes = {} if sync == "end" else {names[-1]: (ranks, names, nbytes)
                                       for ranks, names, nbytes in buckets}
    bw, lat = cluster.bytes_per_us, cluster.latency_us
    for p in reversed(plan.layers):
        deps = list(bwd_ready.get(p.layer, ()))
        for s in succs[p.layer]:
            deps += bwd_ready[f"<in>{s}"]
        t, ix = lt(p.gpus)
        us = t.bwd_us[ix[p.layer]] if p.layer in ix else 0.0
        ends = bwd_of[p.layer] = [add(f"B:{p.layer}", "compute", (r,), us, deps)
                                  for r in p.ranks]
        if p.comm_us > 0:
            ends = [add(f"Xb:{p.layer}", "comm", moved(p), p.comm_us / 2, ends)]
        bwd_ready[f"<in>{p.layer}"] = ends
        bwd_all += ends
        if p.layer in closes:  # issued as soon as its last layer's backward is
            ranks, names, nbytes = closes[p.layer]
            syncs.append(add(f"AR:{names[0]}..{names[-1]}", "comm", ranks,
                             ring_allreduce_us(nbytes, len(ranks), bw, lat),
                             [d for n in names for d in bwd_of[n]]))
    for ranks, names, nbytes in buckets if sync == "end" else ():  # after the backward
        syncs.append(add(f"AR:{names[0]}..{names[-1]}", "comm", ranks,
                         ring_allreduce_us(nbytes, len(ranks), bw, lat), bwd_all))
    for r in everyone:
        add("update", "compute", (r,), update_us,
            [d for d in syncs + bwd_all if r in tasks[d].gpus])
    return tasks


def _sync_buckets(plan, lt, bucket_bytes: float
                  ) -> list[tuple[tuple[int, ...], list[str], float]]:
    """``burst_execution``'s gradient buckets as (ranks, layer names in backward order,
    bytes), as the runtime's ``sync_buckets`` makes them: runs of consecutive layers (backward
    order) on the same two or more ranks, a run ending wherever the GPU set changes (also
    across a layer of one GPU between two of the same set), cut by ``bucket_partition``."""
    runs: list[tuple[tuple[int, ...], list[tuple[str, int]]]] = []
    previous: tuple[int, ...] = ()
    cut = True  # the GPU set changed since the last layer put in a run
    for p in reversed(plan.layers):
        ranks = tuple(p.ranks)
        cut, previous = cut or ranks != previous, ranks
        t, ix = lt(p.gpus)
        nbytes = t.param_bytes[ix[p.layer]] if p.layer in ix else 0
        if not nbytes or len(ranks) < 2:
            continue
        if cut or runs[-1][0] != ranks:
            runs.append((ranks, []))
        cut = False
        runs[-1][1].append((p.layer, nbytes))
    return [(ranks, [layers[k][0] for k in part], float(sum(layers[k][1] for k in part)))
            for ranks, layers in runs
            for part in bucket_partition([b for _, b in layers], bucket_bytes)]


_LINK_KINDS = ("X", "A", "S", "SEND", "RECV")
"""Transfers, all-reduces and weight switches use the link; the rest computes."""


def _covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``spans``."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def schedule_tasks(schedule, job: str = "fg") -> list[Task]:
    """The actions of a Wavelet schedule as engine tasks, so that the engine (not the
    schedule's builder) decides when each runs: forward, backward and update on the rank's one
    compute lane (the waves of a rank contend for it), transfers and weight switches on its link,
    an all-reduce (same wave, batch and partition on every rank) as one collective, a transfer
    ``X`` of a partitioned schedule on its rank's link, awaited by the next rank, a ``SEND`` and
    its matching ``RECV`` (GPipe, 1F1B: ``tidal.ir.pipeline_schedules``) as one transfer on both
    ranks' links, a weight gradient ``W`` on the compute lane. An action depends, on every
    GPU it occupies, on the last action of each of the schedule's lanes there that the builder
    ended no later than it started (the builder's happens-before); list order is start order."""
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
            elif a.kind in ("SEND", "RECV") and a.peer >= 0:  # one transfer on both links
                pair = (rank, a.peer) if a.kind == "SEND" else (a.peer, rank)
                key = ("P2P", pair, a.moves, a.wave, a.batch)  # one per pair and micro-batch
                gpus = tuple(sorted(set(pair)))
            else:
                key, gpus = (a.kind, rank, k), (rank,)
            it = items.setdefault(key, {"a": a, "gpus": gpus, "seen": seen or gpus,
                                        "lanes": set(), "start": a.start_us, "end": a.end_us})
            it["lanes"].add((rank, a.lane))
            it["start"], it["end"] = min(it["start"], a.start_us), max(it["end"], a.end_us)
    order = sorted(items, key=lambda key: (items[key]["start"], items[key]["end"], str(key)))
    index = {key: i for i, key in enumerate(order)}
    tasks: list[Task] = []
    for i, key in enumerate(order):
        it = items[key]
        a = it["a"]
        deps = set()
        for g in it["gpus"]:
            last: dict[tuple[int, str], int] = {}
            for j in range(i):  # the latest finished action of each lane of GPU g
                other = items[order[j]]
                if g in other["seen"] and other["end"] <= it["start"] + 1e-9:
                    for r, lane in other["lanes"]:
                        last[(r, lane)] = j
            deps.update(last.values())
        kind = "comm" if a.kind in _LINK_KINDS else "compute"
        gpus = it["gpus"] if kind == "comm" else it["gpus"][:1]
        tasks.append(Task(a.label(part), job, kind, gpus, a.dur_us,
                          tuple(sorted(d for d in deps if d != index[key]))))
    return tasks


def schedule_steps(schedule) -> int:
    """Training steps of the global batch that a Wavelet schedule runs: a data-parallel
    (tick-tock) schedule runs ``batches`` wave iterations of half the global batch each, two
    per step; a partitioned (round-robin) cycle runs one step as ``batches`` micro-batches."""
    return max(1, schedule.batches // 2) if schedule.data_parallel else 1


def schedule_result(schedule, global_batch: int, job: str = "fg", contention: bool = False
                    ) -> SimResult:
    """A Wavelet schedule (``tidal.ir.schedule.Schedule``, from the tick_tock or round_robin
    pass) whose steps each process ``global_batch`` samples (``schedule_steps``), as simulated
    timelines. By default each action
    becomes an interval on its rank's compute lane (forward, backward, update) or link lane
    (transfer, all-reduce, weight switch) at the start and duration the schedule's builder
    predicted from the cost model; a rank is busy while any of its waves computes. With
    ``contention``, the engine re-runs the schedule's tasks (``schedule_tasks``): the waves of
    a rank share its one compute lane, so tick and tock no longer overlap at full speed."""
    steps = schedule_steps(schedule)
    if contention:
        r = summarize(schedule_tasks(schedule, job), len(schedule.ranks), global_batch)
        return replace(r, steps=steps)
    intervals = []
    busy = []
    part = schedule.partitions > 1
    for rank, actions in enumerate(schedule.ranks):
        spans = []
        for a in actions:
            lane = "link" if a.kind in _LINK_KINDS else "compute"
            intervals.append(Interval(rank, lane, f"{job}:{a.wave or '-'}", a.label(part),
                                      a.start_us, a.end_us))
            if lane == "compute":
                spans.append((a.start_us, a.end_us))
        busy.append(_covered(spans))
    return SimResult(tuple(intervals), len(schedule.ranks), global_batch, schedule.makespan_us,
                     tuple(busy), steps)


def _stream_lane(stream: str) -> str:
    """The engine lane a piece on ``stream`` occupies: the ``load`` stream the host-to-device
    link, the ``transfer`` stream the peer link, another stream that does not occupy the device
    (``comm``) the network link, a compute stream (``compute``, ``tick``, ...) its own compute
    lane of the same name."""
    if stream == LOAD:
        return H2D
    if stream == TRANSFER:
        return PEER
    return stream if stream_kind(stream)[1] else LINK


def _by_rank(programs: "Program | Mapping[int, Program]") -> dict[int, Program]:
    if isinstance(programs, Program):
        return {r: programs for r in range(programs.world)}
    if not programs:
        raise ValueError("program_tasks: no program given (an empty mapping of ranks)")
    return {r: programs[r] for r in sorted(programs)}


def program_tasks(programs: "Program | Mapping[int, Program]",
                  durations_us: Callable[[int, str], float], job: str = "fg") -> list[Task]:
    """The tasks of one step of the runtime's programs (``tidal.runtime.program.Program``, the
    same objects the executor runs). ``programs`` is one Program that every one of its
    ``world`` ranks runs, or ``{rank: Program}`` (each rank its own). ``durations_us(rank,
    piece name)`` gives each piece's modelled (or measured) duration on that rank.

    Per rank, each piece on a compute stream is a compute task on that rank's lane of the same
    name: ``compute``, or a wave's ``tick``/``tock``, which are separate compute resources of
    the rank and so may overlap each other (``tidal.sim.engine``). A ``load`` piece uses the
    rank's host-to-device link (``h2d``), a ``transfer`` piece (burst parallelism's sample
    transfers) its peer link (``peer``). The ``comm`` (or ``transfer``) pieces with the same
    name on several
    ranks (the k-th one of that name on each rank, when a name repeats) are *one* collective
    across exactly those ranks, occupying all their network links at once, after the pieces it
    depends on on every one of them; its duration is the least of the ranks' durations (a
    measured rank that reached the collective early also timed its wait for the others). A
    comm piece on one rank only is a transfer or collective on that rank's link. Each rank's
    pieces of one stream are issued in program order (a stream is a FIFO).

    Raises ``ValueError`` for a dependency on a later piece, a task the engine rejects (e.g. a
    compute stream named ``link``), or programs whose collectives cannot be matched (ranks
    that order them differently would hang), naming where each rank is stuck.

    Example: rank 1 receives what rank 0 sends (one piece named ``x`` on both), rank 0 loads
    its weights meanwhile:
        >>> from tidal.runtime.program import Piece, Program
        >>> p0 = Program((Piece("f", "compute"), Piece("x", "comm", (0,)),
        ...               Piece("w", "load")), world=2)
        >>> p1 = Program((Piece("x", "comm"), Piece("g", "compute", (0,))), world=2)
        >>> tasks = program_tasks({0: p0, 1: p1}, lambda rank, name: 2.0 if name == "x" else 5.0)
        >>> [(t.name, t.lane, t.gpus, t.deps) for t in tasks]  # doctest: +NORMALIZE_WHITESPACE
        [('f', 'compute', (0,), ()), ('x', 'link', (0, 1), (0,)), ('w', 'h2d', (0,), ()),
         ('g', 'compute', (1,), (1,))]
        >>> [(i.gpu, i.name, i.start_us) for i in simulate(tasks) if i.name in ("w", "g")]
        [(0, 'w', 0.0), (1, 'g', 7.0)]
    """
    by_rank = _by_rank(programs)
    members: dict[tuple[str, int], list[tuple[int, int]]] = {}  # collective -> (rank, piece)
    key_of: dict[tuple[int, int], tuple[str, int]] = {}
    before: dict[tuple[int, int], int | None] = {}  # the rank's previous piece on the stream
    for r, program in by_rank.items():
        seen: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, piece in enumerate(program.pieces):
            bad = [d for d in piece.deps if not 0 <= d < i]
            if bad:
                raise ValueError(f"program_tasks: rank {r}, piece {i} {piece.name!r} depends on "
                                 f"piece {bad[0]}, which is not earlier in its program")
            before[(r, i)], last[piece.stream] = last.get(piece.stream), i
            if _stream_lane(piece.stream) in (LINK, PEER):
                key = key_of[(r, i)] = (piece.name, seen.get(piece.name, 0))
                seen[piece.name] = key[1] + 1
                members.setdefault(key, []).append((r, i))
    task_of: dict[tuple[int, int], int] = {}
    tasks: list[Task] = []

    def ready(r: int, i: int) -> bool:
        prev = before[(r, i)]
        return all((r, d) in task_of for d in by_rank[r].pieces[i].deps) and \
            (prev is None or (r, prev) in task_of)

    def group(r: int, i: int) -> list[tuple[int, int]]:
        return members[key_of[(r, i)]] if (r, i) in key_of else [(r, i)]

    total = sum(len(p.pieces) for p in by_rank.values())
    while len(task_of) < total:
        issued = len(task_of)
        for r, program in by_rank.items():
            for i, piece in enumerate(program.pieces):
                if (r, i) in task_of or not all(ready(q, j) for q, j in group(r, i)):
                    continue
                lane = _stream_lane(piece.stream)
                ranks = tuple(q for q, _ in group(r, i))
                deps = tuple(sorted({task_of[(q, d)] for q, j in group(r, i)
                                     for d in by_rank[q].pieces[j].deps}))
                us = min(durations_us(q, piece.name) for q in ranks)
                kind = "compute" if is_compute_lane(lane) else "comm"
                tasks.append(Task(piece.name, job, kind, ranks, us, deps, lane))
                for m in group(r, i):
                    task_of[m] = len(tasks) - 1
        if len(task_of) == issued:
            raise ValueError("program_tasks: the ranks' collectives do not match (each rank "
                             "would wait forever): " + _stuck(by_rank, task_of, group))
    return tasks


def _stuck(by_rank: Mapping[int, Program], task_of: Mapping[tuple[int, int], int],
           group: Callable[[int, int], list[tuple[int, int]]]) -> str:
    """Where each unfinished rank waits: its first piece not issued, and who shares it."""
    out = []
    for r, program in by_rank.items():
        i = next((i for i in range(len(program.pieces)) if (r, i) not in task_of), None)
        if i is not None:
            ranks = [q for q, _ in group(r, i)]
            out.append(f"rank {r} waits at piece {i} {program.pieces[i].name!r} "
                       f"({program.pieces[i].stream}, on ranks {ranks})")
    return "; ".join(out)


def measured_durations(traces: Mapping[int, Sequence[PieceTrace]]
                       ) -> Callable[[int, str], float]:
    """``durations_us(rank, piece name)`` for :func:`program_tasks` from measured traces
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
    """Simulate ``programs`` (as :func:`program_tasks` takes them) with the durations measured
    in ``traces`` (:func:`measured_durations`; ``cores`` as ``simulate`` takes it) and return,
    in :func:`trace_order`'s shape, ``{rank: {stream: piece names in simulated start order}}``,
    so that a test compares the simulator's run of the executor's own Program objects with the
    executor's trace in one call.

    Example: two ranks of one data-parallel step, the all-reduce overlapping backward:
        >>> from tidal.runtime.program import Piece, PieceTrace, Program
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
    by_rank = _by_rank(programs)
    missing = sorted(set(by_rank) - set(traces))
    if missing:
        raise ValueError(f"simulated_order: no trace for rank(s) {missing} of the programs")
    stream_of = {(r, _stream_lane(p.stream)): p.stream
                 for r, program in by_rank.items() for p in program.pieces}
    intervals = simulate(program_tasks(by_rank, measured_durations(traces), job), cores)
    out: dict[int, dict[str, list[str]]] = {r: {} for r in by_rank}
    for iv in sorted(intervals, key=lambda iv: iv.start_us):  # stable: a lane's FIFO order
        out[iv.gpu].setdefault(stream_of[(iv.gpu, iv.lane)], []).append(iv.name)
    return {r: dict(sorted(per.items())) for r, per in out.items()}

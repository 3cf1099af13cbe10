"""Programs: one rank's training step as pieces on streams, run by one executor.

A :class:`Program` is data: a list of :class:`Piece` objects, each on the ``compute`` or the
``comm`` stream, with the indices of the pieces it waits for. A compute piece is a *segment* of
the captured joint forward+backward graph (``tidal.ir.capture.capture_train_step``: aten ops,
gradients as explicit outputs), a comm piece all-reduces one bucket of gradients, and the
``optimizer`` piece applies the averaged gradients. :func:`data_parallel` builds the program of
data-parallel training: the graph is cut after the node that finishes each bucket's last
gradient (buckets of at most ``bucket_bytes`` in reverse registration order, as DDP makes them),
so the all-reduce of a bucket runs on the comm stream while the compute stream goes on with the
rest of backward. ``overlap=False`` puts every all-reduce after the last segment (the baseline).

:class:`ProgramRunner` runs a program on a backend (``tidal.runtime.backend.CpuBackend`` here: a
FIFO worker thread per stream, events between them; a segment is the straight-line replay of its
nodes): compute pieces on a high-priority stream, comm pieces on a second stream that does not
occupy the device. Each piece's launch carries its start and end time, so a run gives its trace
(:func:`chrome_trace`: one row per stream).

Example:
    >>> import torch
    >>> from tidal.ir.capture import capture_train_step
    >>> from tidal.runtime import program
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    >>> step = capture_train_step(model, (x,), y, torch.nn.functional.cross_entropy)
    >>> p = program.data_parallel(step, world=2, bucket_bytes=160)   # two buckets
    >>> [(piece.name, piece.stream, piece.deps) for piece in p.pieces]  # doctest: +NORMALIZE_WHITESPACE
    [('segment 0', 'compute', ()), ('all_reduce 0', 'comm', (0,)),
     ('segment 1', 'compute', (0,)), ('all_reduce 1', 'comm', (2,)),
     ('optimizer', 'compute', (1, 2, 3))]
    >>> with program.ProgramRunner() as run:            # one process: the all-reduces are no-ops
    ...     loss, grads, trace = run(p, step, model, (x,), y)
    >>> sorted(grads) == sorted(n for n, _ in model.named_parameters())
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx import _pytree as fx_pytree

from tidal.ir.capture import TrainStep, _as_inputs, capture_train_step
from tidal.ir.comm_cost import DDP_BUCKET_BYTES, bucket_partition
from tidal.ir.cost import example_batch
from tidal.ir.errors import TraceError
from tidal.ir.node_runner import flat_tensors
from tidal.runtime.backend import HIGH, LOW, CpuBackend, Launch
from tidal.runtime.data_parallel import broadcast_state, shard

COMPUTE, COMM = "compute", "comm"


@dataclass(frozen=True)
class Piece:
    """One unit of a program: ``name``, its ``stream``, the indices of the pieces it waits for
    (``deps``), the joint-graph nodes of a segment (``nodes``) and the gradient indices an
    all-reduce averages (``grads``, positions in ``TrainStep.param_names``)."""

    name: str
    stream: str
    deps: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    grads: tuple[int, ...] = ()


@dataclass(frozen=True)
class Program:
    """A rank's pieces for one step on ``world`` ranks."""

    pieces: tuple[Piece, ...]
    world: int

    def table(self) -> str:
        """One line per piece: stream, name, what it waits for and its size."""
        rows = []
        for i, p in enumerate(self.pieces):
            what = f"{len(p.nodes)} nodes" if p.nodes else f"{len(p.grads)} gradients" \
                if p.grads else ""
            deps = ", ".join(self.pieces[d].name for d in p.deps)
            rows.append(f"{i:3d} {p.stream:7s} {p.name:16s} {what:14s} after: {deps or '-'}")
        return "\n".join(rows)


def _grad_nodes(step: TrainStep) -> tuple[fx.Node, list[fx.Node]]:
    """The loss node and each parameter's gradient node in the joint graph's output."""
    out = next(n for n in step.gm.graph.nodes if n.op == "output")
    flat = list(out.args[0])
    return flat[0], flat[1:1 + len(step.param_names)]


def data_parallel(step: TrainStep, world: int, bucket_bytes: float = DDP_BUCKET_BYTES,
                  overlap: bool = True) -> Program:
    """The data-parallel program of a captured step (see the module docstring)."""
    nodes = [n for n in step.gm.graph.nodes if n.op != "output"]
    pos = {n: i for i, n in enumerate(nodes)}
    _, grads = _grad_nodes(step)
    order = list(reversed(range(len(grads))))  # DDP: reverse registration order
    sizes = [_nbytes(grads[i]) for i in order]
    buckets = [tuple(order[j] for j in part) for part in bucket_partition(sizes, bucket_bytes)]
    last = len(nodes) - 1
    ready = [max(pos.get(grads[i], last) for i in b) if overlap else last for b in buckets]
    cuts = sorted(set(ready) | {last})
    pieces: list[Piece] = []
    start, previous = 0, None
    comm_pieces: list[int] = []
    for k, cut in enumerate(cuts):
        pieces.append(Piece(f"segment {k}", COMPUTE, () if previous is None else (previous,),
                            tuple(n.name for n in nodes[start:cut + 1])))
        previous, start = len(pieces) - 1, cut + 1
        for b, r in enumerate(ready):
            if r == cut:
                pieces.append(Piece(f"all_reduce {b}", COMM, (previous,), grads=buckets[b]))
                comm_pieces.append(len(pieces) - 1)
    pieces.append(Piece("optimizer", COMPUTE, tuple(sorted(comm_pieces + [previous]))))
    return Program(tuple(pieces), world)


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0


@dataclass(frozen=True)
class PieceTrace:
    """When a piece ran: stream, name and backend times in µs."""

    name: str
    stream: str
    start_us: float
    end_us: float


class ProgramRunner:
    """Runs programs on a CPU backend: ``runner(program, step, model, inputs, targets)``
    returns ``(loss, {parameter name: averaged gradient}, [PieceTrace])``. The loss is averaged
    over the ranks (each rank passes its own shard). ``optimizer``, when given, takes its step
    in the program's ``optimizer`` piece on the averaged gradients."""

    def __init__(self, backend: Optional[CpuBackend] = None,
                 group: Optional[dist.ProcessGroup] = None):
        self.backend = backend or CpuBackend(slots=None)
        self.group = group
        self.streams = {COMPUTE: self.backend.stream(HIGH), COMM: self.backend.stream(LOW)}

    def __enter__(self) -> "ProgramRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.backend.close()

    def __call__(self, program: Program, step: TrainStep, model: torch.nn.Module,
                 inputs: Any, targets: Any, optimizer: Optional[torch.optim.Optimizer] = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[PieceTrace]]:
        params = {k: p for k, p in model.named_parameters() if p.requires_grad}
        buffers = dict(model.named_buffers())
        spec = step.gm.graph._codegen.pytree_info.in_spec
        flat = fx_pytree.tree_flatten_spec(
            ({k: params[k] for k in step.param_names}, {k: buffers[k] for k in step.buffer_names},
             _as_inputs(inputs), targets), spec)
        interp = fx.Interpreter(step.gm, garbage_collect_values=False)
        interp.args_iter = iter(flat)
        by_name = {n.name: n for n in step.gm.graph.nodes}
        loss_node, grad_nodes = _grad_nodes(step)
        averaged: dict[int, torch.Tensor] = {}
        world = dist.get_world_size(self.group) if _distributed() else 1

        def segment(names: Sequence[str]) -> None:
            with torch.no_grad():
                for name in names:
                    node = by_name[name]
                    interp.env[node] = interp.run_node(node)

        def all_reduce(indices: Sequence[int]) -> None:
            grads = [interp.env[grad_nodes[i]] for i in indices]
            buf = torch.cat([g.reshape(-1) for g in grads])
            if world > 1:
                dist.all_reduce(buf, group=self.group)
                buf /= world
            offset = 0
            for i, g in zip(indices, grads):
                averaged[i] = buf[offset:offset + g.numel()].view_as(g)
                offset += g.numel()

        def apply() -> None:
            for i, name in enumerate(step.param_names):
                params[name].grad = averaged[i].clone()
            if optimizer is not None:
                optimizer.step()

        launches: list[Launch] = []
        events = []
        for piece in program.pieces:
            stream = self.streams[piece.stream]
            for d in piece.deps:
                if program.pieces[d].stream != piece.stream:
                    stream.wait_event(events[d])
            if piece.nodes:
                fn, args = segment, (piece.nodes,)
            elif piece.grads:
                fn, args = all_reduce, (piece.grads,)
            else:
                fn, args = apply, ()
            launches.append(self.backend.launch(stream, fn, *args, label=piece.name,
                                                uses_device=piece.stream == COMPUTE))
            events.append(self.backend.event())
            stream.record(events[-1])
        errors = []
        for launch in launches:  # all of them, so nothing still runs when an error is raised
            try:
                launch.wait()
            except Exception as e:  # noqa: BLE001 - the first one is raised below, named
                errors.append((launch.label, e))
        if errors:
            label, e = errors[0]
            raise RuntimeError(f"piece {label!r} failed: {type(e).__name__}: {e}") from e
        loss = interp.env[loss_node].detach().clone()
        if world > 1:
            dist.all_reduce(loss, group=self.group)
            loss /= world
        grads = {name: averaged[i] for i, name in enumerate(step.param_names)}
        trace = [PieceTrace(p.name, p.stream, l.start_us, l.end_us)
                 for p, l in zip(program.pieces, launches)]
        return loss, grads, trace


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def chrome_trace(traces: Mapping[int, Sequence[PieceTrace]]) -> dict:
    """The Chrome trace-event JSON of piece traces by rank: one process per rank, one thread
    row per stream."""
    events: list[dict] = []
    for rank, trace in traces.items():
        rows: dict[str, int] = {}
        for t in trace:
            if t.stream not in rows:
                rows[t.stream] = len(rows)
                events.append({"ph": "M", "name": "thread_name", "pid": rank,
                               "tid": rows[t.stream], "args": {"name": t.stream}})
            events.append({"ph": "X", "name": t.name, "pid": rank, "tid": rows[t.stream],
                           "ts": t.start_us, "dur": max(t.end_us - t.start_us, 0.0)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


class DataParallelProgram:
    """``Compiled.step`` as a data-parallel program: each rank captures the joint
    forward+backward graph of its shard of the global batch once per input shape
    (``tidal.ir.capture.capture_train_step`` of the graph module, which shares the model's
    parameters), builds :func:`data_parallel` with gradient
    all-reduces that overlap the rest of backward, and runs it with a :class:`ProgramRunner`;
    the loss returned is the global batch's (the mean of the shards'). ``last_trace`` holds the
    pieces of the latest step (:func:`chrome_trace` writes them). A step whose graph cannot be
    captured (data-dependent control flow, host syncs) runs through ``fallback`` (an executor
    with the same semantics), and ``fallback_reason`` says why."""

    def __init__(self, bucket_bytes: float = DDP_BUCKET_BYTES, fallback: Any = None):
        self.bucket_bytes = bucket_bytes
        self.fallback = fallback
        self.fallback_reason = ""
        self.last_trace: list[PieceTrace] = []
        self._steps: dict[tuple, tuple[TrainStep, Program]] = {}
        self._runner: Optional[ProgramRunner] = None
        self._started = False

    def __getattr__(self, name: str) -> Any:
        """What the program does not define (``compressor``, ``state_dict``) is the
        fallback executor's."""
        fallback = self.__dict__.get("fallback")
        if fallback is None:
            raise AttributeError(name)
        return getattr(fallback, name)

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """Inference is not distributed: every rank runs the whole batch."""
        return gm(*args, **kwargs)

    def step(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        if self.fallback_reason:
            return self.fallback.step(gm, model, inputs, targets, loss_fn, optimizer)
        rank, size = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
        batch = example_batch(inputs)
        if batch % size:
            raise ValueError(f"data parallel: global batch {batch} does not split evenly over "
                             f"{size} ranks")
        broadcast_state(model, params=not self._started)  # as DataParallelExecutor does
        self._started = True
        local = shard(inputs, rank, size, batch)
        local_targets = shard(targets, rank, size, batch)
        key = tuple((tuple(t.shape), t.dtype) for t in flat_tensors((local, local_targets)))
        if key not in self._steps:
            try:
                step = capture_train_step(gm, local, local_targets, loss_fn)
            except TraceError as e:
                if self.fallback is None:
                    raise
                self.fallback_reason = str(e)
                return self.fallback.step(gm, model, inputs, targets, loss_fn, optimizer)
            self._steps[key] = (step, data_parallel(step, size, self.bucket_bytes))
            first = True
        else:
            first = False
        step, program = self._steps[key]
        if self._runner is None:
            self._runner = ProgramRunner()
        optimizer.zero_grad(set_to_none=True)
        try:  # gm shares the model's parameters
            loss, _, self.last_trace = self._runner(program, step, gm, local, local_targets,
                                                    optimizer)
        except Exception as e:  # noqa: BLE001 - a first replay that fails falls back, named
            if not first or self.fallback is None:
                raise
            self.fallback_reason = f"the captured step failed to run: {type(e).__name__}: {e}"
            return self.fallback.step(gm, model, inputs, targets, loss_fn, optimizer)
        return loss

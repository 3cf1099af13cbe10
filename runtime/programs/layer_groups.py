"""PipeSwitch's pipelined weight loading as a program: group ``k+1``'s weights load while group
``k`` computes.

A graph grouped by the ``layer_groups`` pass has a ``tidal::group_boundary(k)`` marker before
the first node of each group (``tidal.runtime.weights.loader.group_tensors`` says which
parameters and buffers each group loads, ``write_groups`` writes them as a store).
:func:`pipelined` is the program: per group ``k`` a ``load group k`` piece on the ``load``
stream and a ``group k`` piece on the ``compute`` stream, the group's segment of the graph (cut
at the markers, :func:`cut_at_markers`), which waits for ``load group k`` and ``group k-1``. The
loads run one after another (one link) and ahead of the compute, so group ``k+1``'s weights
load while group ``k`` computes. The program runs on its device's backend
(``tidal.runtime.program.runner_backend``; on a GPU, CUDA streams): the loads on the backend's
``load`` stream (low priority, not occupying the device), the groups on the compute stream at
the job's priority, an event between a group's load and its compute. A load copies the
group's contiguous buffer onto the device on the stream it runs on and points the group's
parameters and buffers at views of the copy; on a GPU the group's compute waits for the copy's
event and the copy is marked used on the compute stream (``record_stream``). The bytes are
checked against the store's checksums as they are read from the file (a corrupt tensor raises
``WeightStoreError`` naming it and its group): on the CPU into the copy itself, on any other
device into the program's host copy (``tidal.runtime.weights.store.HostCopy``: one buffer,
pinned on a GPU, allocated once and reused, each group read and verified once), from which a
GPU copies by DMA. The store is validated before anything runs. A run's
:class:`LoadTimeline` is read from its launches: device-side times on the backend's one clock
(CUDA event times on a GPU).

:class:`LayerGroupsProgram` is the rank program of a ``LayerGroupPlan`` that names a weight
store (:func:`from_plan`). Its first forward streams the weights in
(:meth:`~LayerGroupsProgram.run`; the :class:`LoadTimeline` it returns is read from the piece
trace). Its first training step (:meth:`~LayerGroupsProgram.bind`) loads the weights: the
groups run the graph module's segments with autograd as the weights stream in, then an eager
``backward`` piece. Every later step runs the groups' forward segments of the captured joint
forward+backward graph (``tidal.ir.capture.capture_train_step``, cut at the same markers), then
``backward k`` segments (each ends where the gradients of group ``k``'s parameters are
complete, the last group first) and the ``optimizer`` piece. The segments are lowered and
captured once per input shape, against the resident weights, which every replay reads in place
(``tidal.runtime.program.CapturedProgram``: CUDA graphs in a memory pool of their own on a GPU,
the straight-line replay on the CPU); a node that cannot run captured (an in-place update of a
buffer, a host sync) runs uncaptured in its piece and :meth:`~LayerGroupsProgram.uncaptured`
names it. A step that cannot be captured runs the groups' segments of the graph module with
autograd, then an eager ``backward`` piece (``fallback_reason`` says why). :func:`run_pipelined`
and :func:`cold_start` are the cold-start forward of a graph module and of a compiled model, on
any device (run node by node, not captured: see :meth:`~LayerGroupsProgram.run`).

Example:
    >>> import os, tempfile, torch, tidal
    >>> from tidal.passes.layer_groups import LayerGroups
    >>> from tidal.runtime.weights.loader import write_groups
    >>> from tidal.runtime.programs.layer_groups import run_pipelined
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> x = torch.randn(3, 4)
    >>> c = tidal.compile(model.eval(), (x,), passes=[LayerGroups(grouping="per_layer")])
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> write_groups(c.graph_module, path)
    >>> expected = model(x)
    >>> with torch.no_grad():
    ...     _ = [p.zero_() for p in model.parameters()]
    >>> out, tl = run_pipelined(c.graph_module, path, (x,))
    >>> torch.equal(out, expected), len(tl.transfer)
    (True, 3)
    >>> [(p.name, p.stream, p.deps) for p in tl.program.pieces]  # doctest: +NORMALIZE_WHITESPACE
    [('load group 0', 'load', ()), ('load group 1', 'load', (0,)),
     ('load group 2', 'load', (1,)), ('group 0', 'compute', (0,)),
     ('group 1', 'compute', (1, 3)), ('group 2', 'compute', (2, 4))]
"""
from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from tidal.ir import ops
from tidal.ir.capture import TrainStep, capture_train_step, failing_node, grad_nodes, step_inputs
from tidal.ir.errors import TraceError
from tidal.ir.inputs import as_kwargs, bind_inputs
from tidal.ir.node_runner import flat_tensors
from tidal.ir.rng import fork_rng_of
from tidal.runtime.backend import Backend, backend_for, used_here
from tidal.runtime.program import (COMPUTE, CapturedProgram, CapturedRun, Piece, PieceTrace,
                                   Program, ProgramRunner, device_of,
                                   runner_backend, state_inputs)
from tidal.runtime.weights.loader import GroupedTensors, expected_specs, group_tensors
from tidal.runtime.weights.store import HostCopy, PathLike, WeightStore, view_tensor

PLAN_KIND = "LayerGroupPlan"
LOAD = "load"
"""The stream of the weight loads (low priority; a copy engine's work: it does not occupy the
device's compute)."""

LOADING_STEP = ("the step that loads the weights runs the groups with autograd and an eager "
                "backward (the captured steps after it read the weights in place, where the "
                "loads put them)")
"""Why the training step that loads the weights runs uncaptured."""

Segment = tuple[str, ...]
"""Node names of one compute piece, in graph order."""


def from_plan(gm: fx.GraphModule, plan: Any) -> Optional["LayerGroupsProgram"]:
    """The rank program of a ``layer_groups`` plan that names a weight store, loading onto
    the device of ``gm``'s parameters (None without a store: the graph runs as it is)."""
    store = getattr(plan, "weight_store", None)
    return LayerGroupsProgram(store, device_of(gm)) if store else None


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (a device without an index matches any index
    of its type)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def cut_at_markers(nodes: Iterable[fx.Node]) -> list[Segment]:
    """The names of ``nodes`` cut into layer groups: a ``tidal::group_boundary`` marker starts
    its group, nodes before the first marker (the placeholders) go to group 0. Raises
    ``ValueError`` when there is no marker."""
    head: list[str] = []
    groups: list[list[str]] = []
    for n in nodes:
        if n.op == "call_function" and n.target is ops.GROUP_BOUNDARY:
            groups.append([] if groups else head)
        (groups[-1] if groups else head).append(n.name)
    if not groups:
        raise ValueError("layer groups: the graph has no tidal::group_boundary markers: run "
                         "the layer_groups pass first")
    return [tuple(g) for g in groups]


@dataclass(frozen=True)
class Pipelined:
    """A pipelined program and, per piece, the layer group it loads or computes (None for
    the pieces after the groups' forward)."""

    program: Program
    groups: tuple[Optional[int], ...]


def pipelined(forward: Sequence[Segment], tail: Sequence[tuple[str, Segment]] = (),
              loads: bool = True) -> Pipelined:
    """The program of a grouped graph (see the module docstring): ``group k`` computes
    ``forward[k]`` after ``load group k`` (when ``loads``) and ``group k-1``; each ``(name,
    nodes)`` of ``tail`` follows on the compute stream, in order. The loads come first in the
    program, so they are all issued at once and stream back to back while the compute pieces
    are paced. Every rank runs its own copy: the program has no collective (``world`` 1)."""
    n = len(forward) if loads else 0
    pieces = [Piece(f"load group {k}", LOAD, (k - 1,) if k else ()) for k in range(n)]
    groups: list[Optional[int]] = list(range(n))
    last: Optional[int] = None
    for k, nodes in enumerate(forward):
        deps = ([k] if loads else []) + ([] if last is None else [last])
        pieces.append(Piece(f"group {k}", COMPUTE, tuple(deps), tuple(nodes)))
        groups.append(k)
        last = len(pieces) - 1
    for name, nodes in tail:
        pieces.append(Piece(name, COMPUTE, () if last is None else (last,), tuple(nodes)))
        groups.append(None)
        last = len(pieces) - 1
    return Pipelined(Program(tuple(pieces), world=1), tuple(groups))


@dataclass(frozen=True)
class LoadTimeline:
    """Recorded times in seconds from the start of the run, read from the pieces' launches:
    device-side times on the backend's one clock (on a GPU, CUDA event times; on the CPU, the
    stream workers'): per group the ``transfer`` (its load piece) and the ``execute`` (its
    compute piece) interval, and when the output was ready; ``program`` and ``trace`` are the
    pieces that ran."""

    transfer: tuple[tuple[float, float], ...]
    execute: tuple[tuple[float, float], ...]
    first_output: float
    program: Optional[Program] = None
    trace: tuple[PieceTrace, ...] = ()

    def overlaps(self) -> bool:
        """True if group 0 started executing before the last transfer ended."""
        return self.execute[0][0] < self.transfer[-1][1]

    @classmethod
    def of(cls, run: Pipelined, trace: Sequence[PieceTrace]) -> "LoadTimeline":
        """The timeline of a run of ``run``'s program that gave ``trace``."""
        t0 = min(t.start_us for t in trace)
        spans = [((t.start_us - t0) * 1e-6, (t.end_us - t0) * 1e-6) for t in trace]
        ran = list(zip(run.program.pieces, run.groups, spans))
        transfer = tuple(s for p, _, s in ran if p.stream == LOAD)
        execute = tuple(s for p, k, s in ran if p.stream == COMPUTE and k is not None)
        return cls(transfer, execute, execute[-1][1], run.program, tuple(trace))


class _Loads:
    """One run's weight loads: ``load(k)`` (the ``load group k`` piece) copies group ``k``
    of the open ``store`` onto ``device`` (on the stream the piece runs on) and points the
    group's tensors (``targets[k]``) at the copy; ``ready(k)`` (at the start of ``group k``)
    raises if that failed and, on a GPU, orders the consuming stream after the copy. Bytes
    are verified as they are read from the file (see the module docstring; ``host`` is the
    program's host copy for a device that is not host memory). The store closes after the
    last load, and ``resident()`` is called once every group is in."""

    def __init__(self, store: WeightStore, targets: GroupedTensors, device: torch.device,
                 link: tuple[Optional[float], float], resident: Callable[[], None],
                 host: Optional[HostCopy] = None):
        self.store, self.targets, self.device, self.link = store, targets, device, link
        self.resident = resident
        self.host = host if host is not None else HostCopy(pin=device.type == "cuda")
        self.done = [False] * store.num_groups
        self.buffers: list[Optional[torch.Tensor]] = [None] * store.num_groups
        self.events: list[Any] = [None] * store.num_groups

    def load(self, k: int) -> None:
        """Load group ``k`` (after the groups before it)."""
        try:
            failed = [j for j in range(k) if not self.done[j]]
            if failed:
                raise RuntimeError(f"weight group {k} of {self.store.path} is not loaded: "
                                   f"loading group {failed[0]} failed")
            start = time.perf_counter()
            buf = self.buffers[k] = self._copy(k)
            for (spec, offset), (_, target) in zip(self.store.group_tensors(k), self.targets[k]):
                target.data = view_tensor(buf, spec, offset)
            bandwidth, overhead = self.link
            if bandwidth is not None:  # an emulated slower link
                rest = start + (overhead + buf.numel() / bandwidth) * 1e-6 - time.perf_counter()
                if rest > 0:
                    time.sleep(rest)
            self.done[k] = True
        finally:
            if k == len(self.done) - 1:
                self.store.close()
        if all(self.done):
            self.resident()

    def _copy(self, k: int) -> torch.Tensor:
        """Group ``k``'s bytes on the device, verified: on the CPU the copy out of the file is
        checked; elsewhere the verified host copy is copied on the current stream (on a GPU
        asynchronously, from pinned memory, an event recorded after it)."""
        if self.device.type == "cpu":
            dst = torch.empty(self.store.group_nbytes(k), dtype=torch.uint8)
            dst.copy_(self.store.group_region(k))  # the read from the file
            self.store.verify(k, dst)
            return dst
        src = self.host.group(self.store, k)
        dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
        dst.copy_(src, non_blocking=self.host.pin)
        if self.device.type == "cuda":
            self.events[k] = torch.cuda.Event()
            self.events[k].record(torch.cuda.current_stream(self.device))
        return dst

    def ready(self, k: int) -> None:
        """Raise unless group ``k``'s weights were loaded; on a GPU, make the current stream
        wait for their copy and mark the copy used on it (the copy was made on the load
        stream: its memory is not reused before this stream's work on it ends)."""
        if not self.done[k]:
            raise RuntimeError(f"group {k} cannot run: its weights were not loaded (see the "
                               f"piece 'load group {k}')")
        if self.events[k] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.events[k])
            used_here(self.buffers[k])


def graph_interpreter(gm: fx.GraphModule, *args: Any) -> fx.Interpreter:
    """An interpreter of ``gm`` whose placeholders take ``args`` (flattened as ``gm`` does)."""
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    interp.args_iter = iter(gm.graph.process_inputs(*args))
    return interp


class _Bound:
    """A pipelined program bound to one run's tensors (a ``StepWork``): load pieces go to
    ``loads``, the pieces named in ``calls`` run those functions and every other piece is a
    segment (``compute``, after ``loads.ready`` for a group's piece); ``loss()`` gives the
    step's loss once every piece ran."""

    def __init__(self, run: Pipelined, loads: Optional[_Loads],
                 calls: Optional[Mapping[str, Callable[[], Any]]] = None,
                 loss: Optional[Callable[[], torch.Tensor]] = None):
        self.program, self.groups = run.program, run.groups
        self.loads = loads
        self.calls = dict(calls or {})
        self._loss = loss

    def work(self, index: int, piece: Piece) -> Callable[[], Any]:
        group = self.groups[index]
        if piece.stream == LOAD:
            if self.loads is None:
                raise ValueError(f"piece {piece.name!r}: this run loads no weights")
            return functools.partial(self.loads.load, group)
        if piece.name in self.calls:
            return self.calls[piece.name]
        return functools.partial(self._segment, group, piece)

    def _segment(self, group: Optional[int], piece: Piece) -> None:
        if group is not None and self.loads is not None:
            self.loads.ready(group)
        self.compute(piece)

    def compute(self, piece: Piece) -> None:
        """Run the segment of ``piece``."""
        raise NotImplementedError

    def loss(self) -> torch.Tensor:
        if self._loss is None:
            raise ValueError("a forward run has no loss")
        return self._loss()


class InterpretedSegments(_Bound):
    """Segments run node by node through one interpreter (with autograd when ``grad``): the
    cold-start forward and the eager fallback of a step."""

    def __init__(self, run: Pipelined, interp: fx.Interpreter, loads: Optional[_Loads],
                 grad: bool = False, calls: Optional[Mapping[str, Callable[[], Any]]] = None,
                 loss: Optional[Callable[[], torch.Tensor]] = None):
        super().__init__(run, loads, calls, loss)
        self.interp, self.grad = interp, grad
        self.nodes = {n.name: n for n in interp.graph.nodes}

    def compute(self, piece: Piece) -> None:
        with torch.set_grad_enabled(self.grad):
            for name in piece.nodes:
                node = self.nodes[name]
                try:
                    self.interp.env[node] = self.interp.run_node(node)
                except Exception as e:  # noqa: BLE001 - re-raised, naming the node
                    raise RuntimeError(f"layer groups: node {name!r} ({node.target}): "
                                       f"{type(e).__name__}: {e}") from e

    def output(self) -> Any:
        """The graph's output (after the run)."""
        node = next(n for n in reversed(self.interp.graph.nodes) if n.op == "output")
        return self.interp.graph.process_outputs(self.interp.env[node])


class _Replayed(_Bound):
    """Segments of a captured step: piece ``name`` runs the lowered, captured steps of that
    piece of the step's resident program (``index[name]``) in ``run``."""

    def __init__(self, run: Pipelined, captured: CapturedRun, index: Mapping[str, int],
                 loads: Optional[_Loads], calls: Mapping[str, Callable[[], Any]],
                 loss: Callable[[], torch.Tensor]):
        super().__init__(run, loads, calls, loss)
        self.captured, self.index = captured, index

    def compute(self, piece: Piece) -> None:
        self.captured.segment(self.index[piece.name])()


def _positional(gm: fx.GraphModule, args: Sequence[Any], kwargs: Optional[dict]) -> tuple:
    """``args`` and ``kwargs`` of a call of ``gm`` as values of its placeholders, in order."""
    if not kwargs:
        return tuple(args)
    return bind_inputs(gm, {**as_kwargs(gm, tuple(args)), **kwargs}, "layer groups: inputs")


@dataclass(frozen=True)
class _Step:
    """A training step for one input shape on the resident weights: the captured joint graph
    and its lowered, captured segments (None: eager backward), its program, and what it runs
    uncaptured (the node and why; for the eager step, the fallback reason)."""

    train: Optional[TrainStep]
    captured: Optional[CapturedProgram]
    run: Pipelined
    uncaptured: tuple[tuple[str, str], ...] = ()


def _joint_segments(train: TrainStep, groups: GroupedTensors
                    ) -> tuple[list[Segment], list[tuple[str, Segment]]]:
    """The forward segment of each group in a captured step (cut at its markers, the last
    ending at the loss) and its backward segments: ``backward k`` ends where the gradients of
    group ``k``'s parameters are complete, the last group first (a group whose gradients are
    complete earlier, or that has none, has no segment). Raises ``ValueError`` when the capture
    did not keep one marker per group."""
    nodes = [n for n in train.gm.graph.nodes if n.op != "output"]
    loss, grads = grad_nodes(train)
    end = nodes.index(loss) + 1
    forward = cut_at_markers(nodes[:end])
    if len(forward) != len(groups):
        raise ValueError(f"the captured step has {len(forward)} tidal::group_boundary markers "
                         f"before the loss, the graph {len(groups)}")
    rest = nodes[end:]
    pos = {n: i for i, n in enumerate(rest)}
    grad_of = dict(zip(train.param_names, grads))
    backward: list[tuple[str, Segment]] = []
    start = 0
    for k in reversed(range(len(groups))):
        ready = [pos[grad_of[name]] for name, _ in groups[k] if grad_of.get(name) in pos]
        if ready and max(ready) >= start:
            backward.append((f"backward {k}", tuple(n.name for n in rest[start:max(ready) + 1])))
            start = max(ready) + 1
    if start < len(rest):  # what follows the first group's last gradient
        name, names = backward.pop() if backward else ("backward", ())
        backward.append((name, names + tuple(n.name for n in rest[start:])))
    return forward, backward


class LayerGroupsProgram:
    """The rank program of a layer-group plan with a weight store at ``path`` (see the module
    docstring). ``loaded`` says whether the weights are resident; ``last_timeline`` is the
    cold-start forward's :class:`LoadTimeline`. ``device`` is where the weights go (the CPU
    by default); ``backend`` what :meth:`run` runs on and the steps are captured with (by
    default the device's, ``runner_backend(device)``, made once: on a GPU its CUDA graphs have
    this program's own memory pool); ``link_bytes_per_us``/``link_overhead_us`` emulate a
    slower link (each load takes at least ``overhead + bytes / bandwidth``), for tests and
    benchmarks. The program's host copy of the store (:class:`HostCopy`, for a device other
    than the CPU) is filled by its first load and serves every later one."""

    def __init__(self, path: PathLike, device: Optional[torch.device] = None,
                 link_bytes_per_us: Optional[float] = None, link_overhead_us: float = 0.0,
                 backend: Optional[Backend] = None):
        if link_bytes_per_us is not None and not link_bytes_per_us > 0:
            raise ValueError(f"LayerGroupsProgram: link_bytes_per_us={link_bytes_per_us!r} "
                             f"must be > 0")
        self.path = path
        self.device = torch.device(device if device is not None else "cpu")
        self.link = (link_bytes_per_us, link_overhead_us)
        self.loaded = False
        self.fallback_reason = ""
        self.last_timeline: Optional[LoadTimeline] = None
        self.host = HostCopy(pin=self.device.type == "cuda")
        self._steps: dict[tuple, _Step] = {}
        self._latest: Optional[_Step] = None
        self._given = backend
        self._own: Optional[Backend] = None
        self._backends: dict[torch.device, Backend] = {}

    @property
    def backend(self) -> Backend:
        """The backend this program runs and captures on (see the class docstring)."""
        if self._given is not None:
            return self._given
        if self._own is None:  # the meta device (shapes, no data) runs on the CPU's
            self._own = runner_backend("cpu" if self.device.type == "meta" else self.device)
        return self._own

    def _open(self, gm: fx.GraphModule) -> _Loads:
        """The loads of one run from the store, validated against ``gm``'s groups first."""
        targets = group_tensors(gm)
        store = WeightStore.open(self.path, expected_specs(targets))
        return _Loads(store, targets, self.device, self.link, self._resident, self.host)

    def _resident(self) -> None:
        self.loaded = True

    def run(self, gm: fx.GraphModule, args: Sequence[Any] = (), kwargs: Optional[dict] = None
            ) -> tuple[Any, LoadTimeline]:
        """Run ``gm``'s forward (no autograd) while its weights stream in; return the output
        and the timeline read from the piece trace. The groups run node by node, not captured:
        this forward runs once, and capturing it (a warm-up run per segment) would double the
        cold start it is there to shorten."""
        values = _positional(gm, args, kwargs)
        loads = self._open(gm)
        runner = ProgramRunner(backend=self.backend)
        try:
            run = pipelined(cut_at_markers(gm.graph.nodes))
            bound = InterpretedSegments(run, graph_interpreter(gm, *values), loads)
            trace = runner.launch(bound.program, bound.work)  # a corrupt load: WeightStoreError
        finally:
            loads.store.close()
            if self._given is None:  # the CPU's stream workers end; the backend stays
                runner.close()
        out = bound.output()
        # made on the program's streams, used on the caller's from now on (a GPU's allocator
        # must not hand their memory back to those streams before the caller's work on it ran)
        used_here(*flat_tensors(out), *(b for b in loads.buffers if b is not None))
        return out, LoadTimeline.of(run, trace)

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """The first call streams the weights in (:meth:`run`); later ones run the resident
        graph."""
        if self.loaded:
            return gm(*args, **kwargs)
        out, self.last_timeline = self.run(gm, args, kwargs)
        return out

    def bind(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> _Bound:
        """One training step (see the module docstring). Until the weights are resident, the
        step loads them: its groups run ``gm``'s segments with autograd as the weights stream
        in, then an eager ``backward`` (the captures read the parameters in place, from where
        the loads put them, so they are made once the weights are resident). Afterwards the
        step's program is built and captured once per input shape. One step of a shape runs
        at a time (a program job binds a step once the previous one ended): its captured
        segments have one set of static buffers."""
        inputs = tuple(inputs)
        if not self.loaded:
            run = pipelined(cut_at_markers(gm.graph.nodes), [("backward", ()), ("optimizer", ())])
            self._latest = _Step(None, None, run, (("-", LOADING_STEP),))
            return bind_training(run, gm, inputs, targets, loss_fn, optimizer, self._open(gm))
        key = tuple((tuple(t.shape), t.dtype) for t in flat_tensors((inputs, targets)))
        if key not in self._steps:
            self._steps[key] = self._capture(gm, inputs, targets, loss_fn)
        step = self._latest = self._steps[key]
        if step.captured is None:
            return bind_training(step.run, gm, inputs, targets, loss_fn, optimizer, None)
        return _bind_captured(step, gm, inputs, targets, optimizer)

    def uncaptured(self) -> list[tuple[str, str]]:
        """(node, reason) of each node the latest step's program runs uncaptured (the
        ``group_boundary`` markers, which compute nothing, left out); for an eager step,
        ``[(node or "-", fallback_reason)]``; for the step that loads the weights,
        ``[("-", LOADING_STEP)]``."""
        return list(self._latest.uncaptured) if self._latest is not None else []

    def _capture(self, gm: fx.GraphModule, inputs: tuple, targets: Any,
                 loss_fn: Callable) -> _Step:
        tail: list[tuple[str, Segment]]
        try:
            train = capture_train_step(gm, inputs, targets, loss_fn)
            forward, tail = _joint_segments(train, group_tensors(gm))
        except (TraceError, ValueError) as e:
            return self._eager_step(gm, str(e))
        tail.append(("optimizer", ()))
        run = pipelined(forward, tail, loads=False)
        flat = step_inputs(train, gm, inputs, targets)  # the resident weights, read in place
        try:
            with fork_rng_of(flat):  # capturing consumes no randomness, on any device
                captured = CapturedProgram.build(run.program, train.gm, flat,
                                                 self._backend(flat), state=state_inputs(train))
        except Exception as e:  # noqa: BLE001 - the eager step runs, the node named
            failing = failing_node(train, flat)
            named = re.match(r"node '([^']+)'", failing)
            return self._eager_step(gm, "the captured step failed to run: " + (
                failing or f"{type(e).__name__}: {e}"), named.group(1) if named else "-")
        markers = {n.name for n in train.gm.graph.nodes if n.target is ops.GROUP_BOUNDARY}
        uncaptured = tuple((node, why) for node, why in captured.uncaptured()
                           if node not in markers)
        return _Step(train, captured, run, uncaptured)

    def _eager_step(self, gm: fx.GraphModule, why: str, node: str = "-") -> _Step:
        """The step that runs the groups with autograd and an eager ``backward``."""
        self.fallback_reason = (f"the training step runs the groups with autograd and an "
                                f"eager backward: {why}")
        run = pipelined(cut_at_markers(gm.graph.nodes), [("backward", ()), ("optimizer", ())],
                        loads=False)
        return _Step(None, None, run, ((node, self.fallback_reason),))

    def _backend(self, flat: Sequence[Any]) -> Backend:
        """The capture backend of the device of ``flat``'s tensors: this program's
        :attr:`backend` on its device, else one made once per device."""
        device = flat_tensors(flat)[0].device
        if _same_device(device, self.device):
            return self.backend
        if device not in self._backends:
            self._backends[device] = backend_for(device)
        return self._backends[device]


def _bind_captured(step: _Step, gm: fx.GraphModule, inputs: tuple, targets: Any,
                   optimizer: torch.optim.Optimizer) -> _Bound:
    """A step of the captured joint graph: its segments (lowered, captured) compute the loss
    and the gradients, the ``optimizer`` piece applies them. What outlives the step is copied
    out of a CUDA graph's static outputs, which the next step's replay overwrites."""
    train = step.train
    params = {k: p for k, p in gm.named_parameters() if p.requires_grad}
    replay = step.captured.run(step_inputs(train, gm, inputs, targets))
    loss, grads = grad_nodes(train)

    def apply() -> None:
        optimizer.zero_grad(set_to_none=True)
        for name, node in zip(train.param_names, grads):
            g = replay.value(node)
            params[name].grad = g if g.device.type == "cpu" else g.clone()  # CPU: its own
        optimizer.step()

    index = {p.name: i for i, p in enumerate(step.run.program.pieces)}
    return _Replayed(step.run, replay, index, None, calls={"optimizer": apply},
                     loss=lambda: replay.value(loss).detach().clone())


def bind_training(run: Pipelined, gm: fx.GraphModule, inputs: tuple, targets: Any,
                loss_fn: Callable, optimizer: torch.optim.Optimizer,
                loads: Optional[_Loads]) -> _Bound:
    """A step whose groups run ``gm``'s segments with autograd, then an eager ``backward``."""
    done: dict[str, torch.Tensor] = {}

    def backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(bound.output(), targets)
        loss.backward()
        done["loss"] = loss.detach()

    bound = InterpretedSegments(run, graph_interpreter(gm, *inputs), loads, grad=True,
                         calls={"backward": backward, "optimizer": optimizer.step},
                         loss=lambda: done["loss"])
    return bound


def run_pipelined(gm: fx.GraphModule, path: PathLike, inputs: Sequence[Any],
                  kwargs: Optional[dict] = None, *, device: Optional[torch.device] = None,
                  link_bytes_per_us: Optional[float] = None, link_overhead_us: float = 0.0,
                  backend: Optional[Backend] = None) -> tuple[Any, LoadTimeline]:
    """Run ``gm`` while its weights stream in from the store at ``path`` onto ``device``
    (the CPU by default); return the output and the recorded timeline
    (:meth:`LayerGroupsProgram.run`). The store is validated before anything runs."""
    return LayerGroupsProgram(path, device, link_bytes_per_us, link_overhead_us,
                              backend).run(gm, inputs, kwargs)


def cold_start(compiled: Any, path: PathLike, *inputs: Any, device: Any = None,
               **kwargs: Any) -> Any:
    """The first output of a compiled model whose weights stream in from ``path`` onto
    ``device`` (by default where the model's parameters are; the ``layer_groups`` pass must
    have run). Inputs default to the compile-time example inputs; their tensors are moved to
    ``device``."""
    gm = compiled.graph_module
    where = torch.device(device) if device is not None else device_of(gm)
    if not inputs and not kwargs:
        example = compiled.context.example_inputs
        inputs, kwargs = ((), dict(example)) if isinstance(example, Mapping) else (example, {})
    inputs, kwargs = tree_map(lambda v: v.to(where) if isinstance(v, torch.Tensor) else v,
                              (tuple(inputs), dict(kwargs)))
    out, _ = run_pipelined(gm, path, inputs, kwargs, device=where)
    return out

"""PipeSwitch's pipelined weight loading as a program: group ``k+1``'s weights load while group
``k`` computes.

A graph grouped by the ``layer_groups`` pass has a ``tidal::group_boundary(k)`` marker before
the first node of each group (``tidal.runtime.weight_loader.group_tensors`` says which
parameters and buffers each group loads, ``write_groups`` writes them as a store).
:func:`pipelined` is the program: per group ``k`` a ``load group k`` piece on the ``load``
stream and a ``group k`` piece on the ``compute`` stream, the group's segment of the graph (cut
at the markers, :func:`cut_at_markers`), which waits for ``load group k`` and ``group k-1``. The
loads run one after another (one link) and ahead of the compute, so group ``k+1``'s weights
load while group ``k`` computes. A load copies the group's contiguous buffer out of the
memory-mapped store (through a pinned staging copy on a side CUDA stream on a GPU), checks the
bytes against the store's checksums (a corrupt tensor raises ``WeightStoreError`` naming it and
its group) and points the group's parameters and buffers at views of the copy. The store is
validated before anything runs.

:class:`LayerGroupsProgram` is the rank program of a ``LayerGroupPlan`` that names a weight
store (:func:`from_plan`). Its first forward streams the weights in
(:meth:`~LayerGroupsProgram.run`; the :class:`LoadTimeline` it returns is read from the piece
trace). A training step (:meth:`~LayerGroupsProgram.bind`) runs the groups' forward segments of
the captured joint forward+backward graph (``tidal.ir.capture.capture_train_step``, cut at the
same markers), then ``backward k`` segments (each ends where the gradients of group ``k``'s
parameters are complete, the last group first) and the ``optimizer`` piece; the loads are in the
program only until the weights are resident. The segments are lowered and captured once per
input shape (``tidal.runtime.program.CapturedProgram``: a CUDA graph on a GPU, the straight-line
replay on the CPU); a node that cannot run captured (an in-place update of a buffer, a host
sync) runs uncaptured in its piece and :meth:`~LayerGroupsProgram.uncaptured` names it. A step
that cannot be captured runs the groups' segments of the graph module with autograd, then an
eager ``backward`` piece (``fallback_reason`` says why). :func:`run_pipelined` and
:func:`cold_start` are the cold-start forward of a graph module and of a compiled model (run
node by node, not captured: see :meth:`~LayerGroupsProgram.run`).

Example:
    >>> import os, tempfile, torch, tidal
    >>> from tidal.passes.layer_groups import LayerGroups
    >>> from tidal.runtime.weight_loader import write_groups
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

from tidal.ir import ops
from tidal.ir.capture import TrainStep, capture_train_step
from tidal.ir.errors import TraceError
from tidal.ir.inputs import as_kwargs, bind_inputs
from tidal.ir.node_runner import flat_tensors
from tidal.runtime.backend import Backend, backend_for
from tidal.runtime.program import (COMPUTE, CapturedProgram, CapturedRun, Piece, PieceTrace,
                                   Program, ProgramRunner, _grad_nodes)
from tidal.runtime.programs.data_parallel import _failing_node, _flat
from tidal.runtime.weight_loader import GroupedTensors, expected_specs, group_tensors
from tidal.runtime.weight_store import PathLike, WeightStore, WeightStoreError, view_tensor

PLAN_KIND = "LayerGroupPlan"
LOAD = "load"
"""The stream of the weight loads (host-side: it does not occupy the device)."""

Segment = tuple[str, ...]
"""Node names of one compute piece, in graph order."""


def from_plan(gm: fx.GraphModule, plan: Any) -> Optional["LayerGroupsProgram"]:
    """The rank program of a ``layer_groups`` plan that names a weight store (None without
    one: the graph runs as it is)."""
    store = getattr(plan, "weight_store", None)
    return LayerGroupsProgram(store) if store else None


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
    """Recorded times in seconds from the start of the run: per group the ``transfer`` (its
    load piece) and the ``execute`` (its compute piece) interval, and when the output was
    ready; ``program`` and ``trace`` are the pieces that ran."""

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
    """One run's weight loads: ``load(k)`` (the ``load group k`` piece) copies group ``k`` out
    of the open ``store``, checks it and points the group's tensors (``targets[k]``) at the
    copy; ``ready(k)`` (at the start of ``group k``) raises if that failed. The store closes
    after the last load, and ``resident()`` is called once every group is in."""

    def __init__(self, store: WeightStore, targets: GroupedTensors, device: torch.device,
                 link: tuple[Optional[float], float], resident: Callable[[], None]):
        self.store, self.targets, self.device, self.link = store, targets, device, link
        self.resident = resident
        self.done = [False] * store.num_groups
        self.events: list[Any] = [None] * store.num_groups
        self.cuda_stream: Any = None

    def load(self, k: int) -> None:
        """Load group ``k`` (after the groups before it)."""
        try:
            failed = [j for j in range(k) if not self.done[j]]
            if failed:
                raise RuntimeError(f"weight group {k} of {self.store.path} is not loaded: "
                                   f"loading group {failed[0]} failed")
            start = time.perf_counter()
            buf = self._copy(k)
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
        """Group ``k``'s bytes on the device, checked against the store's checksums before
        they are returned (on a GPU the check reads the pinned staging copy while the
        transfer runs)."""
        region = self.store.group_region(k)
        if self.device.type == "cuda":  # pinned staging + side stream; not measured here
            self.cuda_stream = self.cuda_stream or torch.cuda.Stream(self.device)
            staging = region.pin_memory()
            with torch.cuda.stream(self.cuda_stream):
                dst = torch.empty(region.numel(), dtype=torch.uint8, device=self.device)
                dst.copy_(staging, non_blocking=True)
                self.events[k] = torch.cuda.Event()
                self.events[k].record(self.cuda_stream)
            self.store.verify(k, staging)
            return dst
        dst = torch.empty(region.numel(), dtype=torch.uint8, device=self.device)
        dst.copy_(region)
        # the checksum is computed on the host: verify the source bytes off the CPU
        self.store.verify(k, dst if dst.device.type == "cpu" else region)
        return dst

    def ready(self, k: int) -> None:
        """Raise unless group ``k``'s weights were loaded (on a GPU, make the current stream
        wait for their copy)."""
        if not self.done[k]:
            raise RuntimeError(f"group {k} cannot run: its weights were not loaded (see the "
                               f"piece 'load group {k}')")
        if self.events[k] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.events[k])


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
    """A training step for one input shape: the captured joint graph and its lowered, captured
    segments (None: eager backward), its program with the loads and without them, and what it
    runs uncaptured (the node and why; for the eager step, the fallback reason)."""

    train: Optional[TrainStep]
    captured: Optional[CapturedProgram]
    loading: Pipelined
    resident: Pipelined
    uncaptured: tuple[tuple[str, str], ...] = ()


def _joint_segments(train: TrainStep, groups: GroupedTensors
                    ) -> tuple[list[Segment], list[tuple[str, Segment]]]:
    """The forward segment of each group in a captured step (cut at its markers, the last
    ending at the loss) and its backward segments: ``backward k`` ends where the gradients of
    group ``k``'s parameters are complete, the last group first (a group whose gradients are
    complete earlier, or that has none, has no segment). Raises ``ValueError`` when the capture
    did not keep one marker per group."""
    nodes = [n for n in train.gm.graph.nodes if n.op != "output"]
    loss, grads = _grad_nodes(train)
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
    cold-start forward's :class:`LoadTimeline`. ``device`` is where the weights go;
    ``link_bytes_per_us``/``link_overhead_us`` emulate a slower link (each load takes at least
    ``overhead + bytes / bandwidth``), for tests and benchmarks."""

    def __init__(self, path: PathLike, device: Optional[torch.device] = None,
                 link_bytes_per_us: Optional[float] = None, link_overhead_us: float = 0.0):
        if link_bytes_per_us is not None and not link_bytes_per_us > 0:
            raise ValueError(f"LayerGroupsProgram: link_bytes_per_us={link_bytes_per_us!r} "
                             f"must be > 0")
        self.path = path
        self.device = torch.device(device or "cpu")
        self.link = (link_bytes_per_us, link_overhead_us)
        self.loaded = False
        self.fallback_reason = ""
        self.last_timeline: Optional[LoadTimeline] = None
        self._steps: dict[tuple, _Step] = {}
        self._latest: Optional[_Step] = None
        self._backends: dict[torch.device, Backend] = {}

    def _open(self, gm: fx.GraphModule) -> _Loads:
        """The loads of one run from the store, validated against ``gm``'s groups first."""
        targets = group_tensors(gm)
        store = WeightStore.open(self.path, expected_specs(targets))
        return _Loads(store, targets, self.device, self.link, self._resident)

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
        try:
            run = pipelined(cut_at_markers(gm.graph.nodes))
            bound = InterpretedSegments(run, graph_interpreter(gm, *values), loads)
            with ProgramRunner() as runner:
                trace = runner.launch(bound.program, bound.work)  # a corrupt load: WeightStoreError
        finally:
            loads.store.close()
        return bound.output(), LoadTimeline.of(run, trace)

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """The first call streams the weights in (:meth:`run`); later ones run the resident
        graph."""
        if self.loaded:
            return gm(*args, **kwargs)
        out, self.last_timeline = self.run(gm, args, kwargs)
        return out

    def bind(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> _Bound:
        """One training step (see the module docstring); the step's program is built and
        captured once per input shape, with the loads until the weights are resident. One
        step of a shape runs at a time (a program job binds a step once the previous one
        ended): its captured segments have one set of static buffers."""
        inputs = tuple(inputs)
        key = tuple((tuple(t.shape), t.dtype) for t in flat_tensors((inputs, targets)))
        if key not in self._steps:
            self._steps[key] = self._capture(gm, inputs, targets, loss_fn)
        step = self._latest = self._steps[key]
        loads = None if self.loaded else self._open(gm)
        run = step.resident if loads is None else step.loading
        if step.captured is None or (loads is not None and _moves(loads)):
            # the weights change device during this step: the captured segments cannot
            # take them (their inputs' devices are fixed), this one step runs eagerly
            return bind_training(run, gm, inputs, targets, loss_fn, optimizer, loads)
        return _bind_captured(run, step, gm, inputs, targets, optimizer, loads)

    def uncaptured(self) -> list[tuple[str, str]]:
        """(node, reason) of each node the latest step's program runs uncaptured (the
        ``group_boundary`` markers, which compute nothing, left out); for an eager step,
        ``[(node or "-", fallback_reason)]``."""
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
        resident = pipelined(forward, tail, loads=False)
        flat = _flat(train, gm, inputs, targets)
        # on copies placed where the weights will be once loaded (capturing moves nothing)
        where = [v.to(self.device) if isinstance(v, torch.Tensor) and not self.loaded else v
                 for v in flat]
        try:
            with torch.random.fork_rng(devices=[]):  # capturing consumes no randomness
                captured = CapturedProgram.build(resident.program, train.gm, where,
                                                 self._backend(where))
        except Exception as e:  # noqa: BLE001 - the eager step runs, the node named
            failing = _failing_node(train, where)
            named = re.match(r"node '([^']+)'", failing)
            return self._eager_step(gm, "the captured step failed to run: " + (
                failing or f"{type(e).__name__}: {e}"), named.group(1) if named else "-")
        markers = {n.name for n in train.gm.graph.nodes if n.target is ops.GROUP_BOUNDARY}
        uncaptured = tuple((node, why) for node, why in captured.uncaptured()
                           if node not in markers)
        return _Step(train, captured, pipelined(forward, tail), resident, uncaptured)

    def _eager_step(self, gm: fx.GraphModule, why: str, node: str = "-") -> _Step:
        """The step that runs the groups with autograd and an eager ``backward``."""
        self.fallback_reason = (f"the training step runs the groups with autograd and an "
                                f"eager backward: {why}")
        forward, tail = cut_at_markers(gm.graph.nodes), [("backward", ()), ("optimizer", ())]
        return _Step(None, None, pipelined(forward, tail), pipelined(forward, tail, loads=False),
                     ((node, self.fallback_reason),))

    def _backend(self, flat: Sequence[Any]) -> Backend:
        """The capture backend of the device of ``flat``'s tensors (one per device, so a
        GPU's CUDA graphs share one memory pool)."""
        device = flat_tensors(flat)[0].device
        if device not in self._backends:
            self._backends[device] = backend_for(device)
        return self._backends[device]


def _moves(loads: _Loads) -> bool:
    """Whether the loads put a tensor on another device than the one it is on."""
    to = loads.device
    return any(t.device.type != to.type or to.index is not None and t.device.index != to.index
               for group in loads.targets for _, t in group)


def _bind_captured(run: Pipelined, step: _Step, gm: fx.GraphModule, inputs: tuple,
                   targets: Any, optimizer: torch.optim.Optimizer,
                   loads: Optional[_Loads]) -> _Bound:
    """A step of the captured joint graph: its segments (lowered, captured) compute the loss
    and the gradients, the ``optimizer`` piece applies them. What outlives the step is copied
    out of a CUDA graph's static outputs, which the next step's replay overwrites."""
    train = step.train
    params = {k: p for k, p in gm.named_parameters() if p.requires_grad}
    replay = step.captured.run(_flat(train, gm, inputs, targets))
    loss, grads = _grad_nodes(train)

    def apply() -> None:
        optimizer.zero_grad(set_to_none=True)
        for name, node in zip(train.param_names, grads):
            g = replay.value(node)
            params[name].grad = g if g.device.type == "cpu" else g.clone()  # CPU: its own
        optimizer.step()

    index = {p.name: i for i, p in enumerate(step.resident.program.pieces)}
    return _Replayed(run, replay, index, loads, calls={"optimizer": apply},
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
                  link_bytes_per_us: Optional[float] = None, link_overhead_us: float = 0.0
                  ) -> tuple[Any, LoadTimeline]:
    """Run ``gm`` while its weights stream in from the store at ``path``; return the output
    and the recorded timeline (:meth:`LayerGroupsProgram.run`). The store is validated before
    anything runs."""
    return LayerGroupsProgram(path, device, link_bytes_per_us, link_overhead_us).run(
        gm, inputs, kwargs)


def cold_start(compiled: Any, path: PathLike, *inputs: Any, **kwargs: Any) -> Any:
    """The first output of a compiled model whose weights stream in from ``path`` (the
    ``layer_groups`` pass must have run). Inputs default to the compile-time example inputs."""
    if not inputs and not kwargs:
        example = compiled.context.example_inputs
        inputs, kwargs = ((), dict(example)) if isinstance(example, Mapping) else (example, {})
    out, _ = run_pipelined(compiled.graph_module, path, inputs, kwargs)
    return out

"""PipeSwitch's pipelined weight loading as a program: group ``k+1``'s weights load while group
``k`` computes.

A graph grouped by the ``layer_groups`` pass has a ``tidal::group_boundary(k)`` marker before
the first node of each group (``tidal.runtime.weights.loader.group_tensors`` says which
parameters and buffers each group loads, ``write_groups`` writes them as a store).
:func:`pipelined` (``tidal.ir.layer_group_program``) is the program: per group ``k`` a ``load
group k`` piece on the ``load`` stream and a ``group k`` piece on the ``compute`` stream, the
group's segment of the graph (cut at the markers, :func:`cut_at_markers`), which waits for
``load group k`` and ``group k-1``. The loads run one after another (one link) and ahead of the
compute, so group ``k+1``'s weights load while group ``k`` computes. The program runs on its
device's backend (``tidal.runtime.program.runner_backend``; on a GPU, CUDA streams): the loads
on the backend's ``load`` stream (low priority, not occupying the device), the groups on the
compute stream at the job's priority, an event between a group's load and its compute. A load
copies the group's contiguous buffer onto the device on the stream it runs on and points the
group's parameters and buffers at views of the copy; on a GPU the group's compute waits for the
copy's event and the copy is marked used on the compute stream (``record_stream``). The bytes
are checked against the store's checksums as they are read from the file (a corrupt tensor
raises ``WeightStoreError`` naming it and its group): on the CPU into the copy itself, on any
other device into the program's host copy (``tidal.runtime.weights.store.HostCopy``: one
buffer, pinned on a GPU, allocated once and reused, each group read and verified once), from
which a GPU copies by DMA (``tidal.runtime.programs.layer_group_loads``). The store is
validated before anything runs. A run's :class:`LoadTimeline` is read from its launches:
device-side times on the backend's one clock (CUDA event times on a GPU).

:class:`LayerGroupsProgram` is the rank program of a ``LayerGroupPlan`` that names a weight
store (:func:`from_plan`). Its first forward streams the weights in
(:meth:`~LayerGroupsProgram.run`; the :class:`LoadTimeline` it returns is read from the piece
trace). Its first training step (:meth:`~LayerGroupsProgram.bind`) loads the weights: the
groups run the graph module's segments with autograd as the weights stream in, then an eager
``backward`` piece. Every later step runs the groups' forward segments of the captured joint
forward+backward graph (``tidal.ir.capture.capture_train_step``, cut at the same markers), then
``backward k`` segments (each ends where the gradients of group ``k``'s parameters are
complete, the last group first: ``tidal.ir.joint_segments.group_segments``) and the
``optimizer`` piece. The segments are lowered and captured once per input shape, against the
resident weights, which every replay reads in place (``tidal.runtime.programs.step_capture``:
CUDA graphs in a memory pool of their own on a GPU, the straight-line replay on the CPU); a
node that cannot run captured (an in-place update of a buffer, a host sync) runs uncaptured in
its piece and :meth:`~LayerGroupsProgram.uncaptured` names it. A step that cannot be captured
runs the groups' segments of the graph module with autograd, then an eager ``backward`` piece
(``fallback_reason`` says why). The steps are captured once per input shape, autocast state,
set of modules' ``training`` flags and of parameters' ``requires_grad`` (freezing or
``model.eval()`` re-captures in this program, on the resident weights), and the pieces that run
eagerly (interpreted segments, ``backward``) run under the autocast of the thread that bound the
step, on whichever thread runs them (``tidal.runtime.programs.piece_autocast``); the captured
segments' casts are in their graph. The open step (``Compiled.backward``,
:meth:`~LayerGroupsProgram.bind_backward`) is the same program with a ``grads`` piece in place of
``optimizer``: the gradient of ``scale * loss`` added to each trainable parameter's ``.grad``
(one process: ``no_sync`` changes nothing; ``torch.nn.utils.clip_grad_norm_`` clips the global
norm). :func:`run_pipelined` and :func:`cold_start` are the cold-start
forward of a graph module and of a compiled model, on any device (run node by node, not
captured: see :meth:`~LayerGroupsProgram.run`).

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

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from tidal.ir import ops
from tidal.ir.capture import step_inputs
from tidal.ir.inputs import as_kwargs, bind_inputs
from tidal.ir.joint_segments import cut_at_markers, group_segments
from tidal.ir.layer_group_program import (BACKWARD_PIECE, OPTIMIZER_PIECE, Pipelined,
                                          pipelined)
from tidal.ir.node_runner import flat_tensors
from tidal.ir.step_state import step_state
from tidal.runtime.backend import Backend, backend_for, used_here
from tidal.runtime.program import ProgramRunner, device_of, runner_backend
from tidal.runtime.programs.layer_group_loads import GroupLoads, LoadTimeline
from tidal.runtime.programs.layer_group_steps import (BoundGroups, InterpretedSegments,
                                                      bind_captured, bind_open_captured,
                                                      bind_open_training, bind_training,
                                                      graph_interpreter)
from tidal.runtime.programs.optimizer_wiring import GRADS
from tidal.runtime.programs.step_capture import (Fallback, StepCapture, capture_step,
                                                 lower_step, shape_key)
from tidal.runtime.weights.loader import expected_specs, group_tensors
from tidal.runtime.weights.store import HostCopy, PathLike, WeightStore

__all__ = ["LOADING_STEP", "LayerGroupsProgram", "PLAN_KIND", "cold_start", "from_plan",
           "run_pipelined"]

PLAN_KIND = "LayerGroupPlan"

LOADING_STEP = ("the step that loads the weights runs the groups with autograd and an eager "
                "backward (the captured steps after it read the weights in place, where the "
                "loads put them)")
"""Why the training step that loads the weights runs uncaptured."""

EAGER_TAIL = ((BACKWARD_PIECE, ()), (OPTIMIZER_PIECE, ()))
"""The pieces after the groups' forward in a step that runs with autograd."""

OPEN_TAIL = ((BACKWARD_PIECE, ()), (GRADS, ()))
"""The pieces after the groups' forward in an open step that runs with autograd."""


def from_plan(gm: fx.GraphModule, plan: Any, device: Optional[torch.device] = None
              ) -> Optional["LayerGroupsProgram"]:
    """The rank program of a ``layer_groups`` plan that names a weight store, loading onto
    ``device`` (by default the device of ``gm``'s parameters); None without a store: the graph
    runs as it is."""
    store = getattr(plan, "weight_store", None)
    if not store:
        return None
    return LayerGroupsProgram(store, device if device is not None else device_of(gm))


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (a device without an index matches any index
    of its type)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _positional(gm: fx.GraphModule, args: Sequence[Any], kwargs: Optional[dict]) -> tuple:
    """``args`` and ``kwargs`` of a call of ``gm`` as values of its placeholders, in order."""
    if not kwargs:
        return tuple(args)
    return bind_inputs(gm, {**as_kwargs(gm, tuple(args)), **kwargs}, "layer groups: inputs")


@dataclass(frozen=True)
class _Step:
    """A training step for one input shape on the resident weights: its pipelined program,
    the open step's (``grads`` in place of ``optimizer``) and the step captured for them (or
    why they run with autograd)."""

    run: Pipelined
    open_run: Pipelined
    capture: StepCapture

    @classmethod
    def eager(cls, forward: Sequence[Sequence[str]], why: Fallback, loads: bool) -> "_Step":
        """The step whose groups run ``forward`` (node names per group) with autograd."""
        run = pipelined(forward, EAGER_TAIL, loads=loads)
        return cls(run, pipelined(forward, OPEN_TAIL, loads=loads),
                   StepCapture.eager(run.program, why))


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

    recaptures_autocast = True
    """A step in another autocast state is captured again (``step_capture.shape_key`` holds
    it); the eager pieces run under the binding thread's autocast."""

    recaptures_state = True
    """A step after freezing, unfreezing or ``model.eval()`` is captured again by this
    program (its captures are keyed by the modules' ``training`` flags and the parameters'
    ``requires_grad``): a new program would stream the stored weights in again over the
    trained ones."""

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

    def _open(self, gm: fx.GraphModule) -> GroupLoads:
        """The loads of one run from the store, validated against ``gm``'s groups first."""
        targets = group_tensors(gm)
        store = WeightStore.open(self.path, expected_specs(targets))
        return GroupLoads(store, targets, self.device, self.link, self._resident, self.host)

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
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> BoundGroups:
        """One training step (see the module docstring). Until the weights are resident, the
        step loads them: its groups run ``gm``'s segments with autograd as the weights stream
        in, then an eager ``backward`` (the captures read the parameters in place, from where
        the loads put them, so they are made once the weights are resident). Afterwards the
        step's program is built and captured once per input shape and autocast state. One
        step of a shape runs at a time (a program job binds a step once the previous one
        ended): its captured segments have one set of static buffers."""
        inputs = tuple(inputs)
        if not self.loaded:
            step = self._loading(gm)
            return bind_training(step.run, gm, inputs, targets, loss_fn, optimizer,
                                 self._open(gm))
        step = self._step(gm, model, inputs, targets, loss_fn)
        if not step.capture.captured:
            return bind_training(step.run, gm, inputs, targets, loss_fn, optimizer, None)
        return bind_captured(step.run, step.capture, gm, inputs, targets, optimizer)

    def bind_backward(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple,
                      targets: Any, loss_fn: Callable, scale: Any, sync: bool) -> BoundGroups:
        """The open step (``Compiled.backward``): :meth:`bind`'s program with a ``grads``
        piece in place of the ``optimizer`` piece, which adds the gradients of ``scale *
        loss`` (``scale`` None, a number or a tensor: a ``GradScaler``'s) to each trainable
        parameter's ``.grad``; the loss it returns is unscaled. The first step (open or not)
        streams the weights in. One process: ``sync`` (False inside ``no_sync``) changes
        nothing, the gradients are added to ``.grad`` as DDP's ``no_sync`` leaves them there.

        Example:
            >>> import os, tempfile, torch, tidal
            >>> from tidal.passes.layer_groups import LayerGroups
            >>> from tidal.runtime.weights.loader import write_groups
            >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(),
            ...                             torch.nn.Linear(4, 2))
            >>> x, y = torch.randn(3, 4), torch.tensor([0, 1, 1])
            >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
            >>> write_groups(tidal.compile(model, (x,), passes=[LayerGroups(
            ...     grouping="per_layer")]).graph_module, path)
            >>> c = tidal.compile(model, (x,), passes=[LayerGroups(grouping="per_layer",
            ...     weight_store=path)], loss_fn=torch.nn.functional.cross_entropy)
            >>> loss = c.backward((x,), y, scale=0.5)          # streams the weights in
            >>> [p.name for p in c.executor.last_program.pieces][2:]
            ['load group 2', 'group 0', 'group 1', 'group 2', 'backward', 'grads']
            >>> loss = c.backward((x,), y, scale=0.5)          # captured, added to .grad
            >>> [p.name for p in c.executor.last_program.pieces]
            ['group 0', 'group 1', 'group 2', 'backward 2', 'backward 0', 'grads']
        """
        inputs = tuple(inputs)
        if not self.loaded:
            step = self._loading(gm)
            return bind_open_training(step.open_run, gm, inputs, targets, loss_fn, scale,
                                      self._open(gm))
        step = self._step(gm, model, inputs, targets, loss_fn)
        if not step.capture.captured:
            return bind_open_training(step.open_run, gm, inputs, targets, loss_fn, scale, None)
        return bind_open_captured(step.open_run, step.capture, gm, inputs, targets, scale)

    def _loading(self, gm: fx.GraphModule) -> _Step:
        """The step that streams the weights in (the latest one)."""
        self._latest = _Step.eager(cut_at_markers(gm.graph.nodes), Fallback(LOADING_STEP),
                                   loads=True)
        return self._latest

    def _step(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
              loss_fn: Callable) -> _Step:
        """The step on the resident weights for these shapes, this thread's autocast state
        and ``model``'s training flags and ``requires_grad`` (captured on first use; the
        latest one)."""
        state = step_state(model)
        key = (id(gm), state.training, state.requires_grad) + shape_key(inputs, targets)
        if key not in self._steps:
            self._steps[key] = self._capture(gm, inputs, targets, loss_fn)
        self._latest = self._steps[key]
        return self._latest

    def uncaptured(self) -> list[tuple[str, str]]:
        """(node, reason) of each node the latest step's program runs uncaptured (the
        ``group_boundary`` markers, which compute nothing, left out); for an eager step,
        ``[(node or "-", fallback_reason)]``; for the step that loads the weights,
        ``[("-", LOADING_STEP)]``."""
        return list(self._latest.capture.uncaptured) if self._latest is not None else []

    def _capture(self, gm: fx.GraphModule, inputs: tuple, targets: Any,
                 loss_fn: Callable) -> _Step:
        """The captured step of these shapes on the resident weights (read in place), or the
        step that runs with autograd (``fallback_reason`` says why)."""
        try:
            train = capture_step(gm, inputs, targets, loss_fn)
            names = [[name for name, _ in group] for group in group_tensors(gm)]
            try:
                forward, tail = group_segments(train, names)
            except ValueError as e:
                raise Fallback(str(e)) from e
            run = pipelined(forward, [*tail, (OPTIMIZER_PIECE, ())], loads=False)
            open_run = pipelined(forward, [*tail, (GRADS, ())], loads=False)
            flat = step_inputs(train, gm, inputs, targets)
            capture = lower_step(train, run.program, {0: flat}, self._backend(flat))
        except Fallback as why:
            self.fallback_reason = (f"the training step runs the groups with autograd and an "
                                    f"eager backward: {why.reason}")
            return _Step.eager(cut_at_markers(gm.graph.nodes),
                               Fallback(self.fallback_reason, why.node), loads=False)
        markers = {n.name for n in train.gm.graph.nodes if n.target is ops.GROUP_BOUNDARY}
        kept = tuple((node, why) for node, why in capture.uncaptured if node not in markers)
        return _Step(run, open_run, replace(capture, uncaptured=kept))

    def _backend(self, flat: Sequence[Any]) -> Backend:
        """The capture backend of the device of ``flat``'s tensors: this program's
        :attr:`backend` on its device, else one made once per device."""
        device = flat_tensors(flat)[0].device
        if _same_device(device, self.device):
            return self.backend
        if device not in self._backends:
            self._backends[device] = backend_for(device)
        return self._backends[device]


def run_pipelined(gm: fx.GraphModule, path: PathLike, inputs: Sequence[Any],
                  kwargs: Optional[dict] = None, *, device: Optional[torch.device] = None,
                  link_bytes_per_us: Optional[float] = None, link_overhead_us: float = 0.0,
                  backend: Optional[Backend] = None) -> tuple[Any, LoadTimeline]:
    """Run ``gm`` while its weights stream in from the store at ``path`` onto ``device``
    (the CPU by default); return the output and the recorded timeline
    (:meth:`LayerGroupsProgram.run`). The store is validated before anything runs."""
    return LayerGroupsProgram(path, device, link_bytes_per_us, link_overhead_us,
                              backend).run(gm, inputs, kwargs)

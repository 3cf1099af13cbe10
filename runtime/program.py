"""Programs: one rank's training step as pieces on streams, run by one executor.

A :class:`Program` is data: a list of :class:`Piece` objects, each on a named stream
(``compute``, ``comm``, ``load``, or another compute stream such as a wave's; :func:`stream_kind`)
with the indices of the pieces it waits for. Builders (``tidal.runtime.programs``, one per plan
kind) make one per rank and step. A compute piece is usually a *segment* of the captured joint
forward+backward graph (``tidal.ir.capture.capture_train_step``: aten ops, gradients as explicit
outputs), lowered and captured by :class:`CapturedProgram` (``tidal.runtime.lower``: a CUDA
graph on a GPU, a straight-line replay on the CPU; what cannot be captured runs uncaptured and
is named). :func:`data_parallel` builds the program of data-parallel training: the graph is cut
after the node that finishes each bucket's last gradient (buckets closed once they hold ``bucket_bytes``
or more, in reverse registration order, as DDP makes them), so the all-reduce of a bucket runs on the comm
stream while the compute stream goes on with the rest of backward. ``overlap=False`` puts every
all-reduce after the last segment (the baseline): the one data-parallel schedule of
``tidal.ir.program``, which the simulator builds from per-layer costs. ``split_pieces`` (pure,
``tidal.ir.program``) bounds segment durations.

:class:`ProgramRunner` runs a program alone, its pieces dispatched in program order straight
onto a backend (``tidal.runtime.scheduling.alone``; ``CpuBackend`` here: a FIFO worker thread
per stream, events between them): compute pieces on high-priority streams, comm and load pieces
on streams that do not occupy the device. Each piece's launch carries its start and end time,
so a run gives its trace (:func:`chrome_trace`: one row per stream). :class:`ProgramExecutor`
is the one executor every plan runs through (``Compiled.step``); :class:`ProgramJob` is a
training job to submit beside others to the scheduler (``tidal.runtime.scheduler.Runtime``).

Example:
    >>> import torch
    >>> from tidal.ir.capture import capture_train_step
    >>> from tidal.runtime import program
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    >>> step = capture_train_step(model, (x,), y, torch.nn.functional.cross_entropy)
    >>> p = program.data_parallel(step, world=2, bucket_bytes=100)   # two buckets
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

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from tidal.ir.capture import TrainStep, grad_nodes, step_inputs
from tidal.ir.comm_cost import DDP_BUCKET_BYTES
from tidal.ir.errors import TidalError
from tidal.ir.program import COMM, HOST, Piece, Program, data_parallel_program
# re-exported: the builders and the README name them here
from tidal.ir.program import COMPUTE, TRANSFER, split_pieces  # noqa: F401
from tidal.runtime.backend import Backend, CudaBackend, OnCaller, backend_for
from tidal.runtime.batch_data import BatchCheck
from tidal.runtime.bucket_sync import BucketSync, Completion
from tidal.runtime.distributed import group_size
from tidal.runtime.lower import lower
from tidal.runtime.programs.optimizer_wiring import set_grads
from tidal.runtime.programs.step_failures import collective_errors
from tidal.runtime.scheduler import BoundPiece
from tidal.runtime.scheduling.alone import Route, dispatch_alone, route
from tidal.runtime.scheduling.pieces import STREAMS, stream_kind  # noqa: F401
from tidal.runtime.scheduling.streams import StreamPool

def state_inputs(step: TrainStep) -> int:
    """How many of the captured step's flat inputs are parameters and buffers (they come
    first): what its captures read in place (:meth:`CapturedProgram.build`)."""
    return len(step.param_names) + len(step.buffer_names)


def device_of(*values: Any) -> torch.device:
    """The device of the first tensor in ``values`` (modules count by their parameters and
    buffers; nesting as ``torch.utils._pytree`` flattens); the CPU when there is none.

    Example:
        >>> device_of(torch.nn.Linear(2, 2), (torch.ones(1),))
        device(type='cpu')
    """
    for leaf in tree_leaves(values):
        tensors = ([*leaf.parameters(), *leaf.buffers()] if isinstance(leaf, torch.nn.Module)
                   else [leaf])
        for t in tensors:
            if isinstance(t, torch.Tensor):
                return t.device
    return torch.device("cpu")


def data_parallel(step: TrainStep, world: int, bucket_bytes: float = DDP_BUCKET_BYTES,
                  overlap: bool = True, sync: str = "all_reduce") -> Program:
    """The data-parallel program of a captured step (see the module docstring): the one
    data-parallel schedule (``tidal.ir.program.data_parallel_program``) over the joint
    graph's nodes, each gradient (backward issues them in reverse registration order, as DDP)
    ready at the node that computes it; a bucket's comm piece is named ``<sync> <b>``."""
    nodes = [n for n in step.gm.graph.nodes if n.op != "output"]
    pos = {n: i for i, n in enumerate(nodes)}
    _, grads = grad_nodes(step)
    last = len(nodes) - 1
    issued = [(i, _nbytes(grads[i]), pos.get(grads[i], last))
              for i in reversed(range(len(grads)))]
    return data_parallel_program([n.name for n in nodes], issued, world, bucket_bytes, overlap,
                                 sync)


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0


@dataclass(frozen=True)
class PieceTrace:
    """When a piece ran: stream, name and backend times in µs; ``ready_us``: when it could
    begin (its stream and the events it waited for had let it; None: not known), ``done_us``:
    when the asynchronous work it issued ended (a collective issued with ``async_op=True``,
    :class:`Completion`; None: it ended with the piece)."""

    name: str
    stream: str
    start_us: float
    end_us: float
    ready_us: Optional[float] = None
    done_us: Optional[float] = None


Work = Callable[[int, Piece], Callable[[], Any]]
"""What a program's pieces do in one step: ``work(index, piece)`` returns the function that
runs piece ``index`` (a builder's per-step binding of the program to tensors)."""


def program_pieces(program: Program, work: Work) -> list[BoundPiece]:
    """``program``'s pieces, each bound to what it does (``work(index, piece)``), as one
    iteration of a scheduler job (``tidal.runtime.scheduler``): the pieces themselves, so
    the scheduler sees their names, streams, kinds and dependencies.

    Example:
        >>> p = Program((Piece("segment 0", COMPUTE), Piece("all_reduce 0", COMM, (0,))))
        >>> [b.piece is q for b, q in zip(program_pieces(p, lambda i, q: print), p.pieces)]
        [True, True]
    """
    return [BoundPiece(p, work(i, p)) for i, p in enumerate(program.pieces)]


def runner_backend(device: Any = "cpu") -> Backend:
    """The backend a :class:`ProgramRunner` on ``device`` runs programs on: the device's own
    (``CudaBackend``: CUDA streams at the pieces' priorities, events between them); on the CPU
    a ``CpuBackend`` whose streams run freely (``slots=None``), each piece on its stream's
    worker thread.

    Example:
        >>> type(runner_backend("cpu")).__name__
        'CpuBackend'
    """
    dev = torch.device(device)
    return backend_for(dev, slots=None) if dev.type == "cpu" else backend_for(dev)


class ProgramRunner:
    """Runs programs on a CPU backend, one stream per stream name the program uses
    (:func:`stream_kind`), cross-stream dependencies through events.

    :meth:`launch` runs any program given what its pieces do; calling the runner runs a
    :func:`data_parallel` program of a captured step: ``runner(program, step, model, inputs,
    targets)`` returns ``(loss, {parameter name: averaged gradient}, [PieceTrace])``. The loss
    is averaged over the ranks (each rank passes its own shard). ``optimizer``, when given,
    takes its step in the program's ``optimizer`` piece on the averaged gradients. On several
    ranks the averaged gradients are views of each bucket's buffer, which the next call of the
    same program overwrites (DDP's ``gradient_as_bucket_view``)."""

    def __init__(self, backend: Optional[Backend] = None,
                 group: Optional[dist.ProcessGroup] = None, device: Any = "cpu"):
        self.backend = backend if backend is not None else runner_backend(device)
        self.group = group
        self.streams: dict = {}  # the foreground's streams, kept from step to step
        self._pool = StreamPool(self.backend, priorities=True, pool=self.streams)
        self._routes: dict[int, tuple[Program, Route]] = {}
        self._captures: dict[tuple[int, int], CapturedProgram] = {}
        self._states: dict[tuple[int, int], StepTensors] = {}
        self._grads: dict[int, tuple[TrainStep, tuple[fx.Node, list[fx.Node]]]] = {}
        self._buckets: dict = {}  # a bucket's flat buffer, reused step to step (as DDP's)

    def __enter__(self) -> "ProgramRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the backend's stream workers."""
        self.backend.close()
        self.streams.clear()

    def launch(self, program: Program, work: Work) -> list[PieceTrace]:
        """Run every piece of ``program`` (``work(index, piece)`` gives what it does) alone on
        this runner's backend, dispatched in program order
        (``tidal.runtime.scheduling.alone``): each piece on its stream (:func:`stream_kind`:
        compute high priority, communication and loads low), after the pieces it depends on
        (events across streams). Returns when all have ended, one :class:`PieceTrace` per
        piece. A piece that raises stops the program (no piece after it begins, none of its
        dependents runs) and makes this raise its error (a note names the piece), once nothing
        runs any more. Jobs that run beside others go through the scheduler
        (:class:`ProgramJob`)."""
        pieces = program.pieces
        if not pieces:
            raise ValueError("the program has no pieces")
        fns = []
        for i, p in enumerate(pieces):
            try:
                fns.append(work(i, p))
            except Exception as e:
                e.add_note(f"binding piece {p.name!r} of the program")
                raise
        launches = dispatch_alone(self.backend, self._pool, pieces, fns, self._route(program),
                                  inline_host=isinstance(self.backend, CudaBackend))
        failed = [(l.end_us, i) for i, l in enumerate(launches) if l.error is not None]
        if failed:
            index = min(failed)[1]
            error = launches[index].error
            error.add_note(f"in piece {pieces[index].name!r} of the program")
            raise error
        return [PieceTrace(p.name, p.stream, l.start_us, l.end_us, l.ready_us,
                           l.result.done_us if isinstance(l.result, Completion) else None)
                for p, l in zip(pieces, launches)]

    def _route(self, program: Program) -> Route:
        """The dispatch route of ``program`` (kept for the latest few programs)."""
        key = id(program)
        kept = self._routes.get(key)
        if kept is None or kept[0] is not program:
            if len(self._routes) >= 8:
                self._routes.pop(next(iter(self._routes)))
            kept = self._routes[key] = (program, route(program.pieces))
        return kept[1]

    def __call__(self, program: Program, step: TrainStep, model: torch.nn.Module,
                 inputs: Any, targets: Any, optimizer: Optional[torch.optim.Optimizer] = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[PieceTrace]]:
        state = self._state(model, step)
        params = state.params
        world = group_size(self.group)
        # the backward starts from 1 / world: a bucket's sum over the ranks is the average
        # (no pass over it after the all-reduce; DDP divides each bucket instead)
        flat = step_inputs(step, state, inputs, targets, None if world == 1 else 1 / world)
        run = self._captured(program, step, flat).run(flat)
        loss_node, grad_list = self._grad_nodes(step)
        sync = BucketSync(self.backend, self.group, self._buckets, flat)

        def all_reduce(indices: Sequence[int]) -> Optional[Completion]:
            return sync.issue((id(program), tuple(indices)),
                              indices, [run.value(grad_list[i]) for i in indices],
                              run.value(loss_node) if run.computed(loss_node) else None)

        def apply() -> None:
            averaged = sync.wait()
            named = {name: averaged[i] for i, name in enumerate(step.param_names)}
            # a replay reuses a CUDA graph's outputs: in one process they are copied
            set_grads(params, named, copy=world == 1 and any(g.is_cuda for g in named.values()))
            if optimizer is not None:
                optimizer.step()

        def work(index: int, piece: Piece) -> Callable[[], Any]:
            if piece.nodes:
                return run.segment(index)
            if piece.grads:
                return OnCaller(functools.partial(all_reduce, piece.grads))
            return apply

        trace = self.launch(program, work)
        loss = sync.loss(run.value(loss_node))
        averaged = sync.wait()
        grads = {name: averaged[i] for i, name in enumerate(step.param_names)}
        return loss, grads, trace

    def _state(self, model: torch.nn.Module, step: TrainStep) -> "StepTensors":
        """``model``'s tensors that ``step`` reads, found by name on the model's first step
        and kept while they are still the model's (:meth:`StepTensors.current`)."""
        key = (id(model), id(step))
        state = self._states.get(key)
        if state is None or state.model is not model or not state.current():
            state = self._states[key] = StepTensors.find(model, step)
        return state

    def _grad_nodes(self, step: TrainStep) -> tuple[fx.Node, list[fx.Node]]:
        """``grad_nodes(step)``, found once per step."""
        kept = self._grads.get(id(step))
        if kept is None or kept[0] is not step:
            kept = self._grads[id(step)] = (step, grad_nodes(step))
        return kept[1]

    def _captured(self, program: Program, step: TrainStep, flat: Sequence[Any]
                  ) -> "CapturedProgram":
        key = (id(program), id(step))
        if key not in self._captures:
            self._captures[key] = CapturedProgram.build(program, step.gm, flat, self.backend,
                                                        state=state_inputs(step))
        return self._captures[key]


@dataclass(frozen=True)
class StepTensors:
    """The parameters and buffers of ``model`` that a captured step reads, by name (what
    ``named_parameters``/``named_buffers`` give for the step's names, so it stands in for the
    model in ``tidal.ir.capture.step_inputs``), and how each is reached from the model:
    ``links`` (parent module, child name, child) and ``leaves`` (a module's parameter or
    buffer table, name, tensor). :meth:`current` checks them by identity, far cheaper than a
    walk of the model's modules; ``links=None``: not checkable (found again at every step).

    Example:
        >>> from tidal.ir.capture import capture_train_step
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3))
        >>> x, y = torch.randn(2, 4), torch.randint(0, 3, (2,))
        >>> step = capture_train_step(model, (x,), y, torch.nn.functional.cross_entropy)
        >>> state = StepTensors.find(model, step)
        >>> sorted(state.params), state.current()
        (['0.bias', '0.weight'], True)
        >>> model[0].bias = torch.nn.Parameter(torch.zeros(3))  # a new parameter object
        >>> state.current()
        False
    """

    model: torch.nn.Module
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    links: Optional[tuple[tuple[torch.nn.Module, str, torch.nn.Module], ...]]
    leaves: tuple[tuple[dict, str, torch.Tensor], ...] = ()

    @classmethod
    def find(cls, model: torch.nn.Module, step: TrainStep) -> "StepTensors":
        """The tensors of ``step``'s ``param_names`` and ``buffer_names`` in ``model``."""
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        params = {k: params[k] for k in step.param_names}
        buffers = {k: buffers[k] for k in step.buffer_names}
        links: dict[tuple[int, str], tuple] = {}
        leaves = []
        try:
            for table, named in (("_parameters", params), ("_buffers", buffers)):
                for name, tensor in named.items():
                    *path, attr = name.split(".")
                    owner = model
                    for part in path:
                        child = owner._modules[part]
                        links[(id(owner), part)] = (owner, part, child)
                        owner = child
                    if getattr(owner, table).get(attr) is not tensor:
                        raise KeyError(name)
                    leaves.append((getattr(owner, table), attr, tensor))
        except (KeyError, AttributeError):  # reached some other way: not checkable
            return cls(model, params, buffers, None)
        return cls(model, params, buffers, tuple(links.values()), tuple(leaves))

    def current(self) -> bool:
        """Whether every tensor is still reached from the model as when it was found (no
        module or tensor on the way replaced or removed)."""
        if self.links is None:
            return False
        return all(parent._modules.get(name) is child for parent, name, child in self.links) \
            and all(table.get(name) is tensor for table, name, tensor in self.leaves)

    def named_parameters(self) -> Any:
        """(name, parameter) of the step's parameters."""
        return self.params.items()

    def named_buffers(self) -> Any:
        """(name, buffer) of the step's buffers."""
        return self.buffers.items()


@dataclass(frozen=True)
class CapturedProgram:
    """A program's compute segments lowered and captured (``tidal.runtime.lower``): the joint
    graph cut after each segment's last node, each run of static nodes a captured step (CUDA:
    a CUDA graph; CPU: its straight-line replay), the rest run as they are and named in
    ``lowered.report``. ``steps[i]``: the lowered steps piece ``i`` runs, in order."""

    lowered: Any
    steps: Mapping[int, tuple[int, ...]]

    @classmethod
    def build(cls, program: Program, gm: fx.GraphModule, flat: Sequence[Any], backend: Any,
              state: int = 0) -> "CapturedProgram":
        """Lower ``gm`` (a joint graph whose placeholders take ``flat``) cut after the last
        node of each of ``program``'s segments, and capture it on ``flat`` (on copies: an
        uncaptured step that writes an input runs during capture). The first ``state`` inputs
        (the parameters and buffers of a :class:`~tidal.ir.capture.TrainStep`:
        :func:`state_inputs`) are read in place by every replay, never copied. The captures
        get a memory pool of their own."""
        cuts = [p.nodes[-1] for p in program.pieces if p.nodes]
        placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        lowered = lower(gm, list(flat), backend=backend, cuts=cuts,
                        in_place=placeholders[:state])
        owner = {name: k for k, info in enumerate(lowered.report.steps) for name in info.nodes}
        steps = {i: tuple(dict.fromkeys(owner[n] for n in p.nodes if n in owner))
                 for i, p in enumerate(program.pieces) if p.nodes}
        return cls(lowered, steps)

    def uncaptured(self) -> list[tuple[str, str]]:
        """(node, reason) of each step that runs uncaptured."""
        return [(info.nodes[0], info.reason) for info in self.lowered.report.steps
                if info.kind != "captured"]

    def run(self, flat: Sequence[Any]) -> "CapturedRun":
        """One run over the inputs ``flat`` (a fresh environment of values)."""
        return CapturedRun(self, self.lowered.pieces(*flat))


@dataclass(frozen=True)
class CapturedRun:
    """One run of a :class:`CapturedProgram`: ``segment(i)`` is the work of program piece
    ``i`` (its lowered steps, in order, without autograd: the joint graph computes gradients
    itself); ``value(node)`` reads a value once the piece that computes it ran."""

    captured: CapturedProgram
    pieces: Any  # tidal.runtime.lower.PieceRun

    def segment(self, index: int) -> Callable[[], None]:
        """The function that runs program piece ``index``."""
        return functools.partial(self._steps, self.captured.steps[index])

    def _steps(self, steps: Sequence[int]) -> None:
        with torch.no_grad():
            for k in steps:
                self.pieces.pieces[k].fn()

    def value(self, node: fx.Node) -> Any:
        """The value of ``node`` (see ``tidal.runtime.lower.PieceRun.value``)."""
        return self.pieces.value(node)

    def computed(self, node: fx.Node) -> bool:
        """Whether :meth:`value` of ``node`` is at hand."""
        return self.pieces.computed(node)


class StepWork(Protocol):
    """One step of a rank's program bound to tensors (what :meth:`RankProgram.bind` returns):
    the ``program`` to run, ``work(index, piece)`` (see :data:`Work`) and ``loss()``, the
    step's loss once every piece has run."""

    program: Program

    def work(self, index: int, piece: Piece) -> Callable[[], Any]: ...

    def loss(self) -> torch.Tensor: ...


class RankProgram(Protocol):
    """What a program builder returns (``tidal.runtime.programs.builders()``): this rank's side of
    a plan. ``bind`` prepares one training step (the program for these inputs, built once per
    shape, and what each piece does); ``forward`` runs inference."""

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any: ...

    def bind(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> StepWork: ...


class OpenRankProgram(RankProgram, Protocol):
    """A rank program that runs the open step (``Compiled.backward``, as DDP's): ``bind_backward``
    prepares forward, loss and backward of one (micro-)batch with no optimizer piece. With
    ``sync`` the gradient of ``scale * loss`` (plus what the program accumulated under
    ``no_sync``), averaged over the ranks as DDP averages, is *added* to each trainable
    parameter's ``.grad``; without, it is accumulated in the program, unsynchronized. It may
    define ``clip_grad_norm_(model, max_norm, norm_type)`` (the global norm over what the
    ranks hold, each parameter counted once; default: ``torch.nn.utils.clip_grad_norm_``, for
    programs whose ranks all hold the same synchronized gradients)."""

    def bind_backward(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple,
                      targets: Any, loss_fn: Callable, scale: Any, sync: bool) -> StepWork: ...


class OpenStepError(TidalError):
    """The open step (``Compiled.backward``, ``Compiled.clip_grad_norm_``) is not available
    for a plan's program (yet), or not with an option of its plan; the message names which
    and what to use instead."""


def plan_kind_of(rank_program: Any) -> str:
    """The plan kind whose builder made ``rank_program`` (its module's ``PLAN_KIND``), or its
    class name when the module declares none.

    Example:
        >>> from tidal.runtime.programs.graph import GraphProgram
        >>> plan_kind_of(GraphProgram())
        'GraphProgram'
    """
    module = sys.modules.get(type(rank_program).__module__)
    return getattr(module, "PLAN_KIND", type(rank_program).__name__)


class ProgramExecutor:
    """The one executor: runs the program a builder gives for each step on the runtime's
    streams (:class:`ProgramRunner`) and keeps its pieces (``last_program``, ``last_trace``;
    :func:`chrome_trace` writes them). :meth:`step` runs a whole step (the optimizer's
    included); :meth:`backward` and :meth:`clip_grad_norm_` are the open step, where the rank
    program offers it (:class:`OpenRankProgram`). What the executor does not define (a
    builder's statistics, ``state_dict``, ``use_grad_sync``) is the rank program's."""

    def __init__(self, rank_program: RankProgram, runner: Optional[ProgramRunner] = None):
        self.rank_program = rank_program
        self._runner = runner
        self.device: Optional[torch.device] = None  # where the latest step ran
        self.last_program: Optional[Program] = None
        self.last_trace: list[PieceTrace] = []
        self.calls = 0
        """How many steps (``step``/``backward`` calls, failed ones included) this executor
        was asked to run: the step number every rank's loss all-reduce checks agrees."""

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("rank_program")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def runner(self) -> ProgramRunner:
        """The runner, on the device's own backend (:func:`runner_backend`: CUDA streams on a
        GPU) of the latest step's model; its streams are made on first use. A step on another
        device than the runner's gets a new runner."""
        device = self.device or torch.device("cpu")
        if self._runner is not None and self._runner.backend.device != device:
            self._runner.close()
            self._runner = None
        if self._runner is None:
            self._runner = ProgramRunner(device=device)
        return self._runner

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """Inference, as the rank program runs it."""
        return self.rank_program.forward(gm, *args, **kwargs)

    def step(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer,
             batch_check: Optional[BatchCheck] = None) -> torch.Tensor:
        """One training step: bind the program to this step's tensors and run it.
        ``batch_check``: the ranks' global batches still to be compared (see :meth:`_number`)."""
        self.device = device_of(model, inputs)
        self.calls += 1
        bound = self.rank_program.bind(gm, model, inputs, targets, loss_fn, optimizer)
        self._number(bound, batch_check)
        self.last_program = bound.program
        self.last_trace = self.runner.launch(bound.program, bound.work)
        return bound.loss()

    def backward(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
                 loss_fn: Callable, *, scale: Any = None, sync: bool = True,
                 batch_check: Optional[BatchCheck] = None) -> torch.Tensor:
        """The open step (``Compiled.backward``): forward, ``loss_fn(outputs, targets)`` and
        backward of one (micro-)batch as the rank program binds them
        (:class:`OpenRankProgram`): with ``sync``, the gradient of ``scale * loss`` (plus what
        earlier calls with ``sync=False`` accumulated), averaged over the ranks, is added to
        each trainable parameter's ``.grad``; without, it is kept in the program. Returns the
        global batch's loss (unscaled, detached). Raises :class:`OpenStepError` naming the plan
        kind when the rank program has no open step.

        Example:
            >>> from tidal.runtime.programs.graph import GraphProgram
            >>> model = torch.nn.Linear(4, 2)
            >>> ex = ProgramExecutor(GraphProgram())
            >>> x, y = torch.randn(3, 4), torch.tensor([0, 1, 1])
            >>> loss = ex.backward(model, model, (x,), y, torch.nn.functional.cross_entropy,
            ...                    scale=0.5, sync=False)
            >>> model.weight.grad is None                     # kept in the program
            True
            >>> loss = ex.backward(model, model, (x,), y, torch.nn.functional.cross_entropy,
            ...                    scale=0.5)
            >>> model.weight.grad.shape, [p.name for p in ex.last_program.pieces]
            (torch.Size([2, 4]), ['forward', 'backward', 'grads'])
        """
        bind = getattr(self.rank_program, "bind_backward", None)
        if bind is None:
            raise OpenStepError(f"Compiled.backward (the open step) is not available under "
                                f"{plan_kind_of(self.rank_program)} yet: use Compiled.step")
        self.device = device_of(model, inputs)
        self.calls += 1
        bound = bind(gm, model, inputs, targets, loss_fn, scale, sync)
        self._number(bound, batch_check)
        self.last_program = bound.program
        self.last_trace = self.runner.launch(bound.program, bound.work)
        return bound.loss()

    def _number(self, bound: StepWork, check: Optional[BatchCheck] = None) -> None:
        """Give ``bound`` its step number, :attr:`calls`, and the runner's clock, where it
        takes them (``step_number``, ``clock``: see :class:`StepWork`). The step's global-batch
        ``check`` (``Compiled.step``/``backward`` under ``compile(batch="global")``): ``bound``
        carries it on its loss all-reduce where it takes a ``batch_check``; otherwise it is
        exchanged here, in a round of its own, before any piece runs."""
        self._carry(bound, check)
        if hasattr(bound, "step_number"):
            bound.step_number = self.calls
        if hasattr(bound, "clock"):
            bound.clock = self.runner.backend.now_us

    def _carry(self, bound: StepWork, check: Optional[BatchCheck]) -> None:
        """The step's global-batch ``check`` (None: nothing to check): on ``bound``'s loss
        all-reduce where it takes a ``batch_check``; otherwise exchanged here, in a round of
        its own, before any piece runs."""
        if check is not None and hasattr(bound, "batch_check"):
            bound.batch_check = check
        elif check is not None:
            with collective_errors(plan_kind_of(self.rank_program),
                                   "the exchange of the ranks' batches (check_batch)"):
                check.exchange()

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of ``model``'s parameters by their global norm over every rank
        (each parameter counted once); returns the norm before clipping. The rank program's
        ``clip_grad_norm_`` when it has one; else, for a program with an open step (every rank
        holds the same synchronized gradients), ``torch.nn.utils.clip_grad_norm_`` over the
        parameters. Raises :class:`OpenStepError` naming the plan kind otherwise.

        Example:
            >>> from tidal.runtime.programs.graph import GraphProgram
            >>> model = torch.nn.Linear(3, 1)                 # 4 gradients of 2.0: norm 4
            >>> for p in model.parameters():
            ...     p.grad = torch.full_like(p, 2.0)
            >>> ProgramExecutor(GraphProgram()).clip_grad_norm_(model, 1.0).item()
            4.0
        """
        own = getattr(self.rank_program, "clip_grad_norm_", None)
        if own is not None:
            return own(model, max_norm, norm_type)
        if getattr(self.rank_program, "bind_backward", None) is None:
            raise OpenStepError(f"Compiled.clip_grad_norm_ is not available under "
                                f"{plan_kind_of(self.rank_program)} yet: its ranks hold "
                                f"different parts of the gradients (use Compiled.step)")
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def job(self, name: str, gm: fx.GraphModule, model: torch.nn.Module,
            batches: Callable[[int], tuple[Any, Any]], loss_fn: Callable,
            optimizer: torch.optim.Optimizer, iterations: Optional[int] = None) -> "ProgramJob":
        """This rank's training as a job for :class:`~tidal.runtime.scheduler.Runtime` (see
        :class:`ProgramJob`). A rank program whose ``pipelined`` is true lets its steps
        overlap: step ``i + 1`` is bound as soon as step ``i``'s pieces are queued.
        ``batches(i)`` gives ``(inputs, targets)`` or ``(inputs, targets, check)``: the step's
        global-batch :class:`~tidal.runtime.batch_data.BatchCheck`, carried on its loss
        all-reduce where the program takes one (:meth:`_carry`)."""
        def pieces(index: int) -> tuple[list[BoundPiece], Callable[[], Any]]:
            inputs, targets, *check = batches(index)
            bound = self.rank_program.bind(gm, model, inputs, targets, loss_fn, optimizer)
            self._carry(bound, check[0] if check else None)
            return program_pieces(bound.program, bound.work), bound.loss

        return ProgramJob(name, pieces, iterations,
                          gated=not getattr(self.rank_program, "pipelined", False))

    def notes(self) -> list[str]:
        """For ``Compiled.report()``: one line per thing the latest step ran uncaptured
        (``uncaptured()`` of the rank program, when it has one: the node and why), then the
        rank program's own lines about its latest step (``step_notes()``, when it has one)."""
        uncaptured = getattr(self.rank_program, "uncaptured", None)
        step_notes = getattr(self.rank_program, "step_notes", None)
        lines = [f"runs uncaptured: {node} ({reason})" if node != "-" else
                 f"runs uncaptured: {reason}" for node, reason in
                 (uncaptured() if uncaptured is not None else [])]
        return lines + (step_notes() if step_notes is not None else [])

    def close(self) -> None:
        """Stop the runner's stream workers (a later step starts new ones)."""
        if self._runner is not None:
            self._runner.close()
            self._runner = None


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


@dataclass
class ProgramJob:
    """A training job for :class:`~tidal.runtime.scheduler.Runtime` (``Runtime.submit``):
    iteration ``i`` runs the program of one step on batch ``i``, then a host piece appends the
    step's loss to ``losses``. Submitted as the foreground or as a background job beside
    another, its pieces are dispatched on its own streams under the scheduler's priorities,
    pacing and slowdown feedback (``ProgramExecutor.job`` or ``Compiled.job`` make one).
    ``make(i)`` returns the iteration's bound pieces (``program_pieces``) and the function
    that gives its loss once they ran. ``gated=False``: see :meth:`ready`."""

    name: str
    make: Callable[[int], tuple[list[BoundPiece], Callable[[], Any]]]
    iterations: Optional[int] = None
    memory_bytes: int = 0
    losses: list = field(default_factory=list)
    gated: bool = True

    def ready(self, index: int) -> bool:
        """Step ``index`` is bound once step ``index - 1`` has ended (binding reads the state
        the previous step left, and may agree with the other ranks on a new shape's program:
        a collective that must not interleave with the previous step's); at once when not
        ``gated`` (pieces that read the state only when they run, in order on one stream)."""
        return not self.gated or len(self.losses) >= index

    def iteration(self, index: int) -> Optional[list[BoundPiece]]:
        """The pieces of iteration ``index`` (None past the last): the step's, then ``loss``,
        host work on the comm stream after all of them."""
        if self.iterations is not None and index >= self.iterations:
            return None
        pieces, loss = self.make(index)
        pieces = list(pieces)
        pieces.append(BoundPiece(Piece("loss", COMM, tuple(range(len(pieces))), kind=HOST),
                                 lambda: self.losses.append(loss())))
        return pieces

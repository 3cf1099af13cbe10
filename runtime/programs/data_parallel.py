"""Data parallelism as a program: each bucket's gradient sync is a comm piece (beside backward).

:class:`DataParallelProgram` is the rank program (``tidal.runtime.program.RankProgram``) of
data-parallel training, with or without gradient compression: every rank passes the same global
batch and takes its shard of dim 0 (:func:`local_shard`): split as ``torch.tensor_split``
splits, so the last, smaller batch of an epoch works; each rank's gradient and loss are weighted
by its rows before the averaging sync, so the synchronized gradient is that of the global
batch's mean loss (a rank with no rows joins every collective with zero gradients). Its
program for one step (built once per shape of the global batch, so the simulator can run the
same object) is the ``broadcast`` of rank 0's buffers (and, before the first step, parameters)
on the ``comm`` stream, then

* when the step captures (``tidal.ir.capture.capture_train_step``): the segments of the joint
  forward+backward graph cut where each bucket's last gradient is ready
  (``tidal.runtime.program.data_parallel``, the one data-parallel schedule of
  ``tidal.ir.program``; lowered and captured by ``tidal.runtime.programs.step_capture``), so
  the sync of a bucket runs on the ``comm`` stream while the ``compute`` stream goes on with
  the rest of backward (without compression; a compressor's syncs follow the end of
  backward, ``overlap``);
* else (data-dependent control flow, an op that cannot run captured): eager ``forward`` and
  ``backward`` pieces (autograd), and ``fallback_reason`` says why, naming the node at fault;

then one ``sync <b>`` comm piece per bucket (:meth:`tidal.runtime.comm.grad_sync.GradSync.bucket`:
the compressor's encode, the collective, decode with error feedback; a plain averaging
all-reduce when compression is off), the ``optimizer`` piece on the synchronized gradients and,
with Accordion, the ``accordion`` piece that ends a window every ``accordion_interval`` steps
and switches each tensor's compression level (seeing a learning-rate decay ahead through
``lr_lookahead`` or a torch scheduler given to :meth:`DataParallelProgram.watch_scheduler`,
else one window late).

Capturing a shape's step runs it once on copies (the random state kept), so a step that
cannot run falls back before any piece is launched; every rank agrees on the outcome.

The open step (``Compiled.backward``, :meth:`DataParallelProgram.bind_backward`) runs the same
segments and syncs (:func:`open_program`) with ``grads`` in place of the ``optimizer`` piece:
the synchronized gradient of ``scale * loss`` is *added* to each trainable parameter's
``.grad``, as DDP's backward adds it. Inside ``no_sync`` the syncs are left out and the last
piece, ``accumulate``, adds the gradient to the program's ``local_grads``; the next synchronized
call syncs (compresses) its own gradient plus that sum, once, as DDP's ``no_sync`` does.

Example:
    >>> import torch
    >>> from tidal.runtime.comm.compressors import make_compressor
    >>> from tidal.runtime.program import ProgramExecutor
    >>> from tidal.runtime.programs.data_parallel import DataParallelProgram
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
    ...                             torch.nn.Linear(16, 3))
    >>> ex = ProgramExecutor(DataParallelProgram(make_compressor("topk:0.5"), bucket_bytes=256))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    >>> loss = ex.step(model, model, (x,), y, torch.nn.functional.cross_entropy, opt)
    >>> [(p.name, p.stream) for p in ex.last_program.pieces]  # doctest: +NORMALIZE_WHITESPACE
    [('broadcast', 'comm'), ('segment 0', 'compute'), ('sync 0', 'comm'), ('sync 1', 'comm'),
     ('optimizer', 'compute')]
    >>> ex.fallback_reason, ex.compressor.residual("2.weight") is not None   # error feedback
    ('', True)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from tidal.ir.capture import step_inputs
from tidal.ir.comm_cost import DDP_BUCKET_BYTES, ddp_buckets
from tidal.ir.node_runner import flat_tensors
from tidal.ir.param_owners import trainable
from tidal.ir.program import COMM, COMPUTE, OPTIMIZER, Piece, Program
from tidal.runtime.backend import backend_for
from tidal.runtime.comm.accordion import Accordion, LrLookahead
from tidal.runtime.comm.compressors import Comm, Compressor, NoCompression
from tidal.runtime.comm.grad_sync import GradSync
from tidal.runtime.program import OpenStepError, data_parallel
from tidal.runtime.programs.batch_shards import LocalShard, local_shard
from tidal.runtime.programs.optimizer_wiring import (ACCUMULATE, GRADS, LocalGrads, add_grads,
                                                     set_grads)
from tidal.runtime.programs.replica_sync import broadcast_state, reduce_loss
from tidal.runtime.programs.data_parallel_steps import (ACCORDION, BROADCAST, SYNC,
                                                       CapturedStep, DataParallelStep,
                                                       EagerStep, OpenStep, open_program)
from tidal.runtime.programs.step_capture import (Fallback, StepCapture, agreed, capture_step,
                                                 lower_step, shape_key)


def trainable_buckets(buckets: Optional[Sequence[Sequence[str]]],
                      grads: Mapping[str, torch.Tensor], bucket_bytes: float
                      ) -> tuple[tuple[str, ...], ...]:
    """The buckets of the gradients ``grads`` (the trainable parameters now): the explicit
    ``buckets`` (a plan's, made at compile) without the names frozen since and with DDP's
    buckets of the names they lack (unfrozen since) after them; DDP's buckets alone when
    none are given. A compressor works per tensor: the grouping never changes the result.

    Example:
        >>> import torch
        >>> grads = {"b": torch.zeros(2), "c": torch.zeros(2)}
        >>> trainable_buckets((("a", "b"),), grads, 2**20)
        (('b',), ('c',))
    """
    known = {n for b in buckets or () for n in b}
    kept = tuple(t for t in (tuple(n for n in b if n in grads) for b in buckets or ()) if t)
    rest = [(n, g.numel() * 4) for n, g in grads.items() if n not in known]
    return kept + (tuple(ddp_buckets(rest, bucket_bytes)) if rest else ())


def eager_pieces(buckets: Sequence[Sequence[int]]) -> list[Piece]:
    """The data-parallel pieces of a step that runs with autograd: ``forward``, ``backward``,
    a ``sync b`` comm piece per bucket of gradient indices after it, the ``optimizer`` last."""
    pieces = [Piece("forward", COMPUTE), Piece("backward", COMPUTE, (0,))]
    pieces += [Piece(f"{SYNC} {b}", COMM, (1,), grads=tuple(bucket))
               for b, bucket in enumerate(buckets)]
    pieces.append(Piece("optimizer", COMPUTE, tuple(range(1, len(pieces))), kind=OPTIMIZER))
    return pieces


def framed(pieces: Sequence[Piece], world: int, accordion: bool) -> Program:
    """``pieces`` (the first waits for nothing, the last is the optimizer) after the
    ``broadcast`` of rank 0's state, then the ``accordion`` piece when asked for.

    Example:
        >>> [p.name for p in framed(eager_pieces([(0,)]), 2, True).pieces]
        ['broadcast', 'forward', 'backward', 'sync 0', 'optimizer', 'accordion']
    """
    out = [Piece(BROADCAST, COMM)]
    out += [replace(p, deps=tuple(d + 1 for d in p.deps) or (0,)) for p in pieces]
    if accordion:
        out.append(Piece(ACCORDION, COMPUTE, (len(out) - 1,)))
    return Program(tuple(out), world)


class DataParallelProgram:
    """Data-parallel training as a program (see the module docstring). ``compressor``: the
    gradient compressor (default: none, a plain averaging all-reduce); ``buckets``: explicit
    buckets of parameter names for the eager program (a plan's; default: DDP's, reverse order,
    ``bucket_bytes`` each); the captured program cuts DDP's buckets of the captured gradients
    under the same cap (the plan's, for float32 parameters: the grouping never changes a
    compressor's result, see :meth:`~tidal.runtime.comm.grad_sync.GradSync.bucket`).
    ``accordion``: an :class:`~tidal.runtime.comm.accordion.Accordion` deciding the levels every
    ``accordion_interval`` steps. ``capture=False`` runs the eager program. ``overlap``: a
    bucket's sync starts when its gradients are ready, beside the rest of backward (default:
    only without compression; compressed syncs wait for the end of backward as the
    dissertation's §4.2.1 does, since encoding competes with backward for the device and the
    performance model, ``tidal.ir.perf_model``, assumes it). ``state_dict``/
    ``load_state_dict`` checkpoint the compressor and the Accordion controller; run it with
    ``tidal.runtime.program.ProgramExecutor`` (``step``, or the open step: ``backward``)."""

    recaptures_autocast = True
    """A step in another autocast state is captured again (``step_capture.shape_key`` holds
    it); eager pieces run under the binding thread's autocast."""

    runtime_state_by_name = True
    """Its runtime state (the compressor's, per tensor name) carries over to a program built
    for another set of trainable parameters (``Compiled``'s re-capture after freezing)."""

    def __init__(self, compressor: Optional[Compressor] = None, *,
                 buckets: Optional[Sequence[Sequence[str]]] = None,
                 bucket_bytes: float = DDP_BUCKET_BYTES, accordion: Optional[Accordion] = None,
                 accordion_interval: int = 100, lr_lookahead: Optional[LrLookahead] = None,
                 group: Optional[dist.ProcessGroup] = None, capture: bool = True,
                 overlap: Optional[bool] = None):
        self.buckets = None if buckets is None else tuple(tuple(b) for b in buckets)
        self.bucket_bytes = bucket_bytes
        self.grad_sync = GradSync(compressor, bucket_bytes=bucket_bytes, buckets=self.buckets,
                                  group=group)
        self.accordion = accordion
        self.accordion_interval = accordion_interval
        compressed = not isinstance(self.grad_sync.compressor, NoCompression)
        self.overlap = not compressed if overlap is None else overlap
        self.lr_lookahead = lr_lookahead
        self.steps = 0
        self.fallback_reason = "" if capture else "capture=False: eager pieces were asked for"
        self._window_lr: Optional[float] = None
        self._programs: dict[tuple, StepCapture] = {}     # by the global batch's shapes
        self._by_shard: dict[tuple, StepCapture] = {}     # the captured ones, by shard shapes
        self._open_programs: dict[tuple, tuple[Program, tuple[int, ...]]] = {}
        self._latest: Optional[StepCapture] = None
        self.params_shared = False
        self.local_grads = LocalGrads()
        """What the open step accumulated inside ``no_sync`` on this rank, not yet synced."""

    def uncaptured(self) -> list[tuple[str, str]]:
        """(node, reason) of what the latest step ran uncaptured: nodes of the lowered joint
        graph, or ``("-", fallback_reason)`` when the step ran as the eager program."""
        if self._latest is None:
            return [("-", self.fallback_reason)] if self.fallback_reason else []
        return list(self._latest.uncaptured)

    @property
    def compressor(self) -> Compressor:
        """The gradient compressor (``NoCompression`` when compression is off)."""
        return self.grad_sync.compressor

    @property
    def comm(self) -> Comm:
        """The collectives' process group and the bytes sent so far."""
        return self.grad_sync.comm

    def watch_scheduler(self, scheduler: Any, steps_per_call: int = 1) -> None:
        """Let Accordion see learning-rate decays ahead in ``scheduler`` (a torch scheduler on
        ``Compiled.optimizer``, stepped once per ``steps_per_call`` steps); it is peeked,
        never advanced. Replaces the decays the plan recorded."""
        self.lr_lookahead = LrLookahead.from_scheduler(scheduler, steps_per_call)

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """Inference is not distributed: every rank runs the whole batch."""
        return gm(*args, **kwargs)

    def bind(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: Any, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> DataParallelStep:
        """This rank's step on its shard of the global batch (:func:`local_shard`: split as
        ``torch.tensor_split`` splits, the gradient and loss weighted by the rows): the
        program of these shapes (built on first use) and what its pieces do."""
        part = self._shard(inputs, targets)
        capture = self._capture(part, gm, model, loss_fn)
        step = CapturedStep if capture.captured else EagerStep
        return step(self, capture, model, optimizer, gm, part.inputs, part.targets, loss_fn,
                    weight=part.weight)

    def bind_backward(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: Any,
                      targets: Any, loss_fn: Callable, scale: Any, sync: bool) -> DataParallelStep:
        """The open step on this rank's shard (``Compiled.backward``; see the module
        docstring): the step's program of these shapes made open (:func:`open_program`).
        Raises ``OpenStepError`` with Accordion (it reads the optimizer's rate at the end of
        each window, inside ``Compiled.step``)."""
        if self.accordion is not None:
            raise OpenStepError("Compiled.backward (the open step) is not available with "
                                "Accordion (a compression plan with accordion=...): it "
                                "switches the compression level from the optimizer's learning "
                                "rate at the end of each window of Compiled.step; use "
                                "Compiled.step, or compile without accordion")
        part = self._shard(inputs, targets)
        capture = self._capture(part, gm, model, loss_fn)
        if (part.key, sync) not in self._open_programs:
            self._open_programs[part.key, sync] = open_program(capture.program, sync)
        opened = OpenStep(*self._open_programs[part.key, sync], scale, sync)
        step = CapturedStep if capture.captured else EagerStep
        return step(self, capture, model, None, gm, part.inputs, part.targets, loss_fn, opened,
                    weight=part.weight)

    def _shard(self, inputs: Any, targets: Any) -> LocalShard:
        """This rank's :class:`LocalShard` of the global batch."""
        world = self.comm.world
        return local_shard(inputs, targets, world.rank, world.size)

    def _capture(self, part: LocalShard, gm: fx.GraphModule, model: torch.nn.Module,
                 loss_fn: Callable) -> StepCapture:
        """The step of the global batch's shapes ``part.key`` (built on first use, every rank
        at once: a rank's shard shape may have been built for another global batch, and
        building agrees over the ranks); the latest one run."""
        if part.key not in self._programs:
            self._programs[part.key] = self._build(gm, model, part.inputs, part.targets,
                                                   loss_fn)
        self._latest = self._programs[part.key]
        return self._latest

    def _build(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: Any, targets: Any,
               loss_fn: Callable) -> StepCapture:
        """The captured step and its program, or the eager program when the step cannot be
        captured or run on some rank (``fallback_reason`` says why). Lowering the captured
        step runs it once on copies: a step that cannot run falls back here, before any piece
        is launched; every rank agrees on the outcome."""
        world = self.comm.world.size
        reason, capture = self.fallback_reason, None
        local_key = shape_key(inputs, targets)
        if not reason and local_key in self._by_shard:
            capture = self._by_shard[local_key]   # this shard shape, captured before
        elif not reason:
            try:
                step = capture_step(gm, inputs, targets, loss_fn)
                pieces = data_parallel(step, world, self.bucket_bytes, self.overlap, SYNC).pieces
                program = framed(pieces, world, self.accordion is not None)
                flat = step_inputs(step, gm, inputs, targets)
                capture = lower_step(step, program, {0: flat},
                                     backend_for(flat_tensors(flat)[0].device))
            except Fallback as e:
                reason = e.reason
        reason = agreed(reason, self.comm.group)
        if not reason:
            self._by_shard[local_key] = capture
            return capture
        self.fallback_reason = reason
        names = trainable(model)
        index = {n: i for i, n in enumerate(names)}
        buckets = [tuple(index[n] for n in bucket)
                   for bucket in trainable_buckets(self.buckets, names, self.bucket_bytes)]
        program = framed(eager_pieces(buckets), world, self.accordion is not None)
        return StepCapture.eager(program, Fallback(reason))

    def accordion_step(self, synced: Mapping[str, torch.Tensor],
                       optimizer: torch.optim.Optimizer) -> None:
        """Accumulate this step's synchronized gradients; at the end of a window, decide each
        tensor's level (on rank 0, broadcast) and apply it to the compressor."""
        self.accordion.accumulate(synced)
        if self.steps % self.accordion_interval == 0:
            lr = float(optimizer.param_groups[0]["lr"])
            ahead = None
            if self.lr_lookahead is not None:      # a decay within the next window
                ahead = self.lr_lookahead.now_and_next(self.steps, self.accordion_interval, lr)
            if ahead is None:                      # unknown schedule: a drop seen after it
                ahead = (self._window_lr, lr)
            self._window_lr = lr
            levels = self.accordion.decide(*ahead)
            self.accordion.apply(self.compressor, levels)

    def state_dict(self) -> dict[str, Any]:
        """Compressor, Accordion and step counter."""
        return {"steps": self.steps, "window_lr": self._window_lr,
                "compressor": self.compressor.state_dict(),
                "accordion": self.accordion.state_dict() if self.accordion else None}

    def runtime_state(self, gm: fx.GraphModule) -> dict[str, Any]:
        """For ``Compiled.runtime_state_dict``: :meth:`state_dict` (this rank's compressor
        residuals and warm-start state, Accordion, the step counter)."""
        return self.state_dict()

    def load_runtime_state(self, gm: fx.GraphModule, optimizer: Any,
                           state: Mapping[str, Any]) -> None:
        """For ``Compiled.load_runtime_state_dict``: :meth:`load_state_dict`."""
        if state:
            self.load_state_dict(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.steps = state["steps"]
        self._window_lr = state["window_lr"]
        self.compressor.load_state_dict(state["compressor"])
        if self.accordion is not None and state["accordion"] is not None:
            self.accordion.load_state_dict(state["accordion"])

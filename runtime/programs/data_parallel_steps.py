"""The bound steps of data parallelism (``tidal.runtime.programs.data_parallel``): what each
piece of a rank's step does, for the closed step (``Compiled.step``: sync, optimizer, Accordion)
and the open one (``Compiled.backward``: :func:`open_program`, the synchronized gradients added
to ``.grad``, or accumulated locally under ``no_sync``). :class:`CapturedStep` runs the captured
segments, :class:`EagerStep` the graph with autograd. Either computes the gradients of
``seed * loss``, the seed being the open step's ``scale`` times the shard's row ``weight``:
the captured step takes it as its backward's seed (``tidal.ir.capture.loss_seed``), the eager
one multiplies the loss by it before backward; as eager ``scaler.scale(loss).backward()``,
fp16 intermediate gradients are scaled before they can underflow, never after. The eager
``forward`` and ``backward`` run under the autocast state of the thread that bound the step,
on whichever thread runs them; every other piece (captured segments, whose casts are in their
graph; syncs; the optimizer) with autocast off (``tidal.runtime.programs.piece_autocast``).

Example:
    >>> from tidal.runtime.programs.data_parallel import eager_pieces, framed
    >>> step = framed(eager_pieces([(0,)]), 2, False)
    >>> [p.name for p in open_program(step, sync=True)[0].pieces]
    ['broadcast', 'forward', 'backward', 'sync 0', 'grads']
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from tidal.ir.capture import loss_seed, step_inputs
from tidal.ir.param_owners import trainable
from tidal.ir.program import COMM, COMPUTE, OPTIMIZER, Piece, Program, without
from tidal.ir.step_state import autocast_state
from tidal.runtime.programs.optimizer_wiring import (ACCUMULATE, GRADS, LocalGrads, add_grads,
                                                     scaled, set_grads)
from tidal.runtime.programs.piece_autocast import NO_AUTOCAST, AutocastState, under_autocast
from tidal.runtime.backend import OnCaller
from tidal.runtime.batch_data import BatchCheck
from tidal.runtime.bucket_sync import Completion
from tidal.runtime.comm.compressors import NoCompression
from tidal.runtime.programs.replica_sync import broadcast_state, reduce_loss_async
from tidal.runtime.programs.step_capture import StepCapture
from tidal.runtime.programs.step_failures import FailFast, collective_errors

BROADCAST, ACCORDION, SYNC = "broadcast", "accordion", "sync"


def open_program(program: Program, sync: bool) -> tuple[Program, tuple[int, ...]]:
    """The open step's program made from a step's ``program`` (:func:`framed`): the same
    pieces with ``grads`` (the synchronized gradients added to ``.grad``) in place of the
    ``optimizer`` piece and no ``accordion`` piece; with ``sync`` False, no sync pieces either
    and ``accumulate`` last. Returns it and, per piece, its index in ``program``.

    Example:
        >>> from tidal.runtime.programs.data_parallel import eager_pieces, framed
        >>> step = framed(eager_pieces([(0,), (1,)]), 2, False)
        >>> p, origin = open_program(step, sync=False)
        >>> [(q.name, q.deps) for q in p.pieces], origin  # doctest: +NORMALIZE_WHITESPACE
        ([('broadcast', ()), ('forward', (0,)), ('backward', (1,)), ('accumulate', (2,))],
         (0, 1, 2, 5))
        >>> [q.name for q in open_program(step, sync=True)[0].pieces][-3:]
        ['sync 0', 'sync 1', 'grads']
    """
    drop = {i for i, p in enumerate(program.pieces)
            if p.name == ACCORDION or (not sync and p.stream == COMM and p.name != BROADCAST)}
    return without(program, drop, lambda p: Piece(GRADS if sync else ACCUMULATE, COMPUTE)
                   if p.kind == OPTIMIZER else p)


@dataclass(frozen=True)
class OpenStep:
    """How a bound step is open (``Compiled.backward``): its ``program`` (:func:`open_program`),
    each piece's index in the step's program (``origin``), the loss's ``scale`` and ``sync``."""

    program: Program
    origin: tuple[int, ...]
    scale: Any
    sync: bool


class DataParallelStep:
    """One bound step (``tidal.runtime.program.StepWork``): the broadcast, sync, optimizer and
    Accordion pieces, or with ``opened`` (:class:`OpenStep`) its program's ``grads`` or
    ``accumulate`` piece; subclasses run the compute pieces and give the gradients and the
    loss. ``weight`` (``LocalShard.weight``, None for 1) multiplies this rank's loss before
    backward (so its gradients, before they are synced or kept under ``no_sync``: before a
    compressor, whose error feedback stays per rank) and before the loss is averaged: the
    ranks' shards may differ in rows. The open step's ``scale`` multiplies the loss before
    backward too (:attr:`seed`). Once a piece failed, the later ones fail at once and a failed
    collective is a ``PeerFailureError`` naming the pass (``compression`` or
    ``data_parallel``) and the piece (``step_failures.FailFast``)."""

    step_number: Optional[int] = None
    """This step's number (``ProgramExecutor.calls``): the loss all-reduce checks that every
    rank is on it (None: not checked)."""

    batch_check: Optional[BatchCheck] = None
    """The step's global-batch check (given by the executor, ``compile(batch="global")``):
    it rides on the loss all-reduce, which :meth:`_agree` waits for before anything changes,
    so ranks given different batches raise ``BatchError`` before any of them updates."""

    clock: Optional[Callable[[], float]] = None
    """The runner's clock (``Backend.now_us``, given by the executor): a sync piece then
    returns the :class:`~tidal.runtime.bucket_sync.Completion` of its bucket, so the trace
    says when the bucket's sync ended."""

    def __init__(self, owner: Any, capture: StepCapture,
                 model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 module: torch.nn.Module, names: Sequence[str],
                 opened: Optional[OpenStep] = None, weight: Optional[float] = None):
        self.program = capture.program if opened is None else opened.program
        self._opened = opened
        self._owner = owner
        self._model = model
        self._params = trainable(module)
        self._optimizer = optimizer
        self._names = tuple(names)
        self._weight = weight
        self._first = owner.steps == 0 and not owner.params_shared
        self._synced: dict[str, torch.Tensor] = {}
        self._pending: list[tuple[Callable[[], dict[str, torch.Tensor]],
                                  Optional[Completion]]] = []
        self._loss_sum: Optional[Callable[[], torch.Tensor]] = None
        self._reduced: Optional[torch.Tensor] = None   # the reduced loss, once waited for
        self.autocast: AutocastState = NO_AUTOCAST
        """The autocast state the compute pieces run under (off; an eager step's: the
        binding thread's)."""
        compressor = getattr(getattr(owner, "grad_sync", None), "compressor", None)
        self.guard = FailFast("data_parallel" if compressor is None or
                              isinstance(compressor, NoCompression) else "compression")

    def work(self, index: int, piece: Piece) -> Callable[[], Any]:
        framing = self._framing(piece)
        if isinstance(framing, OnCaller):   # on the dispatching thread (see _framing)
            return OnCaller(self.guard.wrap(piece.name, under_autocast(NO_AUTOCAST, framing)))
        if framing is not None:
            return self.guard.wrap(piece.name, under_autocast(NO_AUTOCAST, framing))
        return self.guard.wrap(piece.name, under_autocast(self.autocast, self.compute(
            index if self._opened is None else self._opened.origin[index], piece)))

    def _framing(self, piece: Piece) -> Optional[Callable[[], Any]]:
        """What a piece other than a compute piece does (None for a compute piece). The
        broadcast (the forward waits for it) and the syncs (they only issue their collectives)
        run on the dispatching thread (``OnCaller``)."""
        if piece.name == BROADCAST:
            return OnCaller(self._broadcast)
        if piece.stream == COMM:
            return OnCaller(functools.partial(self._sync, piece.grads))
        if piece.kind == OPTIMIZER:
            return self._apply
        if piece.name == ACCORDION:
            return functools.partial(self._owner.accordion_step, self._synced, self._optimizer)
        if self._opened is not None and piece.name in (GRADS, ACCUMULATE):
            return self._add if piece.name == GRADS else self._accumulate
        return None

    def compute(self, index: int, piece: Piece) -> Callable[[], Any]:
        raise NotImplementedError

    @property
    def seed(self) -> torch.Tensor:
        """What the loss is multiplied by before backward: the open step's ``scale`` (None,
        a number or a ``GradScaler``'s scale tensor) times the row ``weight``, a 0-dim float32
        tensor (``tidal.ir.capture.loss_seed``)."""
        return loss_seed(None if self._opened is None else self._opened.scale,
                         weight=self._weight)

    def grad(self, index: int) -> torch.Tensor:
        """Gradient ``index`` of ``seed * loss``, as this rank hands it to the sync (or keeps
        it under ``no_sync``)."""
        raise NotImplementedError

    def local_loss(self) -> torch.Tensor:
        raise NotImplementedError

    def loss_known(self) -> bool:
        """Whether :meth:`local_loss` is at hand (the pieces that compute it ran)."""
        return True

    def _broadcast(self) -> None:
        broadcast_state(self._model, self._first, self._owner.comm.group)
        self._owner.params_shared = True

    def _sync(self, indices: Sequence[int]) -> Optional[Completion]:
        """Issue the sync of one bucket (the ``optimizer`` or ``grads`` piece waits for it):
        in the open step, of this call's gradients plus what ``no_sync`` calls accumulated."""
        if self._loss_sum is None and self.loss_known():   # its all-reduce goes first
            self._loss_sum = self._reduce_loss()
        if self._opened is None:
            grads = {self._names[i]: self.grad(i) for i in indices}
        else:
            local = self._owner.local_grads
            grads = {self._names[i]: local.plus(self._params[self._names[i]], self.grad(i))
                     for i in indices}
        pending = self._owner.grad_sync.bucket_async(grads)
        done = None if self.clock is None else Completion(self.clock, pending.future)
        self._pending.append((pending, done))
        return done

    def _wait(self) -> None:
        """Wait for every bucket's sync; their results in ``_synced``."""
        for bucket, (result, done) in enumerate(self._pending):
            try:
                self._synced.update(result())
            except Exception as e:
                e.add_note(f"in the gradient sync of bucket {bucket} (piece 'sync {bucket}')")
                raise
            if done is not None:
                done.waited()
        self._pending.clear()

    def _agree(self) -> None:
        """Before the step changes anything: the loss all-reduce the first sync issued waited
        for, so ranks on different steps raise ``StepMismatchError`` before any of them
        updates (:meth:`loss` then gives its result)."""
        if self._loss_sum is not None and self._reduced is None:
            self._reduced = self.loss()

    def _apply(self) -> None:
        self._wait()
        self._agree()
        set_grads(self._params, self._synced)
        self._optimizer.step()
        self._owner.steps += 1

    def _add(self) -> None:
        """The open step's ``grads`` piece: the synchronized gradients added to ``.grad``."""
        self._wait()
        self._agree()
        add_grads(self._params, self._synced)
        left = self._owner.local_grads.drain()
        if left:
            raise ValueError(f"data parallel: gradients of {[n for n, _, _ in left][:3]} were "
                             f"accumulated inside no_sync() but this synchronized "
                             f"Compiled.backward does not train them (frozen in between?): "
                             f"keep requires_grad the same over an accumulation")

    def _accumulate(self) -> None:
        """The open step's ``accumulate`` piece (inside ``no_sync``): gradients kept here."""
        local = self._owner.local_grads
        for i, name in enumerate(self._names):
            local.add(name, self._params[name], self.grad(i))

    def loss(self) -> torch.Tensor:
        """The global batch's loss: the mean of the ranks' shard losses (weighted: each
        shard's counts by its rows); with :attr:`step_number`, checked to be every rank's
        step (``StepMismatchError``)."""
        if self._reduced is not None:
            return self._reduced
        with collective_errors(self.guard.who, "the loss all-reduce"):
            pending, self._loss_sum = self._loss_sum or self._reduce_loss(), None
            return pending()

    def _reduce_loss(self) -> Callable[[], torch.Tensor]:
        """The loss all-reduce issued (:func:`~tidal.runtime.programs.replica_sync.
        reduce_loss_async`): the first sync piece issues it before its bucket (every rank in
        the same order, before any later round of a compressor), :meth:`loss` waits for it."""
        return reduce_loss_async(scaled(self.local_loss().detach(), self._weight),
                                 self._owner.comm.group, step=self.step_number,
                                 who=self.guard.who, batch=self.batch_check)


class CapturedStep(DataParallelStep):
    """The captured step's segments (lowered, captured); gradients are its outputs."""

    def __init__(self, owner: Any, capture: StepCapture,
                 model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 gm: torch.nn.Module, inputs: Any, targets: Any, loss_fn: Callable,
                 opened: Optional[OpenStep] = None, weight: Optional[float] = None):
        super().__init__(owner, capture, model, optimizer, gm, capture.step.param_names,
                         opened, weight)
        self._run = capture.lowered[0].run(step_inputs(capture.step, gm, inputs, targets,
                                                       self.seed))
        self._loss_node, self._grad_nodes = capture.nodes()

    def compute(self, index: int, piece: Piece) -> Callable[[], Any]:
        return self._run.segment(index)

    def grad(self, index: int) -> torch.Tensor:
        return self._run.value(self._grad_nodes[index])

    def local_loss(self) -> torch.Tensor:
        return self._run.value(self._loss_node)

    def loss_known(self) -> bool:
        return self._run.computed(self._loss_node)


class EagerStep(DataParallelStep):
    """Eager ``forward`` and ``backward`` pieces, backward on ``seed * loss`` (autograd fills
    the parameters' ``.grad``; in the open step, the gradients are kept here instead)."""

    def __init__(self, owner: Any, capture: StepCapture,
                 model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 gm: torch.nn.Module, inputs: Any, targets: Any, loss_fn: Callable,
                 opened: Optional[OpenStep] = None, weight: Optional[float] = None):
        super().__init__(owner, capture, model, optimizer, model, tuple(trainable(model)),
                         opened, weight)
        self._run = functools.partial(eager_loss, gm, inputs, targets, loss_fn)
        self.autocast = autocast_state()  # the binding thread's
        self._loss: Optional[torch.Tensor] = None
        self._grads: tuple[Optional[torch.Tensor], ...] = ()

    def compute(self, index: int, piece: Piece) -> Callable[[], Any]:
        return self._forward if piece.name == "forward" else self._backward

    def _forward(self) -> None:
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=True)
        self._loss = self._run()

    def _backward(self) -> None:
        scale = None if self._opened is None else self._opened.scale
        loss = self._loss
        if scale is not None or self._weight is not None:
            loss = loss * self.seed.to(loss.device)
        if self._opened is None:
            loss.backward()
        elif self._names:
            self._grads = torch.autograd.grad(loss, [self._params[n] for n in self._names],
                                              allow_unused=True)

    def grad(self, index: int) -> torch.Tensor:
        p = self._params[self._names[index]]
        g = p.grad if self._opened is None else self._grads[index]
        return g if g is not None else torch.zeros_like(p)

    def local_loss(self) -> torch.Tensor:
        return self._loss


def eager_loss(gm: torch.nn.Module, inputs: Any, targets: Any, loss_fn: Callable
                ) -> torch.Tensor:
    out = gm(**inputs) if isinstance(inputs, Mapping) else gm(*inputs)
    return loss_fn(out, targets)

"""A job inside a worker process: its program built ahead of time, its weights transmitted into
the arena group by group while the first groups already compute, its state saved on preemption.

:class:`Task` is built when the worker starts (task initialization, off the switch's path):
the job's graph (weightless until transmitted), its pipelined programs from
:mod:`tidal.ir.layer_group_program` (per group a ``load group k`` piece on the ``load``
stream and a ``group k`` piece that waits for it: group ``k+1`` transfers while group ``k``
computes), its optimizer and a :class:`~tidal.runtime.program.ProgramRunner` on the task's
device (on a GPU its CUDA backend: each piece on its stream). :meth:`Task.warm_up` runs one
forward on the host copy's weights and the first batch, both moved to the device, so no
first-call cost is left for a switch.
:meth:`Task.activate` carves the destination of every group from the worker's
:class:`~tidal.runtime.switching.stack.ArenaStack` (pointer bumps, no allocator call) and
restores the optimizer state onto the device; the first :meth:`Task.step` after it runs the
loading program (:class:`Transmission` copies group ``k`` from the shared host copy into its
slice, on a GPU asynchronously on the loading piece's stream), the later ones the resident
program; each iteration's batch is carved from the arena, which puts it on the device.
:meth:`Task.clean` (a training job's task cleaning) copies the weights back to the host copy and
returns the optimizer state in host memory (it crosses to the controller), so the job resumes
elsewhere bit for bit.

Example (in one process; :class:`~tidal.runtime.switching.switcher.Switcher` runs tasks in
worker processes):
    >>> import torch, tidal
    >>> from tidal.passes.layer_groups import LayerGroups
    >>> from tidal.runtime.switching.host_model import HostModel
    >>> from tidal.runtime.switching.job import Repeat, SwitchJob, weightless
    >>> from tidal.runtime.switching.stack import ArenaStack
    >>> from tidal.runtime.switching.task import Task
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> x = torch.randn(3, 4)
    >>> c = tidal.compile(m, (x,), passes=[LayerGroups(grouping="per_layer")])
    >>> host = HostModel.of(c.graph_module)
    >>> task = Task(SwitchJob("mlp", weightless(c.graph_module), Repeat(x)))
    >>> stack = ArenaStack(torch.empty(4096, dtype=torch.uint8))
    >>> task.activate(host, stack)
    >>> first = task.step(0, stack)
    >>> torch.equal(first.value, m(x)), len(first.timeline.transfer), stack.spills
    (True, 3, 0)
    >>> task.close()
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_leaves, tree_map

from tidal.ir.joint_segments import cut_at_markers
from tidal.ir.layer_group_program import pipelined
from tidal.ir.param_owners import trainable
from tidal.runtime.program import ProgramRunner, Work
from tidal.runtime.programs.layer_group_loads import LoadTimeline
from tidal.runtime.programs.layer_group_steps import (InterpretedSegments, bind_training,
                                                      graph_interpreter)
from tidal.runtime.switching.device import resolve_device, to_device, to_host
from tidal.runtime.switching.errors import SwitchingError
from tidal.runtime.switching.host_model import HostModel
from tidal.runtime.switching.job import SwitchJob
from tidal.runtime.switching.stack import ArenaStack


class Transmission:
    """One activation's weight loads, the ``loads`` of a pipelined program: ``load(k)`` copies
    group ``k`` from the host copy into ``dsts[k]``, ``ready(k)`` raises if that did not happen.
    On a GPU (``device``) the copy runs asynchronously on the loading piece's own stream (the
    one current when the piece runs: the piece's device times, the ``transfer`` of its
    :class:`LoadTimeline`, are the copy's; on a side stream of its own they measured nothing),
    and ``ready(k)`` makes the computing piece's stream wait for it; ``dsts[k]`` is recorded on
    both streams (``record_stream``), so memory the allocator gave (a spill) is not reused
    while either still reads it."""

    def __init__(self, host: HostModel, gm: torch.fx.GraphModule, dsts: list[torch.Tensor],
                 device: Any = "cpu"):
        self.host, self.gm, self.dsts = host, gm, dsts
        self.device = torch.device(device)
        self.done = [False] * host.num_groups
        self.events: list[Any] = [None] * host.num_groups

    def load(self, k: int) -> None:
        dst = self.dsts[k]
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            self.host.transmit(k, self.gm, dst, non_blocking=True)
            dst.record_stream(stream)
            self.events[k] = torch.cuda.Event()
            self.events[k].record(stream)
        else:
            self.host.transmit(k, self.gm, dst)
        self.done[k] = True

    def ready(self, k: int) -> None:
        if not self.done[k]:
            raise RuntimeError(f"group {k} cannot run: its weights were not transmitted (see "
                               f"the piece 'load group {k}')")
        if self.events[k] is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.events[k])
            self.dsts[k].record_stream(stream)


class Preempted(Exception):
    """Raised by a piece asked to start after a preemption request (see :meth:`Task.step`)."""


def _before(work: Work, first: Callable[[Any], None]) -> Work:
    """``work`` whose pieces each call ``first(piece)`` before they run."""
    def piece(index: int, p: Any) -> Callable[[], Any]:
        run = work(index, p)

        def checked() -> Any:
            first(p)
            return run()
        return checked
    return piece


def _stoppable(work: Work, preempted: Callable[[], bool]) -> Work:
    """``work`` whose pieces first ask ``preempted`` and raise :class:`Preempted` if so."""
    def check(p: Any) -> None:
        if preempted():
            raise Preempted(f"preempted before piece {p.name!r}")
    return _before(work, check)


def _after_inputs(work: Work, device: torch.device, inputs: Any) -> Work:  # pragma: no cover
    """On a GPU: ``work`` whose pieces' streams first wait for what this thread's stream queued
    so far (the copies of the iteration's inputs into the arena, the copies of the buffers a
    rollback would restore) and record the input tensors as used there (``record_stream``: a
    spilled input is not reused while a piece reads it)."""
    queued = torch.cuda.Event()
    queued.record(torch.cuda.current_stream(device))
    tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]

    def wait(p: Any) -> None:
        stream = torch.cuda.current_stream(device)
        stream.wait_event(queued)
        for t in tensors:
            t.record_stream(stream)
    return _before(work, wait)


@dataclass(frozen=True)
class StepResult:
    """One iteration: its ``value`` (inference: the output, detached; training: the loss as a
    float), its ``timeline`` (the iteration that transmitted the weights) and ``seconds``."""

    iteration: int
    value: Any
    timeline: Optional[LoadTimeline]
    seconds: float


class Task:
    """A job bound in a worker (see the module docstring); ``job.graph`` is this task's own
    (a weightless copy: :func:`~tidal.runtime.switching.job.weightless`); ``device`` is where
    its arena lies (a bare ``"cuda"``: the current CUDA device). Until activated, its weights
    are empty tensors on ``device``, so a restored optimizer state lands there too."""

    def __init__(self, job: SwitchJob, device: Any = "cpu"):
        self.job = job
        self.device = resolve_device(device)
        self.gm = job.graph
        segments = cut_at_markers(self.gm.graph.nodes)
        tail = [("backward", ()), ("optimizer", ())] if job.training else []
        self._loading = pipelined(segments, tail)
        self._resident = pipelined(segments, tail, loads=False)
        self.optimizer = (job.optimizer(list(trainable(self.gm).values()))
                          if job.training else None)
        self.runner = ProgramRunner(device=self.device)
        self.loads: Optional[Transmission] = None
        self._empty = {name: torch.empty(0, dtype=t.dtype, device=self.device)
                       for name, t in self._tensors()}
        self._preempted: Optional[Callable[[], bool]] = None
        self.release()
        if job.training:  # preemption points inside the backward: each parameter's gradient
            for p in trainable(self.gm).values():
                p.register_post_accumulate_grad_hook(self._check_backward)

    def _check_backward(self, param: torch.Tensor) -> None:
        """A parameter's gradient is complete: stop here if a preemption was asked during this
        iteration (the backward is the longest piece of a training step)."""
        if self._preempted is not None and self._preempted():
            raise Preempted("preempted inside the backward")

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.gm.named_parameters()) + list(self.gm.named_buffers())

    def warm_up(self, host: HostModel) -> None:
        """One forward (eval mode, no autograd) with ``host``'s weights and the first batch on
        the task's device: the first-call costs of the process (kernel selection, lazy
        initialisation) are paid here, not in a switch."""
        views = host.tensors()
        modes = {m: m.training for m in self.gm.modules()}
        try:
            for name, t in self._tensors():
                t.data = views[name].to(self.device)
            self.gm.eval()
            with torch.no_grad():
                self.gm(*to_device(self._inputs(0), self.device))
        finally:
            for m, mode in modes.items():
                m.training = mode
            self.release()

    def _inputs(self, i: int) -> tuple:
        batch = self.job.batches(i)
        inputs = batch[0] if self.job.training else batch
        return inputs if isinstance(inputs, tuple) else (inputs,)

    def activate(self, host: HostModel, stack: ArenaStack,
                 optimizer_state: Optional[dict] = None) -> None:
        """Carve each group's destination from ``stack`` (on this task's device) and restore the
        optimizer state (``load_state_dict`` casts it to the parameters' device: this task's);
        the next :meth:`step` transmits the weights."""
        if stack.region.device != self.device:
            raise SwitchingError(f"job {self.job.name!r}: its arena region is on "
                                 f"{stack.region.device}, its task on {self.device}")
        dsts = [stack.take_bytes(host.group_nbytes(k)) for k in range(host.num_groups)]
        self.loads = Transmission(host, self.gm, dsts, self.device)
        if self.optimizer is not None and optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)

    def step(self, i: int, stack: ArenaStack,
             preempted: Optional[Callable[[], bool]] = None) -> Optional[StepResult]:
        """Run iteration ``i``: its batch copied into tensors carved from ``stack`` (so on the
        task's device; freed after it), the weights transmitted by the first iteration after
        :meth:`activate`. With ``preempted``, every piece asks it before starting, and a
        training job's backward asks it again as each parameter's gradient completes: once it
        says True the iteration stops there (after the pieces already running) and is rolled
        back (buffers such as BatchNorm statistics restored, gradients dropped; the weights and
        optimizer state change only in the last piece, the optimizer step, so they are those of
        iteration ``i - 1``) and ``step`` returns None: iteration ``i`` runs again when the job
        resumes."""
        if self.loads is None:
            raise RuntimeError(f"job {self.job.name!r} is not active: activate it first")
        start = time.perf_counter()
        batch = self.job.batches(i)
        top = stack.mark()
        carved = tree_map(lambda t: stack.like(t) if isinstance(t, torch.Tensor) else t, batch)
        loading = not all(self.loads.done)
        run = self._loading if loading else self._resident
        loads = self.loads if loading else None
        if self.job.training:
            inputs, targets = carved
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
            bound = bind_training(run, self.gm, inputs, targets, self.job.loss_fn,
                                self.optimizer, loads)
        else:
            inputs = carved if isinstance(carved, tuple) else (carved,)
            bound = InterpretedSegments(run, graph_interpreter(self.gm, *inputs), loads)
        saved = None if preempted is None or loading else self._buffers()
        work = bound.work
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            work = _after_inputs(work, self.device, carved)  # after the copies above
        work = work if preempted is None else _stoppable(work, preempted)
        self._preempted = preempted
        try:
            trace = self.runner.launch(bound.program, work)
        except Preempted:
            self._roll_back(saved)
            stack.pop(top)
            return None
        finally:
            self._preempted = None
        value = bound.loss().item() if self.job.training else tree_map(
            lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, bound.output())
        stack.pop(top)
        timeline = LoadTimeline.of(run, trace) if loading else None
        return StepResult(i, value, timeline, time.perf_counter() - start)

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {name: b.clone() for name, b in self.gm.named_buffers()}

    def _roll_back(self, saved: Optional[dict[str, torch.Tensor]]) -> None:
        """Undo a stopped iteration: buffers back to ``saved``; a stopped first iteration
        (``saved`` None: it was transmitting) changed nothing the host copy holds, so its
        loads are forgotten and cleaning saves nothing."""
        if saved is None:
            self.loads.done = [False] * len(self.loads.done)
        else:
            with torch.no_grad():
                for name, b in self.gm.named_buffers():
                    b.copy_(saved[name])
        if self.job.training:
            for p in self.gm.parameters():
                p.grad = None

    def clean(self, host: HostModel) -> Optional[dict]:
        """Task cleaning: a training job's weights go back to ``host`` (when they were
        transmitted) and its optimizer state is returned in host memory (None for inference),
        also when no iteration ran since :meth:`activate`; the task lets go of its arena
        memory."""
        state = None
        if self.job.training:
            if self.loads is not None and all(self.loads.done):
                host.save(self.gm)
            state = to_host(self.optimizer.state_dict())
            self.optimizer.state.clear()
        self.release()
        return state

    def release(self) -> None:
        """Let go of the weights (point them at empty tensors) and the gradients."""
        for name, t in self._tensors():
            t.data = self._empty[name]
        if self.job.training:
            for p in self.gm.parameters():
                p.grad = None
        self.loads = None

    def close(self) -> None:
        """Stop the runner's stream threads."""
        self.runner.close()

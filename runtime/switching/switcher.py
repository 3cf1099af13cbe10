"""The controller of PipeSwitch-style task switching on one device: a memory daemon (one
:class:`~tidal.runtime.switching.arena.Arena`), an active worker and standby workers.

:meth:`Switcher.start` builds the host copy of every job's weights in shared memory
(:class:`~tidal.runtime.switching.host_model.HostModel`), allocates the arena once and spawns
``1 + standby`` worker processes (``torch.multiprocessing``, spawn); each imports torch, creates
the device context, page-locks the host copies for itself (on a GPU; a host copy it cannot
page-lock is named in a ``RuntimeWarning`` here), builds every job's task and warms it up, then
waits. The device is resolved once, here (a bare ``"cuda"`` is the current CUDA device), and
the arena, the workers and their tasks all use that indexed device. :meth:`Switcher.switch`
to job B sets the active worker's ``preempt`` event (it stops after the pieces it is running,
rolling back the unfinished iteration, or at the next iteration boundary: the job's
``preempt_at``; it keeps its state: the weights go back to the host copy and the optimizer
state to the controller, in host memory, and becomes standby: task cleaning, asynchronous),
leases B's memory from the arena (beside A's while A cleans, when the arena has room) and
activates a standby worker: B's weights transmit group by group while the first groups compute,
and ``switch`` returns at B's first output. Every wait has a timeout: a dead worker, a stalled
one or one that raised gives a :class:`~tidal.runtime.switching.errors.SwitchingError` naming
it (one that raised: with its job and the stage that raised, as soon as it is reported); a
message that cannot cross processes fails at once, in its sender
(:mod:`~tidal.runtime.switching.messages`). A harness with a deadline of its own passes
``timeout_s`` and ``start_timeout_s`` that fit in it.

:meth:`Switcher.set_cap` changes an opportunistic job's memory cap (AntMan) between its
iterations: what it would carve past the cap comes from outside the arena (the device's own
allocator: :class:`~tidal.runtime.switching.stack.ArenaStack`), counted in ``Output.spills``.

Example:
    >>> import functools, torch, tidal
    >>> from tidal.passes.layer_groups import LayerGroups
    >>> from tidal.runtime.switching import Repeat, SwitchJob, Switcher
    >>> def job(name, width):
    ...     m = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
    ...                             torch.nn.Linear(width, 2))
    ...     c = tidal.compile(m, (torch.randn(4, 8),), passes=[LayerGroups()])
    ...     return SwitchJob(name, c.graph_module, Repeat(torch.ones(4, 8))), m
    >>> (a, ma), (b, mb) = job("a", 16), job("b", 32)
    >>> with Switcher([a, b], standby=1, threads=1) as sw:
    ...     ra = sw.switch("a", iterations=1)
    ...     rb = sw.switch("b", iterations=1)
    ...     allocations = sw.arena.allocations
    >>> torch.equal(rb.output, mb(torch.ones(4, 8))), rb.worker != ra.worker, allocations
    (True, True, 1)
"""
from __future__ import annotations

import dataclasses
import queue
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.multiprocessing as tmp

from tidal.runtime.switching.arena import Arena, Lease
from tidal.runtime.switching.device import resolve_device
from tidal.runtime.switching.errors import SwitchingError
from tidal.runtime.switching.host_model import HostModel
from tidal.runtime.switching.job import SwitchJob, weightless
from tidal.runtime.switching.messages import send
from tidal.runtime.switching.stack import TENSOR_ALIGN
from tidal.runtime.switching.task import StepResult
from tidal.runtime.switching.worker import activate_message, serve

STANDBY, ACTIVE, CLEANING = "standby", "active", "cleaning"


@dataclass(frozen=True)
class Output:
    """An iteration's result as the controller received it: the worker's
    :class:`~tidal.runtime.switching.task.StepResult`, the job's arena spills so far (count and
    bytes) and the seconds its activation spent carving memory."""

    result: StepResult
    spills: int
    spilled_bytes: int
    alloc_s: float


@dataclass(frozen=True)
class Switch:
    """A switch to ``job``: the ``worker`` that runs it, ``first_output_s`` from the request
    to its first output arriving at the controller, and that output."""

    job: str
    worker: int
    first_output_s: float
    first: Output

    @property
    def output(self) -> Any:
        return self.first.result.value


@dataclass
class JobState:
    """What the controller keeps of a job: the next iteration, the optimizer state saved at its
    last preemption, its outputs, whether its iterations ran out (``finished``) and its state is
    being saved (``saving``), the seconds its last task cleaning took and the seconds from its
    last preemption request to its worker's report that it stopped and was cleaned
    (``stop_s``: the wait for the running piece or iteration, then the cleaning)."""

    next_iteration: int = 0
    optimizer_state: Optional[dict] = None
    outputs: list[Output] = field(default_factory=list)
    finished: bool = False
    saving: bool = False
    cleaning_s: Optional[float] = None
    stop_s: Optional[float] = None
    lease: Optional[Lease] = None
    preempted_at: Optional[float] = None


@dataclass
class _Worker:
    wid: int
    proc: Any
    inbox: Any
    preempt: Any
    state: str = STANDBY
    job: Optional[str] = None
    startup_s: Optional[float] = None

    def describe(self) -> str:
        job = f", job {self.job!r}" if self.job else ""
        return f"worker {self.wid} (pid {self.proc.pid}, {self.state}{job})"


class Switcher:
    """Fast task switching between ``jobs`` on ``device`` (see the module docstring; a bare
    ``"cuda"`` is resolved to the current CUDA device: ``self.device`` has an index).
    ``standby`` standby workers (>= 1) beside the active one; ``arena_bytes`` the arena size
    (default: room for the two largest jobs, so a switch never waits for a cleaning);
    ``timeout_s`` bounds every wait of a switch, ``start_timeout_s`` the workers' start;
    ``threads`` the torch threads of each worker."""

    def __init__(self, jobs: Sequence[SwitchJob], device: Any = "cpu", *, standby: int = 1,
                 arena_bytes: Optional[int] = None, timeout_s: float = 60.0,
                 start_timeout_s: float = 300.0, threads: Optional[int] = None):
        if standby < 1:
            raise ValueError(f"Switcher: standby={standby} must be >= 1")
        names = [j.name for j in jobs]
        if not jobs or len(set(names)) != len(names):
            raise ValueError(f"Switcher: jobs need distinct names, got {names}")
        self.jobs = {j.name: j for j in jobs}
        self.device = resolve_device(device)
        self.standby, self.timeout_s, self.start_timeout_s = standby, timeout_s, start_timeout_s
        self.threads = threads
        self.arena_bytes = arena_bytes
        self.hosts: dict[str, HostModel] = {}
        self.states = {name: JobState() for name in names}
        self.arena: Optional[Arena] = None
        self.workers: list[_Worker] = []
        self._outbox: Any = None
        self._caps: dict[str, Any] = {}

    def need_bytes(self, name: str) -> int:
        """Arena bytes job ``name`` leases: its weights, group by group, and its activations."""
        host = self.hosts[name]
        return (sum(host.group_nbytes(k) + TENSOR_ALIGN for k in range(host.num_groups))
                + self.jobs[name].activation_bytes)

    def start(self) -> "Switcher":
        """Build the host copies, allocate the arena, start the workers and wait until each is
        ready (``start_timeout_s``); if one fails, every worker is stopped before the error
        propagates (``with Switcher(...)`` does not close a switcher whose start raised)."""
        if self.workers:
            return self
        self.hosts = {n: HostModel.of(j.graph) for n, j in self.jobs.items()}
        needs = sorted((self.need_bytes(n) for n in self.jobs), reverse=True)
        self.arena = Arena(self.arena_bytes or sum(needs[:2]), self.device)
        ctx = tmp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._caps = {n: ctx.Value("q", -1 if j.cap is None else j.cap)
                      for n, j in self.jobs.items()}
        shipped = {n: dataclasses.replace(j, graph=weightless(j.graph))
                   for n, j in self.jobs.items()}
        for wid in range(1 + self.standby):
            inbox, preempt = ctx.Queue(), ctx.Event()
            proc = ctx.Process(target=serve, name=f"tidal-switch-worker-{wid}", daemon=True,
                               args=(wid, shipped, self.hosts, self.arena.block,
                                     str(self.device), inbox, self._outbox, preempt,
                                     self._caps, self.threads))
            proc.start()
            self.workers.append(_Worker(wid, proc, inbox, preempt))
        try:
            self._pump(lambda: all(w.startup_s is not None for w in self.workers),
                       "the workers to start", self.start_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def active(self) -> Optional[_Worker]:
        """The active worker, if a job runs."""
        return next((w for w in self.workers if w.state == ACTIVE), None)

    def switch(self, name: str, iterations: Optional[int] = None) -> Switch:
        """Preempt the active job (after its current piece or iteration, its ``preempt_at``;
        cleaned asynchronously) and
        run job ``name`` on a standby worker from its next iteration, ``iterations`` of them
        (None: until preempted); return at its first output."""
        if name not in self.jobs:
            raise SwitchingError(f"switch: no job {name!r} (jobs: {sorted(self.jobs)})")
        if iterations is not None and iterations < 1:
            raise ValueError(f"switch: iterations={iterations} must be >= 1")
        if not self.workers:
            self.start()
        start = time.perf_counter()
        js = self.states[name]
        current = self.active
        if current is not None:
            if current.job == name:
                raise SwitchingError(f"switch: job {name!r} is already active on "
                                     f"{current.describe()}")
            self._preempt(current)
        self.wait_saved(name)
        need = self.need_bytes(name)
        self._pump(lambda: self.arena.find(need) is not None,
                   f"{need} bytes of arena for job {name!r}")
        self._pump(lambda: self._standby() is not None, "a standby worker")
        w = self._standby()
        js.lease = self.arena.lease(name, need)
        js.finished = False
        stop = None if iterations is None else js.next_iteration + iterations
        try:
            send(w.inbox, activate_message(name, js.lease.offset, js.lease.nbytes,
                                           js.optimizer_state, js.next_iteration, stop),
                 f"the controller (to {w.describe()})")
        except SwitchingError:
            self.arena.release(js.lease)
            js.lease = None
            raise
        w.state, w.job = ACTIVE, name
        seen = len(js.outputs)
        self._pump(lambda: len(js.outputs) > seen, f"the first output of job {name!r}")
        return Switch(name, w.wid, time.perf_counter() - start, js.outputs[seen])

    def wait(self) -> list[Output]:
        """Wait until the active job's iterations ran out; return its outputs."""
        w = self.active
        if w is None:
            return []
        js = self.states[w.job]
        self._pump(lambda: js.finished, f"job {w.job!r} to finish its iterations")
        return js.outputs

    def stop(self) -> None:
        """Preempt the active job and wait until its state is saved (:meth:`state`)."""
        w = self.active
        if w is not None:
            name = w.job
            self._preempt(w)
            self.wait_saved(name)

    def wait_output(self, name: str, count: int) -> list[Output]:
        """Wait until job ``name`` has ``count`` outputs in all; return them."""
        js = self.states[name]
        self._pump(lambda: len(js.outputs) >= count, f"output {count} of job {name!r}")
        return js.outputs

    def wait_saved(self, name: str) -> JobState:
        """Wait until job ``name``'s preemption has ended (its state saved, its worker
        standby again); return its :class:`JobState`."""
        js = self.states[name]
        self._pump(lambda: not js.saving, f"job {name!r}'s state to be saved")
        return js

    def state(self, name: str) -> tuple[int, dict[str, torch.Tensor], Optional[dict]]:
        """Job ``name``'s saved state (call :meth:`stop` first if it is active): its next
        iteration, copies of its weights from the host copy, its optimizer state."""
        if self.active is not None and self.active.job == name:
            raise SwitchingError(f"state: job {name!r} is active; stop() it first")
        js = self.states[name]
        weights = {k: t.clone() for k, t in self.hosts[name].tensors().items()}
        return js.next_iteration, weights, js.optimizer_state

    def set_cap(self, name: str, nbytes: Optional[int]) -> None:
        """Job ``name``'s arena cap in bytes (None: no cap), applied from its next iteration."""
        self._caps[name].value = -1 if nbytes is None else int(nbytes)

    def _standby(self) -> Optional[_Worker]:
        return next((w for w in self.workers if w.state == STANDBY), None)

    def _preempt(self, w: _Worker) -> None:
        w.state = CLEANING
        js = self.states[w.job]
        js.saving, js.preempted_at = True, time.perf_counter()
        w.preempt.set()

    def _pump(self, done: Callable[[], bool], what: str, timeout_s: Optional[float] = None
              ) -> None:
        """Handle the workers' messages until ``done()``; raise ``SwitchingError`` naming the
        worker when one dies, raises, or nothing arrives within the timeout."""
        deadline = time.perf_counter() + (timeout_s or self.timeout_s)
        while not done():
            try:
                msg = self._outbox.get(timeout=0.05)
            except queue.Empty:
                self._check_alive(what)
                if time.perf_counter() > deadline:
                    busy = [w.describe() for w in self.workers if w.state != STANDBY
                            or w.startup_s is None] or [w.describe() for w in self.workers]
                    raise SwitchingError(f"waited {timeout_s or self.timeout_s:.0f} s for "
                                         f"{what}: stalled: {'; '.join(busy)}") from None
                continue
            self._handle(msg)

    def _check_alive(self, what: str) -> None:
        for w in self.workers:
            if not w.proc.is_alive():
                hint = ("; workers are spawned, which re-imports the main script: start the "
                        "Switcher under `if __name__ == '__main__':`") \
                    if what == "the workers to start" else ""
                raise SwitchingError(f"{w.describe()} died (exit code {w.proc.exitcode}) "
                                     f"while waiting for {what}{hint}")

    def _handle(self, msg: tuple) -> None:
        kind, wid = msg[0], msg[1]
        w = self.workers[wid]
        if kind == "ready":
            w.startup_s = msg[2]
            for note in msg[3]:
                warnings.warn(f"worker {wid}: {note}", RuntimeWarning, stacklevel=2)
        elif kind == "output":
            _, _, name, result, spills, spilled, alloc_s = msg
            self.states[name].outputs.append(Output(result, spills, spilled, alloc_s))
        elif kind == "done":
            self.states[msg[2]].finished = True
        elif kind == "stopped":
            _, _, name, nxt, state, clean_s = msg
            js = self.states[name]
            js.next_iteration, js.optimizer_state, js.cleaning_s = nxt, state, clean_s
            if js.preempted_at is not None:
                js.stop_s, js.preempted_at = time.perf_counter() - js.preempted_at, None
            self._free(w, js)
        elif kind == "error":
            _, _, name, stage, tb = msg
            who = w.describe() if name is None or w.job == name else \
                f"{w.describe()} (job {name!r})"
            if name is not None:
                self._free(w, self.states[name])
            raise SwitchingError(f"{who} failed in {stage}:\n{tb}")

    def _free(self, w: _Worker, js: JobState) -> None:
        js.saving = False
        if js.lease is not None:
            self.arena.release(js.lease)
            js.lease = None
        w.state, w.job = STANDBY, None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers: those not gone within ``timeout_s`` in all (a stalled one) are
        terminated, then killed."""
        for w in self.workers:
            w.preempt.set()
            if w.proc.is_alive():
                w.inbox.put(("stop",))
        deadline = time.perf_counter() + timeout_s
        for w in self.workers:
            w.proc.join(timeout=max(deadline - time.perf_counter(), 0.0))
        for w in self.workers:
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(timeout=2)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=2)
        self.workers = []

    def __enter__(self) -> "Switcher":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

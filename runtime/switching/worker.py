"""A worker process: started ahead of time (torch imported, the device context created on the
indexed device the controller resolved, every job's host copy page-locked in this process on a
GPU, every job's :class:`~tidal.runtime.switching.task.Task` built and warmed up), then standby
until the controller activates it for a job.

:func:`serve` is the process's main function (``torch.multiprocessing``, spawn). Messages are
tuples on ``torch.multiprocessing`` queues (tensors cross by shared memory):

- in (``inbox``): ``("activate", job, offset, nbytes, optimizer_state, first, stop)`` runs
  ``job`` on the arena bytes ``[offset, offset + nbytes)`` from iteration ``first`` until
  ``stop`` (None: until preempted) or until ``preempt`` is set, checked before every piece
  (the job's ``preempt_at`` "piece": the iteration it stops is rolled back and runs again on
  resume) or at every iteration boundary ("iteration"); ``("stop",)`` ends the process.
- out (``outbox``), each starting with the kind and the worker id: ``ready`` (with its start-up
  seconds and the host copies it could not page-lock), ``output`` (a
  :class:`~tidal.runtime.switching.task.StepResult`, the arena spills and the activation's
  allocation seconds), ``done`` (the iterations ran out; the weights stay resident until
  preempted), ``stopped`` (preempted and cleaned: the next iteration, the optimizer state, the
  cleaning seconds), ``error`` (the job, None at start-up, the stage that raised, e.g.
  ``"iteration 3"`` or ``"warm-up of job 'a'"``, and the traceback).

Every tensor in a message is in host memory (:func:`~tidal.runtime.switching.device.to_host`: a
CUDA tensor received over IPC cannot be shared again), and every message is checked before it
is queued (:func:`~tidal.runtime.switching.messages.send`): one that cannot cross fails at once,
reported as this worker's error, instead of being lost in the queue's feeder thread. Whatever
a stage raises is reported before anything else is tried (letting go of the job's memory may
raise too, on a device in an error state), so the controller's wait ends with an error naming
the worker, the job and the stage, never at its timeout.

A worker whose controller has gone exits on its own.

Example (what the controller sends; :class:`~tidal.runtime.switching.switcher.Switcher` does it):
    >>> from tidal.runtime.switching.worker import activate_message
    >>> activate_message("bert", 0, 1 << 20, None, 0, 1)
    ('activate', 'bert', 0, 1048576, None, 0, 1)
"""
from __future__ import annotations

import dataclasses
import os
import queue
import time
import traceback
from typing import Any, Optional

import torch

from tidal.runtime.switching.device import enter_device, to_host
from tidal.runtime.switching.host_model import HostModel, PageLock
from tidal.runtime.switching.job import SwitchJob
from tidal.runtime.switching.messages import send
from tidal.runtime.switching.stack import ArenaStack
from tidal.runtime.switching.task import StepResult, Task

POLL_S = 0.5
"""How often an idle worker checks that its controller is alive."""


def activate_message(job: str, offset: int, nbytes: int, optimizer_state: Optional[dict],
                     first: int, stop: Optional[int]) -> tuple:
    """The ``activate`` message for a worker (see the module docstring)."""
    return ("activate", job, offset, nbytes, optimizer_state, first, stop)


def _cap(value: Any) -> Optional[int]:
    return None if value.value < 0 else int(value.value)


def _report(outbox: Any, wid: int, job: Optional[str], stage: str) -> None:
    """Send the exception being handled as worker ``wid``'s ``error`` in ``stage`` of ``job``
    (None: at start-up); a message that cannot be queued is printed to stderr instead."""
    try:
        outbox.put(("error", wid, job, stage, traceback.format_exc()))
    except BaseException:  # noqa: BLE001 - the controller then sees the process die
        traceback.print_exc()


def serve(wid: int, jobs: dict[str, SwitchJob], hosts: dict[str, HostModel],
          block: torch.Tensor, device: str, inbox: Any, outbox: Any, preempt: Any,
          caps: dict[str, Any], threads: Optional[int]) -> None:
    """Main function of worker ``wid`` (see the module docstring)."""
    parent = os.getppid()
    tasks: dict[str, Task] = {}
    locks: list[PageLock] = []
    stage = "entering the device"
    try:
        start = time.perf_counter()
        if threads:
            torch.set_num_threads(threads)
        dev = enter_device(device)
        if dev.type == "cuda":  # pragma: no cover - needs a GPU
            stage = "page-locking the host copies"
            locks = [host.page_lock(f"job {name!r}", warn=False) for name, host in hosts.items()]
        for name, job in jobs.items():
            stage = f"building the task of job {name!r}"
            tasks[name] = Task(job, dev)
            stage = f"warm-up of job {name!r}"
            tasks[name].warm_up(hosts[name])
        stage = "reporting ready"
        send(outbox, ("ready", wid, time.perf_counter() - start,
                      [note for lock in locks for note in lock.failures]), f"worker {wid}")
        stage = "waiting for work"
        _serve(wid, tasks, hosts, block, inbox, outbox, preempt, caps, parent)
    except BaseException:  # noqa: BLE001 - reported to the controller
        _report(outbox, wid, None, stage)
    finally:
        _close(tasks.values(), locks)


def _close(tasks: Any, locks: list[PageLock]) -> None:
    """Stop the tasks' runners and unregister the page-locked host copies (after the device
    finished every copy from them)."""
    for task in tasks:
        task.close()
    if locks:  # pragma: no cover - needs a GPU
        torch.cuda.synchronize()  # no copy from a host copy still runs
        for lock in locks:
            lock.close()


def _serve(wid: int, tasks: dict[str, Task], hosts: dict[str, HostModel], block: torch.Tensor,
           inbox: Any, outbox: Any, preempt: Any, caps: dict[str, Any], parent: int) -> None:
    """Run activations until told to stop or the controller is gone."""
    while True:
        try:
            msg = inbox.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if msg[0] == "stop":
            return
        _, name, offset, nbytes, state, first, stop = msg
        _Activation(wid, tasks[name], hosts[name], caps[name], outbox, preempt, parent).run(
            block[offset:offset + nbytes], state, first, stop)


class _Activation:
    """One activation of a task in worker ``wid``: run, report, clean."""

    def __init__(self, wid: int, task: Task, host: HostModel, cap: Any, outbox: Any,
                 preempt: Any, parent: int):
        self.wid, self.task, self.host, self.cap = wid, task, host, cap
        self.outbox, self.preempt, self.parent = outbox, preempt, parent
        self.name = task.job.name
        self.stage = "activation"

    def run(self, region: torch.Tensor, state: Optional[dict], first: int,
            stop: Optional[int]) -> None:
        """Run from iteration ``first`` on ``region``; whatever a stage raises is reported
        (naming the stage) before the task lets go of its memory."""
        try:
            self._run(region, state, first, stop)
        except BaseException:  # noqa: BLE001 - reported to the controller
            _report(self.outbox, self.wid, self.name, self.stage)
            try:
                self.task.release()
            except BaseException:  # noqa: BLE001 - the first error is the one reported
                traceback.print_exc()
        finally:
            self.preempt.clear()

    def _run(self, region: torch.Tensor, state: Optional[dict], first: int,
             stop: Optional[int]) -> None:
        i = first
        t0 = time.perf_counter()
        stack = ArenaStack(region, cap=_cap(self.cap))
        self.task.activate(self.host, stack, state)
        alloc_s = time.perf_counter() - t0
        while (stop is None or i < stop) and not self.preempt.is_set():
            self.stage = f"iteration {i}"
            stack.set_cap(_cap(self.cap))
            result = self.task.step(i, stack, self.preempt.is_set
                                    if self.task.job.preempt_at == "piece" else None)
            if result is None:
                break
            self._send(("output", self.wid, self.name, _light(result), stack.spills,
                        stack.spilled_bytes, alloc_s))
            i += 1
        if not self.preempt.is_set():
            self.stage = "reporting done"
            self._send(("done", self.wid, self.name, i))
            self.stage = "waiting for preemption"
            self._wait_preempt()
        self.stage = "cleaning"
        t0 = time.perf_counter()
        state = self.task.clean(self.host)
        self._send(("stopped", self.wid, self.name, i, state, time.perf_counter() - t0))

    def _send(self, msg: tuple) -> None:
        send(self.outbox, msg, f"worker {self.wid} (job {self.name!r})")

    def _wait_preempt(self) -> None:
        while not self.preempt.wait(POLL_S):
            if os.getppid() != self.parent:
                raise SystemExit(0)


def _light(result: StepResult) -> StepResult:
    """``result`` as it is sent: its value in host memory, its timeline without the program and
    the piece trace (smaller to send)."""
    timeline = result.timeline if result.timeline is None else dataclasses.replace(
        result.timeline, program=None, trace=())
    return dataclasses.replace(result, value=to_host(result.value), timeline=timeline)

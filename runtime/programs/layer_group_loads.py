"""The weight loads of a layer-grouped program, and the timeline a run of it recorded.

A :class:`GroupLoads` is one run's loads from a weight store (``tidal.runtime.weights.store``):
the ``load group k`` piece copies group ``k``'s contiguous buffer onto the device on the stream
it runs on (the backend's ``load`` stream: low priority, not occupying the device) and points
the group's parameters and buffers at views of the copy; the ``group k`` piece first checks it
(on a GPU its stream waits for the copy's event, and the copy is marked used there). The bytes
are checked against the store's checksums (CRC-32) as they are read from the file (plain reads,
never a memory map: a file truncated meanwhile raises ``WeightStoreError``, not ``SIGBUS``): on
the CPU into the copy itself, on any other device into the program's host copy
(``tidal.runtime.weights.store.HostCopy``: one buffer, pinned on a GPU, allocated once and
reused), from which a GPU copies by DMA. A :class:`LoadTimeline` is read from a run's piece
trace: device-side times on the backend's one clock (CUDA event times on a GPU).

Example:
    >>> from tidal.ir.layer_group_program import pipelined
    >>> from tidal.runtime.program import PieceTrace
    >>> run = pipelined([("a",), ("b",)])
    >>> trace = [PieceTrace("load group 0", "load", 0, 2), PieceTrace("load group 1", "load", 2, 5),
    ...          PieceTrace("group 0", "compute", 2, 4), PieceTrace("group 1", "compute", 5, 6)]
    >>> tl = LoadTimeline.of(run, trace)
    >>> tl.overlaps(), tl.first_output
    (True, 6e-06)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from tidal.ir.layer_group_program import Pipelined
from tidal.ir.program import COMPUTE, LOAD, Program
from tidal.runtime.backend import used_here
from tidal.runtime.program import PieceTrace
from tidal.runtime.weights.loader import GroupedTensors
from tidal.runtime.weights.store import HostCopy, WeightStore, view_tensor


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


class GroupLoads:
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
            dst = self.store.read_group(k)  # the read from the file
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

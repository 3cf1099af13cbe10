"""Multi-job runtime: one foreground job and background jobs sharing a device (DeepPool §5).

Each job is a virtual queue of *pieces*, the one piece type of ``tidal.ir.program`` (a lowered
forward's steps, a training program's segments, a collective...), each paired with the function
that runs it (:class:`~tidal.runtime.scheduling.pieces.BoundPiece`). What the scheduler needs
beyond the piece's fields comes from its kind and stream: whether it occupies the device
(communication and host work do not) and its operator class (``compute``, ``collective``...).
``Runtime.run`` dispatches them onto the streams they name, per job role:

- **priorities**: the foreground stream is high priority, background streams low;
- **launch pacing**: at most ``fg_depth`` (2) foreground and ``be_depth`` (1) background pieces
  outstanding per job and stream, so little low-priority work queues ahead of foreground work;
- **slowdown feedback**: every foreground piece's time is recorded in isolation (the first
  ``calibrate`` foreground iterations run alone). A foreground piece that later runs
  ``target_slowdown`` (1.1x) slower than that while background work was on the device is marked
  sensitive (all-reduce is the known case); background pieces are then dispatched only if they
  are predicted to finish before the next sensitive piece starts;
- **AntMan limits** of a background job (``handle.limits``): a memory cap checked against the
  job's ``memory_bytes`` at each iteration boundary (above it the job is held until the cap is
  raised), and a compute share (fraction of device time). Both can change between iterations
  (``on_iteration`` callback or from another thread);
- a piece that raises stops its job (reported in its stats) while the others keep running.

Per-job statistics (throughput, iteration times, foreground slowdowns) and a trace of every
piece (``tidal.runtime.trace_export``) come back from ``run``.

This module is the public face; the parts, one job each, are in ``tidal.runtime.scheduling``.

Example:
    >>> from tidal.runtime.scheduler import Runtime, step_job
    >>> from tidal.runtime.backend import LogicalBackend
    >>> rt = Runtime(backend=LogicalBackend(lambda name, collocated: 100.0))
    >>> fg = rt.submit(step_job("train", lambda: None, iterations=3), priority="high")
    >>> bg = rt.submit(step_job("extra", lambda: None), priority="low")
    >>> stats = rt.run()
    >>> stats["train"].iterations, stats["extra"].iterations > 0
    (3, True)
"""
from tidal.runtime.scheduling.handle import JobHandle
from tidal.runtime.scheduling.jobs import FunctionJob, Job, lowered_job, step_job
from tidal.runtime.scheduling.limits import Limits
from tidal.runtime.scheduling.pieces import BoundPiece, operator_class, uses_device
from tidal.runtime.scheduling.records import JobStats, TraceRecord
from tidal.runtime.scheduling.runtime import Runtime

__all__ = ["BoundPiece", "FunctionJob", "Job", "JobHandle", "JobStats", "Limits", "Runtime",
           "TraceRecord", "lowered_job", "operator_class", "step_job", "uses_device"]

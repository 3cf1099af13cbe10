"""One step's gradient sync of the data-parallel program (``tidal.runtime.program``): each
bucket's all-reduce issued without waiting (:meth:`BucketSync.issue`, as DDP issues a bucket
once its gradients are ready), all of them waited for by the optimizer piece
(:meth:`BucketSync.wait`), and the step's loss summed over the ranks on the way.

What it spares over a plain bucketed all-reduce, each as DDP or better:

- a bucket is one flat buffer kept from step to step (per bucket ``key``, in the caller's
  ``buffers``), the gradients copied in; a bucket of ONE gradient that is the step's own fresh
  CPU tensor (no view, no input, no other gradient: :meth:`BucketSync.owned`) is reduced in
  place, with no copy;
- the loss rides on the first bucket that has a flat buffer of its dtype (one more element):
  no all-reduce of its own (:meth:`BucketSync.loss`; one is issued when no bucket could carry
  it);
- the caller starts the backward from ``1 / world`` (the captured step's seed), so a bucket's
  sum is already the average: no pass over it after the all-reduce.

Each bucket's all-reduce reports when it ended (:class:`Completion`), for the trace.

Example (one process: nothing to reduce, the gradients are the step's own):
    >>> from tidal.runtime.backend import CpuBackend
    >>> with CpuBackend() as be:
    ...     sync = BucketSync(be, None, {}, ())
    ...     sync.issue("b0", [0], [torch.ones(2)], torch.tensor(3.0))
    ...     sync.wait()[0].tolist(), float(sync.loss())
    ([1.0, 1.0], 3.0)
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from tidal.runtime.backend import Backend
from tidal.runtime.distributed import group_size
from tidal.runtime.programs.replica_sync import reduce_loss_async

MAX_KEPT_BUFFERS = 64
"""Flat buffers kept at most (by bucket key) before the caller's table starts over."""


class Completion:
    """When an asynchronous collective a piece issued (its ``Work``, or a ``torch.futures.
    Future``) ended, on the backend's clock ``clock`` (``Backend.now_us``): ``done_us``, set
    once the future completes, or by :meth:`waited` (whichever comes first: a waiter may wake
    before the future's callbacks ran). A piece's work returns it so that its trace carries
    ``done_us`` (``tidal.runtime.program.PieceTrace``)."""

    def __init__(self, clock: Callable[[], float], work: Any):
        self.done_us: Optional[float] = None
        self._clock = clock
        future = work.get_future() if hasattr(work, "get_future") else work
        future.add_done_callback(lambda _: self.waited())

    def waited(self) -> None:
        """The work is known to have ended (now, at the latest)."""
        if self.done_us is None:
            self.done_us = self._clock()


class BucketSync:
    """The sync of one step on ``group`` (see the module docstring). ``buffers``: the flat
    buffers by bucket key, kept by the caller from step to step; ``inputs``: the step's
    inputs (a gradient that is one of them is never reduced in place)."""

    def __init__(self, backend: Backend, group: Optional[dist.ProcessGroup], buffers: dict,
                 inputs: Sequence[Any]):
        self.backend, self.group, self.world = backend, group, group_size(group)
        self._buffers = buffers
        self._taken = {id(t) for t in inputs}
        self._pending: list = []
        self._averaged: dict[int, torch.Tensor] = {}
        self._local_loss: Optional[torch.Tensor] = None
        self._loss: Optional[Callable[[], torch.Tensor]] = None

    def owned(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is the step's own fresh CPU tensor (no view, no input, no other
        gradient), which the sync may reduce in place."""
        fresh = not grad.is_cuda and grad._base is None and grad.is_contiguous() and \
            id(grad) not in self._taken
        self._taken.add(id(grad))
        return fresh

    def issue(self, key: Hashable, indices: Sequence[int], grads: Sequence[torch.Tensor],
              loss: Optional[torch.Tensor] = None) -> Optional[Completion]:
        """Issue the all-reduce of the bucket ``key`` of gradients ``grads`` (their indices
        ``indices``); ``loss``: this rank's loss once known (it rides on this bucket when it
        can). Returns its :class:`Completion` (None in one process)."""
        if loss is not None and self._local_loss is None:
            self._local_loss = loss.detach()
        if self.world == 1:
            self._averaged.update(zip(indices, grads))
            return None
        rider = self._local_loss if self._loss is None else None
        if len(grads) == 1 and self.owned(grads[0]):
            buf, rider = grads[0].view(-1), None   # in place: no room for the loss
        else:
            if rider is not None and (rider.numel() != 1 or rider.dtype != grads[0].dtype or
                                      any(g.dtype != rider.dtype for g in grads)):
                rider = None
            buf = self._flat(key, grads, rider)
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        done = Completion(self.backend.now_us, work)
        if rider is not None:
            self._loss = lambda: buf[-1:].view(()).clone() / self.world
        self._pending.append((work, done, buf, indices, grads))
        return done

    def _flat(self, key: Hashable, grads: Sequence[torch.Tensor],
              rider: Optional[torch.Tensor]) -> torch.Tensor:
        """The bucket's flat buffer (kept from step to step) holding ``grads`` and, last,
        ``rider``."""
        parts = [g.reshape(-1) for g in grads] + ([rider.reshape(1)] if rider is not None
                                                   else [])
        key = (key, rider is not None)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != sum(p.numel() for p in parts):
            if len(self._buffers) >= MAX_KEPT_BUFFERS:
                self._buffers.clear()
            buf = self._buffers[key] = torch.cat(parts)
        else:
            torch.cat(parts, out=buf)
        return buf

    def wait(self) -> dict[int, torch.Tensor]:
        """Wait for every bucket issued; the averaged gradients by index (views of the
        buckets' buffers)."""
        for work, done, buf, indices, grads in self._pending:
            work.wait()
            done.waited()
            offset = 0
            for i, g in zip(indices, grads):
                self._averaged[i] = buf[offset:offset + g.numel()].view_as(g)
                offset += g.numel()
        self._pending.clear()
        return self._averaged

    def loss(self, local: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The step's loss averaged over the ranks (after :meth:`wait`): from the bucket it
        rode on, else one all-reduce of ``local`` (or of the loss :meth:`issue` was given)."""
        if self._loss is not None:
            return self._loss()
        local = self._local_loss if local is None else local
        return reduce_loss_async(local, self.group)()

"""Gradient synchronization shared by the executors: plain averaging all-reduce or a compressor.

A program that trains data-parallel (``tidal.runtime.programs.data_parallel``'s, ``tick_tock``'s
waves) hands its gradients to a :class:`GradSync` for a process group. The gradients are
bucketed like DDP (in backward order, i.e. the reverse of the order given, 25 MiB buckets) and
each bucket goes through :func:`tidal.runtime.comm.compressors.synchronize`: encode, one collective
per round for the whole bucket, decode (with error feedback when the compressor keeps it). With
no compressor (:class:`~tidal.runtime.comm.compressors.NoCompression`) this is the plain averaging
all-reduce, so an executor has one code path whether compression is on or off.

The ``compression`` pass composes with a parallelism pass at the plan level: its
``CompressionPlan`` names the compressor and the buckets, and
:func:`tidal.runtime.programs.compression.compression_executor` hands a
:class:`GradSyncFactory` built from that plan to the parallelism executor's ``use_grad_sync``,
which builds one :class:`GradSync` per process group it syncs on.

Example:
    >>> import torch
    >>> from tidal.runtime.comm.grad_sync import GradSync
    >>> sync = GradSync()                       # one process: plain averaging is the identity
    >>> out = sync({"w": torch.ones(2, 2), "b": torch.zeros(2)})
    >>> list(out), out["w"].tolist(), sync.buckets(out)
    (['w', 'b'], [[1.0, 1.0], [1.0, 1.0]], (('b', 'w'),))
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from tidal.ir.comm_cost import DDP_BUCKET_BYTES, ddp_buckets
from tidal.runtime.comm.compressors import Comm, Compressor, NoCompression, synchronize_async


class GradSync:
    """Average named gradients over ``group`` through ``compressor`` (default: none, a plain
    all-reduce), bucket by bucket. ``buckets``: explicit buckets of names (default: DDP-like,
    built from the first gradients seen). ``all_gather=False`` declares a group without
    all-gather (a compressor that needs it is refused, naming it). ``state_dict`` checkpoints
    the compressor (residuals, warm-start state)."""

    def __init__(self, compressor: Optional[Compressor] = None, *,
                 bucket_bytes: float = DDP_BUCKET_BYTES,
                 buckets: Optional[Sequence[Sequence[str]]] = None,
                 group: Optional[dist.ProcessGroup] = None, all_gather: bool = True):
        if not bucket_bytes > 0:
            raise ValueError(f"GradSync(bucket_bytes={bucket_bytes!r}): must be > 0")
        self.compressor = compressor if compressor is not None else NoCompression()
        self.comm = Comm(group, all_gather=all_gather)
        self.comm.check(self.compressor)
        self.bucket_bytes = bucket_bytes
        self._buckets = None if buckets is None else tuple(tuple(b) for b in buckets)

    def buckets(self, grads: Mapping[str, torch.Tensor]) -> tuple[tuple[str, ...], ...]:
        """The buckets of ``grads``' names: DDP's (``tidal.ir.comm_cost.ddp_buckets``: reverse
        order, the backward's, closed at ``bucket_bytes`` as DDP closes them, an empty
        gradient in none; fixed on first use) or the explicit ones as given. Raises ``ValueError`` when the names do
        not match them."""
        if self._buckets is None:
            self._buckets = ddp_buckets([(n, g.numel() * 4) for n, g in grads.items()],
                                        self.bucket_bytes)
        covered = {n for b in self._buckets for n in b}
        odd = sorted((covered - set(grads)) | {n for n, g in grads.items()
                                               if n not in covered and g.numel()})
        if odd:
            raise ValueError(f"GradSync: gradients {odd[:3]} do not match the buckets "
                             "(every call must pass the same names)")
        return self._buckets

    def __call__(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The synchronized gradients (same names, order, shapes and dtypes; an empty one as
        it is). Collective: every rank of the group calls it with the same names."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self.buckets(grads):
            out.update(self.bucket({n: grads[n] for n in bucket}))
        return {n: out.get(n, g) for n, g in grads.items()}

    def bucket(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One bucket synchronized: encode, the collective(s), decode
        (:func:`~tidal.runtime.comm.compressors.synchronize`); same names, shapes and dtypes. A
        program runs each bucket as a comm piece (``tidal.runtime.programs.data_parallel``).
        Every compressor works per tensor (its state and seeds are keyed by name), so how the
        names are grouped into buckets changes how messages are packed, never the result.
        Collective: every rank of the group calls it with the same names in the same order."""
        return self.bucket_async(grads)()

    def bucket_async(self, grads: Mapping[str, torch.Tensor]) -> "PendingBucket":
        """:meth:`bucket` without waiting (``synchronize_async``: the collectives are issued,
        as DDP issues a bucket's all-reduce, and the caller goes on): returns the
        :class:`PendingBucket`, whose call waits for the bucket and gives its synchronized
        gradients (it raises what the sync raised). ``grads`` must stay untouched until
        then."""
        return PendingBucket(synchronize_async(self.compressor, grads, self.comm),
                             {n: g.dtype for n, g in grads.items()})

    def state_dict(self) -> dict[str, Any]:
        """The compressor's checkpoint state."""
        return self.compressor.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the compressor's state."""
        self.compressor.load_state_dict(state)


class PendingBucket:
    """A bucket's sync issued (:meth:`GradSync.bucket_async`): its ``future`` (of name ->
    synchronized tensor) and, called, the synchronized gradients in their own dtypes."""

    def __init__(self, future: torch.futures.Future, dtypes: Mapping[str, torch.dtype]):
        self.future, self._dtypes = future, dict(dtypes)

    def __call__(self) -> dict[str, torch.Tensor]:
        out = self.future.wait()
        return {n: out[n].to(dtype) for n, dtype in self._dtypes.items()}


GradSyncFactory = Callable[[Optional[dist.ProcessGroup]], GradSync]
"""Builds a :class:`GradSync` for a process group (one per group an executor syncs on)."""


def plain_sync(group: Optional[dist.ProcessGroup] = None) -> GradSync:
    """The default factory: plain averaging all-reduce on ``group``."""
    return GradSync(group=group)

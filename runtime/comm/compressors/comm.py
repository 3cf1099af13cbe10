"""Running compressors' messages through ``torch.distributed``: one collective per round and dtype.

:class:`Comm` wraps a process group (None: the default group, or a single process when no group
is initialised). :func:`synchronize_async` drives a compressor over a set of named tensors
without blocking: it encodes when its turn comes (see below), then every round's messages are
packed, by collective and dtype, into one flat buffer (so a bucket costs one collective per
round, as in DDP), issued with ``async_op=True``, and decoded in a callback chained on the
collective's future (as PyTorch's ``powerSGD_hook`` chains with ``.then``), which issues the
next round. It returns a future of the results. :func:`synchronize` is the same, waited for.

Order of collectives. Every rank must issue the same collectives in the same order, but a
round after the first is issued from a callback, on the thread that completed the previous
round (gloo's worker thread), while the caller may be issuing the next bucket's first round.
So a :class:`Comm` issues its calls one after another: the next call's first collective goes
out only once the previous call has issued its last one (:class:`Lane`). Calls on one ``Comm``
are thus ordered as they were made, the same on every rank. (PyTorch's ``powerSGD_hook`` has no
such order: on gloo, with more than one bucket, its callbacks' collectives race the next
bucket's and the ranks fail with a collective mismatch.) Use one ``Comm`` per process group at
a time.

``wire_dtype`` (``torch.float16``/``torch.bfloat16``) sends every floating-point message in that
dtype and casts the result back before decoding: the ``fp16``/``bf16`` hooks, or any compressor
with its payload halved. ``out`` names tensors the results are written into (a DDP bucket's
gradient views), so nothing is copied again.

Example:
    >>> import torch
    >>> from tidal.runtime.comm.compressors import make_compressor, synchronize, synchronize_async
    >>> out = synchronize(make_compressor("powersgd:1", min_compression_rate=0),
    ...                   {"w": torch.ones(4, 3)})
    >>> torch.allclose(out["w"], torch.ones(4, 3))   # a rank-1 matrix survives rank 1
    True
    >>> dest = torch.zeros(3)
    >>> fut = synchronize_async(make_compressor("none"), {"b": torch.arange(3.0)},
    ...                         wire_dtype=torch.bfloat16, out={"b": dest})
    >>> fut.wait()["b"] is dest, dest.tolist()
    (True, [0.0, 1.0, 2.0])
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist

from tidal.ir.compat import all_gather_into_tensor
from tidal.runtime.comm.compressors.base import ALL_REDUCE, Compressor, Message, World
from tidal.runtime.distributed import collective_device

WIRE_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes a floating-point payload may be sent in (``wire_dtype``)."""

Release = Callable[[], None]
"""Called by a lane's task once it has issued its last collective (more calls: no effect)."""


class Lane:
    """Starts tasks one after another: a task ``task(release)`` issues collectives (perhaps
    later, from callbacks) and calls ``release()`` once it has issued its last one; only then
    does the next task start, on the thread that released. A task never raises (it reports
    errors through its own future) and must release even when it fails, or the tasks behind it
    never start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[Callable[[Release], None]] = deque()
        self._free = True          # no started task still has collectives to issue
        self._draining = False     # some thread is in _drain's loop

    def submit(self, task: Callable[[Release], None]) -> None:
        """Start ``task`` now if no task is issuing, else after the ones before it."""
        with self._lock:
            self._queue.append(task)
        self._drain()

    def _drain(self) -> None:
        with self._lock:
            if self._draining:
                return
            self._draining = True
        while True:                       # a loop, not recursion: tasks that release at once
            with self._lock:              # (one round) may follow each other by hundreds
                if not self._free or not self._queue:
                    self._draining = False
                    return
                task = self._queue.popleft()
                self._free = False
            task(self._release_for())

    def _release_for(self) -> Release:
        fired = threading.Event()

        def release() -> None:
            with self._lock:
                if fired.is_set():
                    return
                fired.set()
                self._free = True
            self._drain()
        return release


class Comm:
    """Collectives on ``group``. ``all_gather=False`` declares a group on which all-gather is not
    available; a compressor that needs it is then refused with a ``ValueError``. In a group of
    one rank the collectives are skipped (their result is their input), unless ``issue_alone``
    (a check of the collectives themselves, e.g. on an NCCL group of one)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, all_gather: bool = True,
                 issue_alone: bool = False):
        self.group = group
        self.all_gather_available = all_gather
        self.issue_alone = bool(issue_alone)
        self.bytes_sent = 0
        self.lane = Lane()

    @property
    def world(self) -> World:
        """Rank and size in the group ((0, 1) with no process group)."""
        if not _initialised():
            return World(0, 1)
        return World(dist.get_rank(self.group), dist.get_world_size(self.group))

    def check(self, compressor: Compressor) -> None:
        """Refuse a compressor that needs all-gather on a group without it."""
        if not compressor.all_reduce_compatible and not self.all_gather_available:
            raise ValueError(f"compressor {compressor.spec()!r} needs all-gather, which is not "
                             f"available on process group {self.group!r}")

    def run_async(self, messages: list[Message], *, wire_dtype: Optional[torch.dtype] = None
                  ) -> torch.futures.Future:
        """Issue every message's collective, one flat ``async_op=True`` collective per (op,
        dtype), floating-point payloads as ``wire_dtype`` when given; a future of each
        message's results (summed tensors for all-reduce, ``[world, ...]``-stacked for
        all-gather, in the message's dtypes). Not ordered with other calls: see
        :func:`synchronize_async`."""
        world = self.world
        groups: dict[tuple[str, torch.dtype], list[tuple[int, int]]] = {}
        for i, msg in enumerate(messages):
            for j, t in enumerate(msg.tensors):
                groups.setdefault((msg.op, t.dtype), []).append((i, j))
        # a collective takes its tensors on the group's device (NCCL: the current GPU); the
        # results come back to where the messages live
        local = world.size == 1 and not (self.issue_alone and _initialised())
        device = None if local else collective_device(self.group)
        issued = []
        homes = []
        scaled = set()  # float16 sums: divided by the world size first (no overflow past 65504)
        for (op, dtype), slots in groups.items():
            parts = [messages[i].tensors[j].reshape(-1) for i, j in slots]
            homes.append(parts[0].device)
            wire = wire_dtype if dtype.is_floating_point and wire_dtype else dtype
            if op == ALL_REDUCE and wire == torch.float16 and dtype != wire and world.size > 1:
                flat = _packed(parts, dtype).div_(world.size).to(wire)
                scaled.add((op, dtype))
            else:
                flat = _packed(parts, wire)
            self.bytes_sent += flat.numel() * flat.element_size()
            if local:
                out = flat if op == ALL_REDUCE else flat.view(1, -1)
                done: torch.futures.Future = torch.futures.Future()
                done.set_result([out])
                issued.append(done)
                continue
            if flat.device != device:
                flat = flat.to(device)
            if op == ALL_REDUCE:
                issued.append(dist.all_reduce(flat, group=self.group, async_op=True)
                              .get_future())
            else:
                issued.append(_all_gather(flat, world.size, self.group, device))

        def unpack(all_done: torch.futures.Future) -> list[tuple[torch.Tensor, ...]]:
            results: list[list] = [[None] * len(m.tensors) for m in messages]
            for ((op, dtype), slots), fut, home in zip(groups.items(), all_done.value(), homes):
                out = fut.value()[0].to(home, dtype)
                if (op, dtype) in scaled:
                    out = out.mul_(world.size)
                sizes = [messages[i].tensors[j].numel() for i, j in slots]
                pieces = torch.split(out, sizes, dim=0 if op == ALL_REDUCE else 1)
                for (i, j), piece in zip(slots, pieces):
                    shape = messages[i].tensors[j].shape
                    results[i][j] = (piece.view(shape) if op == ALL_REDUCE
                                     else piece.reshape((out.shape[0], *shape)))
            return [tuple(r) for r in results]

        return torch.futures.collect_all(issued).then(unpack)

    def run(self, messages: list[Message], *, wire_dtype: Optional[torch.dtype] = None
            ) -> list[tuple[torch.Tensor, ...]]:
        """:meth:`run_async`, waited for."""
        return self.run_async(messages, wire_dtype=wire_dtype).wait()


def _initialised() -> bool:
    """Whether a process group is initialised (``tidal.runtime.distributed.group_size`` cannot
    say: it is 1 both without a group and in a group of one, and ``Comm.world`` needs a rank)."""
    return dist.is_available() and dist.is_initialized()


def _all_gather(flat: torch.Tensor, size: int, group: Optional[dist.ProcessGroup],
                device: torch.device) -> torch.futures.Future:
    """Issue the all-gather of the 1-D ``flat`` (on ``device``, the group's) over the ``size``
    ranks of ``group``; a future of ``[gathered]``, ``gathered`` shaped ``[size,
    flat.numel()]`` in ``flat``'s dtype. The payload travels as bytes: an all-gather only moves
    them, and NCCL has no 16-bit integer type (QSGD's levels past 127)."""
    wire = flat.view(torch.uint8)
    out = torch.empty(size * wire.numel(), dtype=torch.uint8, device=device)
    work = all_gather_into_tensor()(out, wire, group=group, async_op=True)
    return work.get_future().then(
        lambda f: (f.wait(), [out.view(size, -1).view(flat.dtype)])[1])


def _packed(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """A fresh flat tensor of ``dtype`` holding ``parts`` one after another (one pass)."""
    if len(parts) == 1:
        return parts[0].to(dtype, copy=True)
    out = torch.empty(sum(p.numel() for p in parts), dtype=dtype, device=parts[0].device)
    return torch.cat(parts, out=out)


class LocalComm(Comm):
    """A :class:`Comm` of one process whatever the process group: the collectives are the
    identity, so :func:`synchronize` does all of a compressor's local work (encode, packing,
    decode) and no communication. Used to time encode + decode."""

    @property
    def world(self) -> World:
        return World(0, 1)


def check_wire_dtype(wire_dtype: Optional[torch.dtype], who: str) -> Optional[torch.dtype]:
    """``wire_dtype`` if it is None or one of :data:`WIRE_DTYPES`; else a ``ValueError`` naming
    ``who``."""
    if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"{who}: wire_dtype={wire_dtype!r} must be None, torch.float16 or "
                         "torch.bfloat16")
    return wire_dtype


def synchronize_async(compressor: Compressor, tensors: Mapping[str, torch.Tensor],
                      comm: Optional[Comm] = None, *, wire_dtype: Optional[torch.dtype] = None,
                      out: Optional[Mapping[str, torch.Tensor]] = None) -> torch.futures.Future:
    """Compress, communicate and decode ``tensors`` (name -> local gradient) without waiting:
    a future of name -> synchronized tensor (float32 and the input's shape, or the tensor of
    ``out`` it was written into, cast to that tensor's dtype). The call's turn comes once the
    previous call on ``comm`` has issued its last collective: at once in the caller's thread
    when ``comm`` is free, else on the thread that freed it. It then encodes and issues the
    first round with ``async_op=True``; each round is decoded in a callback, which issues the
    next. ``tensors`` (and ``out``) must stay untouched until the future completes. Errors (a
    bad input, a failed collective) complete the future with the exception. Collective:
    every rank must call it with the same names in the same order."""
    comm = comm or Comm()
    comm.check(compressor)
    check_wire_dtype(wire_dtype, "synchronize_async")
    if out is not None and set(out) != set(tensors):
        raise ValueError(f"synchronize_async: out names {sorted(out)[:3]} differ from the "
                         f"tensors' {sorted(tensors)[:3]}")
    world = comm.world
    threads = torch.get_num_threads()
    tensors, dests = dict(tensors), dict(out or {})
    # on CUDA the callbacks run on side streams: a device-aware future makes its waiters wait
    # for the kernels that wrote the results
    devices = sorted({t.device for t in tensors.values() if t.device.type == "cuda"}, key=str)
    result = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
    done: dict[str, torch.Tensor] = {}

    def fail(err: BaseException, release: Release) -> None:
        release()
        if not result.done():
            result.set_exception(err)

    def issue(messages: dict[str, Message], round_: int, release: Release) -> None:
        keys = list(messages)
        fut = comm.run_async([messages[k] for k in keys], wire_dtype=wire_dtype)
        if round_ >= compressor.rounds:
            release()                                   # no compressor has a further round
        fut.add_done_callback(lambda f: decode(f, keys, messages, round_, release))

    def decode(fut: torch.futures.Future, keys: list[str], messages: dict[str, Message],
               round_: int, release: Release) -> None:
        try:
            torch.set_num_threads(threads)            # as in start()
            nxt = {}
            for k, reduced in zip(keys, fut.value()):
                value = compressor.decode(k, messages[k], reduced, world, out=dests.get(k))
                if isinstance(value, Message):
                    nxt[k] = value
                else:
                    done[k] = _written(value, dests.get(k))
            if nxt:
                issue(nxt, round_ + 1, release)
                return
            release()
            result.set_result({k: done[k] for k in tensors})
        except BaseException as e:  # noqa: BLE001 - reported through the future
            fail(e, release)

    def start(release: Release) -> None:
        try:
            # This may run on a collective's callback thread. MKL picks its GEMM kernels by
            # the calling thread's own setting (a thread that never called set_num_threads
            # rounds the rows of a small-K product differently), so without this the result
            # would depend on which thread ran: the caller's setting makes every thread compute
            # as the caller would, bit for bit.
            torch.set_num_threads(threads)
            pending = {k: compressor.encode(k, t, world) for k, t in tensors.items()}
            if pending:
                issue(pending, 1, release)
            else:
                release()
                result.set_result({})
        except BaseException as e:  # noqa: BLE001 - reported through the future
            fail(e, release)

    comm.lane.submit(start)
    return result


def _written(value: torch.Tensor, dest: Optional[torch.Tensor]) -> torch.Tensor:
    """``value`` in ``dest`` (when given and not already written there)."""
    if dest is None or value is dest:
        return value
    return dest.copy_(value.reshape(dest.shape))


def synchronize(compressor: Compressor, tensors: Mapping[str, torch.Tensor],
                comm: Optional[Comm] = None, *, wire_dtype: Optional[torch.dtype] = None
                ) -> dict[str, torch.Tensor]:
    """Compress, communicate and decode ``tensors`` (name -> local gradient); returns name ->
    synchronized tensor (float32, the input's shape): :func:`synchronize_async`, waited for.
    Collective: every rank must call it with the same names in the same order."""
    return synchronize_async(compressor, tensors, comm, wire_dtype=wire_dtype).wait()

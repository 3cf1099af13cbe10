"""Process groups and multi-rank launch, through ``torch.distributed`` only.

Every process group tidal starts goes through :func:`init_rank_group`: gloo on the CPU; on
CUDA, NCCL, with the rank's GPU (``cuda:<local rank>``) made current *before* the group is
initialised and bound to it (``device_id``), so NCCL never guesses a device. A group has a
timeout (:data:`DEFAULT_TIMEOUT_S`), so a stalled peer fails cleanly.
``init_process_group_from_env`` joins the group ``torchrun`` set up. ``spawn`` runs a function
on N local ranks for tests and benchmarks (gloo, or NCCL with ``device="cuda"``, one GPU per
rank): each rank gets one thread, a process group over a TCPStore on 127.0.0.1, and the result
of every rank comes back to the caller; a rank that raises or dies becomes a ``RankError``
naming the rank, never a hang. ``single_rank_group`` is a group of one in this process.

A collective takes its tensors on the group's device, :func:`collective_device`: the current
CUDA device for NCCL (which refuses CPU tensors), the CPU for gloo. Every flag, scalar or buffer
tidal builds for a collective is made there.

Example:
    >>> from tidal.runtime.distributed import collective_device, single_rank_group, spawn
    >>> def world(rank, size):
    ...     import torch, torch.distributed as dist
    ...     t = torch.tensor([rank + 1.0])
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> spawn(world, 2)  # doctest: +SKIP
    [3.0, 3.0]
    >>> with single_rank_group("cpu") as device:
    ...     device, collective_device()
    (device(type='cpu'), device(type='cpu'))
"""
from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue
import socket
import tempfile
import traceback
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tidal.ir.errors import TidalError

DEFAULT_TIMEOUT_S = 60.0


class RankError(TidalError):
    """A rank raised, died, or did not finish in time. ``rank`` is the first rank at fault."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def backend_for(device: torch.device | str | None = None) -> str:
    """``nccl`` for CUDA devices, else ``gloo``."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return "nccl" if dev.type == "cuda" else "gloo"


def collective_device(group: Any = None) -> torch.device:
    """The device the collectives of ``group`` (None: the default group) take their tensors
    on: the current CUDA device when the group's backend is NCCL, else the CPU (gloo, or no
    process group at all).

    Example:
        >>> collective_device()        # no process group here
        device(type='cpu')
    """
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group))
    # "nccl", or a per-device list such as "cpu:gloo,cuda:nccl" (a group for both)
    if backend == "nccl" or "cuda:nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_device(device: torch.device | str | None, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank`` on its machine: the CPU stays the CPU; CUDA
    without an index is ``cuda:<local_rank>`` (one GPU per rank); an index given is kept.

    Example:
        >>> rank_device("cuda", 3), rank_device("cuda:0", 3), rank_device(None, 3)
        (device(type='cuda', index=3), device(type='cuda', index=0), device(type='cpu'))
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", local_rank)
    return dev


def init_rank_group(device: torch.device | str | None, rank: int, world_size: int, *,
                    local_rank: Optional[int] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                    store: Any = None) -> torch.device:
    """Initialise the default process group for this rank on ``device`` (its backend from
    :func:`backend_for`) with a timeout of ``timeout_s``, over ``store`` (default: the
    ``env://`` rendezvous, ``MASTER_ADDR``/``MASTER_PORT``). On CUDA the rank's GPU
    (:func:`rank_device` of ``local_rank``, default ``rank``) is made current first and the
    group is bound to it. Returns the rank's device. Raises ``RankError`` naming the rank when
    that GPU does not exist."""
    dev = rank_device(device, rank if local_rank is None else local_rank)
    options: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if store is not None:
        options["store"] = store
    if dev.type == "cuda":
        visible = torch.cuda.device_count()
        if dev.index >= visible:
            raise RankError(f"rank {rank}: device {dev} does not exist ({visible} CUDA "
                            "device(s) visible); NCCL needs one GPU per rank", rank)
        torch.cuda.set_device(dev)          # before the group: NCCL's communicator uses it
        options["device_id"] = dev
    dist.init_process_group(backend_for(dev), rank=rank, world_size=world_size, **options)
    return dev


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def group_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (None: the default group); 1 without a process group.

    Example:
        >>> group_size()        # no process group here
        1
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_timeout_s(group: Any = None) -> Optional[float]:
    """The timeout of ``group``'s collectives in seconds (None: the default group), or None
    without a process group or when the backend does not say.

    Example:
        >>> group_timeout_s() is None     # no process group here
        True
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(collective_device(group))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return None


def rank_and_size() -> tuple[int, int]:
    """(rank, world size) of the default group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_process_group_from_env(device: torch.device | str | None = None,
                                timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Join the process group ``torchrun`` describes in the environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) on ``device`` (CUDA: the
    ``LOCAL_RANK``-th GPU, :func:`init_rank_group`); a no-op when already initialised or when
    not launched by torchrun. Returns whether a group is initialised."""
    if dist.is_initialized():
        return True
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return False
    rank = int(os.environ["RANK"])
    init_rank_group(device, rank, int(os.environ["WORLD_SIZE"]),
                    local_rank=int(os.environ.get("LOCAL_RANK", rank)), timeout_s=timeout_s)
    return True


@contextlib.contextmanager
def single_rank_group(device: torch.device | str | None = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[torch.device]:
    """A default process group of one rank in this process on ``device`` (gloo on the CPU,
    NCCL on CUDA, :func:`init_rank_group`) over a ``FileStore`` in a temporary folder, for the
    duration of the block; yields the rank's device. Raises ``RuntimeError`` when a process
    group is already initialised (it is not this block's to replace)."""
    if dist.is_initialized():
        raise RuntimeError("single_rank_group: a process group is already initialised in this "
                           "process; destroy it first or use it")
    with tempfile.TemporaryDirectory(prefix="tidal-store-") as folder:
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dev = init_rank_group(device, 0, 1, local_rank=0, timeout_s=timeout_s, store=store)
        try:
            yield dev
        finally:
            dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, timeout_s: float, fn: Callable, args: tuple,
            results: Any, device: torch.device | str | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        init_rank_group(device, rank, size, local_rank=rank, timeout_s=timeout_s)
        try:
            # plain pickle bytes: tensors travel by value, not as shared-memory handles that
            # vanish when this process exits before the parent reads them
            results.put((rank, "ok", pickle.dumps(fn(rank, size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # report every failure to the parent, then exit
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


_SECONDARY = ("Connection reset", "Connection closed", "DistBackendError", "gloo/transport")


def _root_cause(errors: dict[int, str], results: Any, grace_s: float = 2.0) -> RankError:
    """Collect the other ranks' errors for a moment and blame the rank whose error is not a
    consequence of a peer going away (a reset connection, a failed collective)."""
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=grace_s)
    while datetime.datetime.now() < deadline:
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            continue
        if status == "error":
            errors[rank] = value
    primary = [r for r, e in errors.items() if not any(m in e.split("\n")[0] for m in _SECONDARY)]
    rank = min(primary or errors)
    others = "; ".join(f"rank {r}: {e.splitlines()[0][:120]}" for r, e in sorted(errors.items())
                       if r != rank)
    return RankError(f"rank {rank} failed: {errors[rank]}" + (f"\n(also {others})" if others else ""),
                     rank)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any,
          timeout_s: float = DEFAULT_TIMEOUT_S * 3, pg_timeout_s: float = DEFAULT_TIMEOUT_S,
          device: torch.device | str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks and return the ranks'
    results in rank order: gloo ranks on the CPU (``device`` None or ``"cpu"``), NCCL ranks
    with ``device="cuda"``, rank ``r`` on ``cuda:r`` (:func:`init_rank_group`; a
    ``ValueError`` when fewer GPUs are visible). ``fn`` must be picklable (module level).
    Raises ``RankError`` if a rank raises, exits without a result, or the whole run exceeds
    ``timeout_s``; the other ranks are then terminated."""
    if world_size < 1:
        raise ValueError(f"spawn(world_size={world_size}): need at least one rank")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        if dev.index is not None and world_size > 1:
            raise ValueError(f"spawn(device={str(dev)!r}, world_size={world_size}): NCCL "
                             "needs one GPU per rank; give device='cuda'")
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) + world_size > visible:
            raise ValueError(f"spawn(world_size={world_size}, device={str(dev)!r}): NCCL "
                             f"needs one GPU per rank, {visible} visible")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, pg_timeout_s, fn, args,
                                              results, dev), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out
                        and p.exitcode not in (None, 0)]
                if dead:
                    raise RankError(f"rank {dead[0]} died with exit code "
                                    f"{procs[dead[0]].exitcode} before returning", dead[0])
                if datetime.datetime.now() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise RankError(f"ranks {missing} did not finish within {timeout_s:.0f} s",
                                    missing[0])
                continue
            if status == "error":
                raise _root_cause({rank: value}, results)
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [out[r] for r in range(world_size)]


def world_size_or(default: Optional[int] = None) -> int:
    """The world size of the initialised group, else ``WORLD_SIZE`` from the environment,
    else ``default`` (1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", default or 1))


def copy_from_flat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of the 1-D ``flat`` back into ``tensors`` (their order and
    sizes, as ``torch.cat([t.reshape(-1) for t in tensors])`` laid them out)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int, group: Any = None) -> None:
    """Give every rank of ``group`` global rank ``src``'s ``tensors``, in place: one flat
    broadcast per dtype on the group's device (:func:`collective_device`), as DDP coalesces
    its buffers, not one per tensor (a round trip each: the 160 BatchNorm buffers of
    ``resnet50_small`` took 22 ms a step that way on 2 gloo ranks, 80 ms on 4). The ranks
    pass the same tensors in the same order (their dtypes group them alike)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    device = collective_device(group)
    receives = dist.get_rank() != src
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        if flat.device != device:
            flat = flat.to(device)
        dist.broadcast(flat, src=src, group=group)
        if receives:
            copy_from_flat(flat, same)


def all_reduce_tensors(tensors: list[torch.Tensor], group: Any = None,
                       average: bool = False) -> None:
    """Sum (or with ``average``, average) ``tensors`` over the ranks of ``group`` in place,
    as one flat all-reduce on the group's device (:func:`collective_device`; the results are
    copied back to wherever ``tensors`` live)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    device = collective_device(group)
    if flat.device != device:
        flat = flat.to(device)
    dist.all_reduce(flat, group=group)
    if average:
        flat /= dist.get_world_size(group)
    copy_from_flat(flat, tensors)

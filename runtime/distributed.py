"""Process groups and multi-rank launch, through ``torch.distributed`` only.

``init_process_group_from_env`` joins the group ``torchrun`` set up (gloo on CPU, NCCL on
CUDA) with a timeout. ``spawn`` runs a function on N local ranks for tests and benchmarks: each
rank gets one thread, a process group with a timeout over a TCPStore on 127.0.0.1, and the
result of every rank comes back to the caller; a rank that raises or dies becomes a
``RankError`` naming the rank, never a hang.

Example:
    >>> from tidal.runtime.distributed import spawn
    >>> def world(rank, size):
    ...     import torch, torch.distributed as dist
    ...     t = torch.tensor([rank + 1.0])
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> spawn(world, 2)  # doctest: +SKIP
    [3.0, 3.0]
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable, Optional

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


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_size() -> tuple[int, int]:
    """(rank, world size) of the default group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_process_group_from_env(device: torch.device | str | None = None,
                                timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Join the process group ``torchrun`` describes in the environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``); a no-op when already initialised or when
    not launched by torchrun. Returns whether a group is initialised."""
    if dist.is_initialized():
        return True
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return False
    dist.init_process_group(backend_for(device),
                            timeout=datetime.timedelta(seconds=timeout_s))
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, timeout_s: float, fn: Callable, args: tuple,
            results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
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
          timeout_s: float = DEFAULT_TIMEOUT_S * 3, pg_timeout_s: float = DEFAULT_TIMEOUT_S
          ) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo ranks and return the
    ranks' results in rank order. ``fn`` must be picklable (module level). Raises
    ``RankError`` if a rank raises, exits without a result, or the whole run exceeds
    ``timeout_s``; the other ranks are then terminated."""
    if world_size < 1:
        raise ValueError(f"spawn(world_size={world_size}): need at least one rank")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, pg_timeout_s, fn, args,
                                              results), daemon=True)
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


def all_reduce_tensors(tensors: list[torch.Tensor], group: Any = None,
                       average: bool = False) -> None:
    """Sum (or with ``average``, average) ``tensors`` over the ranks of ``group`` in place,
    as one flat all-reduce."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    if average:
        flat /= dist.get_world_size(group)
    copy_from_flat(flat, tensors)

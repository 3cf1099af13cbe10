"""Batch redistribution between GPU sets: the ``tidal::scatter`` and ``tidal::gather`` ops, and a
cache of process subgroups.

A *layout* says which rows (samples) of a batch each rank holds: a flat list
``[lo_0, hi_0, lo_1, hi_1, ...]`` with one ``[lo, hi)`` range per rank of the world (``lo ==
hi``: the rank holds no rows, it skips the layer). ``replicated(B, W)`` is every rank holding
all ``B`` rows (a model input, the model output). ``scatter(x, src, dst)`` and
``gather(x, src, dst)`` move rows so each rank ends up with its ``dst`` rows: a rank takes rows
it already holds from itself, others from the lowest rank that holds them (point-to-point
sends on the default group, so every rank must call the op, in the same order). They are the
same operation under two names: ``scatter`` when the GPU set grows, ``gather`` when it shrinks;
each one's backward is the other with the layouts swapped, so gradients flow back to the rows'
owners. Without a process group (or with one rank) both are the identity (a copy), so a
rewritten graph runs in one process with the original semantics.

Example:
    >>> import torch
    >>> from tidal.ir import collectives
    >>> x = torch.randn(4, 3, requires_grad=True)
    >>> src, dst = collectives.layout([(0, 4), (0, 0)]), collectives.layout([(0, 2), (2, 4)])
    >>> y = torch.ops.tidal.scatter(x, src, dst)   # one process: the identity
    >>> torch.equal(y, x), y.sum().backward(), torch.equal(x.grad, torch.ones(4, 3))
    (True, None, True)
    >>> collectives.transfers(src, dst)            # what would move on two ranks
    [(0, 0, 0, 2), (0, 1, 2, 4)]
"""
from __future__ import annotations

import datetime
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from tidal.ir.errors import PlanError

FALLBACK_TIMEOUT_S = 60.0
"""The timeout of a new group when the world group's cannot be read."""


def layout(ranges: Iterable[tuple[int, int]]) -> list[int]:
    """The flat layout list for per-rank ``[lo, hi)`` ranges."""
    out: list[int] = []
    for lo, hi in ranges:
        if not 0 <= lo <= hi:
            raise ValueError(f"layout: bad row range [{lo}, {hi})")
        out += [int(lo), int(hi)]
    return out


def replicated(batch: int, world: int) -> list[int]:
    """Every one of ``world`` ranks holds all ``batch`` rows."""
    return layout([(0, batch)] * world)


def _ranges(flat: Sequence[int]) -> list[tuple[int, int]]:
    if len(flat) % 2:
        raise ValueError(f"layout {list(flat)} has an odd length")
    return [(int(flat[k]), int(flat[k + 1])) for k in range(0, len(flat), 2)]


def transfers(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """Row moves ``(from_rank, to_rank, lo, hi)`` that turn layout ``src`` into ``dst``, in
    destination row order. Raises ``ValueError`` when a needed row is held by no rank."""
    s, d = _ranges(src), _ranges(dst)
    if len(s) != len(d):
        raise ValueError(f"layouts for {len(s)} and {len(d)} ranks")
    out = []
    for to, (lo, hi) in enumerate(d):
        pos = lo
        while pos < hi:
            own_lo, own_hi = s[to]
            if own_lo <= pos < own_hi:
                frm, end = to, min(hi, own_hi)
            else:
                holders = [r for r, (a, b) in enumerate(s) if a <= pos < b]
                if not holders:
                    raise ValueError(f"row {pos} is needed by rank {to} but held by no rank "
                                     f"(src layout {list(src)})")
                frm = holders[0]
                end = min(hi, s[frm][1])
                if own_lo < own_hi and own_lo > pos:
                    end = min(end, own_lo)  # the rank's own rows resume there
            out.append((frm, to, pos, end))
            pos = end
    return out


def _world() -> Optional[tuple[int, int]]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def _redistribute(x: torch.Tensor, src: Sequence[int], dst: Sequence[int]) -> torch.Tensor:
    world = _world()
    if world is None:
        return x.clone()
    rank, size = world
    if len(src) != 2 * size or len(dst) != 2 * size:
        raise ValueError(f"tidal redistribution: layout for {len(src) // 2} ranks on a world "
                         f"of {size}")
    s_lo, s_hi = src[2 * rank], src[2 * rank + 1]
    if x.shape[0] != s_hi - s_lo:
        raise ValueError(f"tidal redistribution on rank {rank}: input has {x.shape[0]} rows, "
                         f"the layout says [{s_lo}, {s_hi})")
    x = x.contiguous()
    pieces, reqs = [], []
    for frm, to, lo, hi in transfers(src, dst):
        if frm == rank and to != rank:
            reqs.append(dist.isend(x[lo - s_lo:hi - s_lo].contiguous(), dst=to))
        elif to == rank and frm != rank:
            buf = x.new_empty((hi - lo,) + tuple(x.shape[1:]))
            reqs.append(dist.irecv(buf, src=frm))
            pieces.append(buf)
        elif to == rank:
            pieces.append(x[lo - s_lo:hi - s_lo])
    for r in reqs:
        r.wait()
    d_lo, d_hi = dst[2 * rank], dst[2 * rank + 1]
    if not pieces:
        return x.new_empty((d_hi - d_lo,) + tuple(x.shape[1:]))
    return torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0].clone()


def rows_like(x: torch.Tensor, src: Sequence[int], dst: Sequence[int]) -> torch.Tensor:
    """A stand-in for ``x`` (layout ``src``) with the rows this rank holds under ``dst``, for
    code that reads only its shape, dtype or device (``x.size(0)`` on another GPU set): an
    uninitialised tensor, no data moves. Without a process group: ``x`` itself."""
    world = _world()
    if world is None:
        return x
    rank = world[0]
    return x.new_empty((dst[2 * rank + 1] - dst[2 * rank],) + tuple(x.shape[1:]))


def _fake(x: torch.Tensor, src: Sequence[int], dst: Sequence[int]) -> torch.Tensor:
    world = _world()
    rows = x.shape[0] if world is None else dst[2 * world[0] + 1] - dst[2 * world[0]]
    return x.new_empty((rows,) + tuple(x.shape[1:]))


@torch.library.custom_op("tidal::scatter", mutates_args=())
def scatter(x: torch.Tensor, src: list[int], dst: list[int]) -> torch.Tensor:
    """Move the batch rows of ``x`` from layout ``src`` to a larger GPU set ``dst``."""
    return _redistribute(x, src, dst)


@torch.library.custom_op("tidal::gather", mutates_args=())
def gather(x: torch.Tensor, src: list[int], dst: list[int]) -> torch.Tensor:
    """Move the batch rows of ``x`` from layout ``src`` to a smaller GPU set ``dst`` (or to
    every rank: ``dst = replicated(B, W)``)."""
    return _redistribute(x, src, dst)


scatter.register_fake(_fake)
gather.register_fake(_fake)


def _setup(ctx, inputs, output) -> None:
    ctx.src, ctx.dst = inputs[1], inputs[2]


def _scatter_backward(ctx, grad):
    return torch.ops.tidal.gather(grad, ctx.dst, ctx.src), None, None


def _gather_backward(ctx, grad):
    return torch.ops.tidal.scatter(grad, ctx.dst, ctx.src), None, None


scatter.register_autograd(_scatter_backward, setup_context=_setup)
gather.register_autograd(_gather_backward, setup_context=_setup)

SCATTER = torch.ops.tidal.scatter.default
"""The op overload a pass inserts where a layer's GPU set grows."""
GATHER = torch.ops.tidal.gather.default
"""The op overload a pass inserts where a layer's GPU set shrinks."""


def check_layer_ranks(layer_ranks: Iterable[tuple[str, tuple[int, ...]]], size: int,
                      where: str = "the world") -> None:
    """Raise ``PlanError`` naming the first layer that needs more GPUs than ``size`` (the
    cluster's GPUs or the job's ranks, as ``where`` says) or runs on ranks that are not
    distinct ranks ``0 .. size - 1``."""
    for name, ranks in layer_ranks:
        if len(ranks) > size:
            raise PlanError(f"burst_parallel: layer {name!r} needs {len(ranks)} GPUs, but "
                            f"{where} has {size}")
        if len(set(ranks)) != len(ranks) or not all(0 <= r < size for r in ranks):
            raise PlanError(f"burst_parallel: layer {name!r} runs on ranks {list(ranks)}, not "
                            f"distinct ranks among the {size} GPUs {where} has")


def world_timeout() -> datetime.timedelta:
    """The timeout of the initialised default (world) process group, as given to
    ``init_process_group`` (read from its backend's options; ``FALLBACK_TIMEOUT_S`` when the
    backend does not expose it)."""
    pg = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
    return datetime.timedelta(seconds=FALLBACK_TIMEOUT_S)


def new_group(ranks: Optional[Sequence[int]] = None, backend: Optional[str] = None) -> Any:
    """``dist.new_group`` with the world group's timeout (torch's default is 30 minutes, so a
    stalled peer would block a subgroup's collective that long instead of failing cleanly).
    Every process group tidal creates goes through here."""
    return dist.new_group(None if ranks is None else list(ranks), timeout=world_timeout(),
                          backend=backend)


class SubgroupCache:
    """Process subgroups by rank tuple, created once (``dist.new_group`` must be called by every
    rank in the same order, so ``create`` takes every set up front)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], object] = {}

    def create(self, rank_sets: Iterable[Sequence[int]]) -> None:
        """Create the groups for ``rank_sets`` not made yet, in sorted order, on every rank."""
        world = _world()
        size = 1 if world is None else world[1]
        for ranks in sorted({tuple(r) for r in rank_sets}):
            if ranks not in self._groups and len(ranks) < size:
                self._groups[ranks] = new_group(ranks)

    def get(self, ranks: Sequence[int]):
        """The group of ``ranks`` (None: the default group, for the whole world)."""
        ranks = tuple(ranks)
        world = _world()
        if world is None or len(ranks) == world[1]:
            return None
        if ranks not in self._groups:
            raise KeyError(f"no subgroup for ranks {ranks}: call SubgroupCache.create first")
        return self._groups[ranks]

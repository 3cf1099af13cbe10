"""What keeps the ranks' replicas equal besides the gradient sync: rank 0's state broadcast
(:func:`broadcast_state`), the floating-point buffers averaged (:func:`average_buffers`:
BatchNorm's running statistics, each rank updated from its own batch) and the step's loss
reduced over the ranks (:func:`reduce_loss`; given the step's number, the same all-reduce
checks that every rank is on that step, :class:`~tidal.runtime.programs.step_failures.
StepMismatchError` otherwise, and given the step's batch check, that every rank got the same
global batch, :class:`~tidal.runtime.batch_data.BatchError` otherwise). Each is a no-op in one
process.

Example:
    >>> import torch
    >>> bn = torch.nn.BatchNorm1d(2)
    >>> broadcast_state(bn, params=True); average_buffers(bn.buffers())   # one process
    >>> reduce_loss(torch.tensor(2.0, requires_grad=True))
    tensor(2.)
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from tidal.runtime.batch_data import BatchCheck
from tidal.runtime.distributed import (all_reduce_tensors, broadcast_tensors,
                                      collective_device, group_size)
from tidal.runtime.programs.step_failures import check_steps


def broadcast_state(model: torch.nn.Module, params: bool,
                    group: Optional[dist.ProcessGroup] = None) -> None:
    """Give every rank of ``group`` rank 0's buffers (BatchNorm statistics each rank updated
    from its own shard) and, with ``params``, its parameters (before the first step)."""
    if group_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    broadcast_tensors(list(model.buffers()) + ([p.data for p in model.parameters()]
                                               if params else []), src, group)


def average_buffers(buffers: Iterable[torch.Tensor],
                    group: Optional[dist.ProcessGroup] = None) -> None:
    """Average the floating-point ones of ``buffers`` over the ranks of ``group``, in place."""
    if group_size(group) > 1:
        all_reduce_tensors([b for b in buffers if b.is_floating_point()], group, average=True)


def reduce_loss(loss: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                mean: bool = True, step: Optional[int] = None, who: str = "",
                batch: Optional[BatchCheck] = None) -> torch.Tensor:
    """A detached copy of ``loss`` summed over the ranks of ``group`` (with ``mean``: averaged:
    each rank's loss is that of its own shard). With ``step`` (this rank's step number), the
    same all-reduce carries ``step`` and ``step ** 2`` beside the loss (float64, exact below
    2 ** 26 steps): the ranks agree when ``world * sum(step ** 2) == sum(step) ** 2``; when
    they do not (every rank sees the same sums), one more all-gather names every rank's step
    and a ``StepMismatchError`` of pass ``who`` is raised on every rank. With ``batch`` (the
    step's :class:`~tidal.runtime.batch_data.BatchCheck`), its values ride on it too, checked
    the same way: ranks whose global batches differ raise its ``BatchError`` on every rank
    (after one all-gather that names the input), with no round of its own."""
    return reduce_loss_async(loss, group, mean, step, who, batch)()


def _uniform(total: float, squares: float, world: int) -> bool:
    """Whether ``world`` ranks' integers (summed: ``total``, their squares summed:
    ``squares``, each below ``2 ** 53``) are all equal: ``world * squares == total ** 2``,
    in Python integers (exact; Cauchy-Schwarz: equality iff every value is the mean).

    Example:
        >>> _uniform(6.0, 18.0, 2), _uniform(6.0, 20.0, 2)   # [3, 3], then [2, 4]
        (True, False)
    """
    return world * int(squares) == int(total) ** 2


def reduce_loss_async(loss: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                      mean: bool = True, step: Optional[int] = None, who: str = "",
                      batch: Optional[BatchCheck] = None) -> Callable[[], torch.Tensor]:
    """:func:`reduce_loss` issued now, without waiting (the all-reduce runs beside what the
    caller does next, as DDP's buckets run beside backward); the function returned waits for
    it and gives the reduced loss (raising as :func:`reduce_loss` does).

    >>> reduce_loss_async(torch.tensor(2.0))()   # one process: the loss itself
    tensor(2.)
    """
    out = loss.detach().clone()
    world = group_size(group)
    if world == 1:
        return lambda: out
    device = collective_device(group)
    if batch is not None and group_size(batch.group) != world:   # it covers fewer ranks
        batch.exchange()
        batch = None
    extra = ([] if step is None else [float(step), float(step * step)]) + \
        ([] if batch is None else batch.values())
    if extra:
        sums = torch.cat([out.reshape(-1).to(device, torch.float64),
                          torch.tensor(extra, dtype=torch.float64, device=device)])
    else:
        sums = out.reshape(-1).to(device)
    work = dist.all_reduce(sums, group=group, async_op=True)

    def result() -> torch.Tensor:
        work.wait()
        tail = sums[out.numel():].tolist()
        if step is not None:
            if not _uniform(tail[0], tail[1], world):
                steps = torch.zeros(world, dtype=torch.int64, device=device)
                dist.all_gather_into_tensor(steps, torch.tensor([step], device=device),
                                            group=group)
                check_steps(who or "the loss all-reduce", step, steps.tolist())
            tail = tail[2:]
        if batch is not None and not (_uniform(tail[0], tail[1], world) and
                                      _uniform(tail[2], tail[3], world)):
            raise batch.mismatch(group)
        reduced = sums[:out.numel()].view(out.shape).to(out.dtype)
        return (reduced / world if mean else reduced).to(out.device)
    return result

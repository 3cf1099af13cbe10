"""Clipping by the global norm of gradients spread over ranks (``burst_parallel``: each rank
holds the gradients of the layers it runs, each parameter counted by one rank only):
:func:`clip_by_global_norm_`, as ``torch.nn.utils.clip_grad_norm_`` on one process.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from tidal.runtime.distributed import collective_device, is_distributed
from tidal.runtime.programs.step_failures import collective_errors


def clip_by_global_norm_(counted: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                         max_norm: float, norm_type: float = 2.0,
                         group: Optional[dist.ProcessGroup] = None,
                         who: str = "burst_parallel") -> torch.Tensor:
    """Clip ``grads`` (this rank's gradients) in place by the global ``norm_type`` norm of
    the gradients every rank of ``group`` counts (``counted``: this rank's share, each gradient
    counted by one rank only), as ``torch.nn.utils.clip_grad_norm_`` on one process: one
    all-reduce of the partial sums of ``|g|^p`` (MAX for the ``inf`` norm), then every rank
    scales its gradients by ``max_norm / (total + 1e-6)`` clamped to 1. Returns the total, the
    same on every rank: NaN when some rank's gradients hold a NaN, else ``inf`` when one holds
    an ``inf`` (skip the optimizer's step then, on every rank). No all-reduce without a
    process group; ``who`` names the caller in errors.

    >>> g = [torch.full((4,), 2.0)]                 # norm 4
    >>> clip_by_global_norm_(g, g, 1.0).item(), round(g[0][0].item(), 4)
    (4.0, 0.5)
    >>> clip_by_global_norm_([torch.tensor([1.0, float("inf")])], [], 1.0).item()
    inf
    """
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"{who}: clip_grad_norm_(norm_type={norm_type!r}): a norm of "
                         f"order > 0 (or inf)")
    inf = math.isinf(p)
    device = collective_device(group)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), p, dtype=torch.float64).to(device)
                         for g in counted] + [torch.zeros((), dtype=torch.float64,
                                                          device=device)])
    value = norms.amax() if inf else norms.pow(p).sum()
    partial = torch.stack([value, norms.isnan().sum().double(), norms.isinf().sum().double()])
    if is_distributed():
        with collective_errors(who, "the all-reduce of clip_grad_norm_'s partial norms"):
            dist.all_reduce(partial, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                            group=group)
    value, nans, infs = partial.tolist()
    total = math.nan if nans else math.inf if infs else value if inf else value ** (1 / p)
    like = grads[0] if grads else counted[0] if counted else torch.zeros(())
    out = torch.tensor(total, dtype=like.dtype, device=like.device)
    coef = min(max_norm / (total + 1e-6), 1.0) if not math.isnan(total) else math.nan
    for g in grads:
        g.detach().mul_(coef)
    return out

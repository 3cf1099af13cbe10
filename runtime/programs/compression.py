"""The ``compression`` pass's plan as a program: data parallelism with compressed gradient sync.

A ``CompressionPlan`` that wraps no parallelism pass is data-parallel training:
:func:`from_plan` gives the :class:`~tidal.runtime.programs.data_parallel.DataParallelProgram`
whose ``sync <b>`` comm pieces run the plan's compressor on each bucket (encode, collective,
decode with error feedback; a plain averaging all-reduce when compression is off), overlapping
the rest of backward, with Accordion's window decision after the optimizer when the plan asks
for it. After a parallelism pass, the plan changes that pass's executor instead
(:func:`compression_executor`): a factory of :class:`~tidal.runtime.comm.grad_sync.GradSync` built
from the plan goes to its ``use_grad_sync`` (``tick_tock`` keeps one compressor state per wave,
``burst_parallel`` one per set of ranks that syncs a layer, ``round_robin`` one per partition).

Example:
    >>> import torch
    >>> from tidal.ir.plans.compression import CompressionPlan
    >>> from tidal.runtime.programs.compression import compression_executor
    >>> model = torch.nn.Linear(8, 3)
    >>> plan = CompressionPlan(compressor="topk:0.25", mode="on", enabled=True,
    ...                        bucket_bytes=25 * 2**20, buckets=(("bias", "weight"),),
    ...                        grad_bytes=108, payload_bytes=56)
    >>> ex = compression_executor(plan, None)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    >>> loss = ex.step(model, model, (x,), y, torch.nn.functional.cross_entropy, opt)
    >>> type(ex.rank_program).__name__, ex.compressor.spec()
    ('DataParallelProgram', 'topk:0.25')
    >>> ex.comm.bytes_sent                                      # 1 + 6 values, 1 + 6 indices
    56
    >>> [p.name for p in ex.last_program.pieces]
    ['broadcast', 'segment 0', 'sync 0', 'optimizer']
"""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
import torch.fx as fx

from tidal.ir.errors import PassError
from tidal.ir.pass_api import Executor
from tidal.runtime.comm.accordion import Accordion, LrLookahead
from tidal.runtime.comm.compressors import make_compressor
from tidal.runtime.comm.grad_sync import GradSync, GradSyncFactory
from tidal.runtime.program import ProgramExecutor
from tidal.runtime.programs.data_parallel import DataParallelProgram

PLAN_KIND = "CompressionPlan"


def from_plan(gm: Optional[fx.GraphModule], plan: Any,
              group: Optional[dist.ProcessGroup] = None) -> DataParallelProgram:
    """The rank program of a ``CompressionPlan`` that wraps no parallelism pass (``gm`` is not
    needed: the program captures the graph it is given at each step). Raises ``PassError``
    when the plan wraps one (its sync goes to that pass's executor:
    :func:`compression_executor`)."""
    if plan.wraps is not None:
        raise PassError(f"pass 'compression': the plan wraps the gradient sync of "
                        f"{plan.wraps!r}, but no executor was built for {plan.wraps!r}")
    accordion = None
    levels = plan.accordion_levels if plan.enabled else None
    if levels is not None:
        accordion = Accordion(*levels, eta=plan.accordion[2], group=group)
    lookahead = None
    if accordion is not None and plan.accordion_lr_horizon:
        lookahead = LrLookahead.from_decays(plan.accordion_lr_decays, plan.accordion_lr_horizon)
    return DataParallelProgram(make_compressor(plan.sync_compressor), buckets=plan.buckets,
                               bucket_bytes=plan.bucket_bytes, accordion=accordion,
                               accordion_interval=plan.accordion[3] if accordion else 100,
                               lr_lookahead=lookahead, group=group)


def grad_sync_factory(plan: Any) -> GradSyncFactory:
    """``group -> GradSync`` with a fresh compressor of the plan (its spec, or plain all-reduce
    when compression is off) and the plan's bucket cap: one per group a parallelism executor
    syncs on."""
    spec, bucket_bytes = plan.sync_compressor, plan.bucket_bytes

    def factory(group: Optional[dist.ProcessGroup]) -> GradSync:
        return GradSync(make_compressor(spec), bucket_bytes=bucket_bytes, group=group)

    return factory


def compression_executor(plan: Any, host: Optional[Executor]) -> Executor:
    """The executor that runs ``plan`` (a ``CompressionPlan``): with no ``host`` (the executor
    an earlier parallelism pass's plan gave), the ``ProgramExecutor`` of :func:`from_plan`'s
    program; else ``host`` itself, its gradient sync replaced through ``host.use_grad_sync``
    by :func:`grad_sync_factory` (a ``ProgramExecutor`` hands it to its rank program). Raises
    ``PassError`` when Accordion is asked for on top of a host (it needs this module's own
    program), when ``host`` takes no gradient sync, or when the plan wraps a parallelism pass
    but no executor was built for it."""
    if host is None:
        return ProgramExecutor(from_plan(None, plan))
    what = type(getattr(host, "rank_program", host)).__name__   # a ProgramExecutor's program
    where = repr(plan.wraps) if plan.wraps is not None else what
    if plan.enabled and plan.accordion is not None:
        raise PassError(f"pass 'compression': accordion switching runs in the compression "
                        f"pass's own data-parallel program; it is not available on top of "
                        f"{where}")
    if not callable(getattr(host, "use_grad_sync", None)):
        raise PassError(f"pass 'compression' wraps the gradient sync of a parallelism pass, but "
                        f"{where}'s executor ({what}) does not take one (no use_grad_sync)")
    host.use_grad_sync(grad_sync_factory(plan))
    return host

"""Data-parallel training with compressed gradient sync, built from a ``CompressionPlan``.

:func:`compression_executor` is how the runtime runs the ``compression`` pass's plan. Alone
(no earlier parallelism executor), it returns a :class:`DataParallelExecutor`: every rank passes
the same global batch and takes its shard of dim 0, runs forward and backward, and the
gradients are synchronized bucket by bucket (the plan's buckets: parameters in reverse order, 25
MiB like DDP) through the plan's compressor (:mod:`tidal.runtime.compressors`) after the
backward (compression is not overlapped, §4.2.1); parameters and buffers are broadcast from
rank 0 like DDP. With Accordion in the plan, an :class:`~tidal.runtime.accordion.Accordion`
switches each tensor's level every window, seeing a learning-rate decay ahead from the decays the
plan recorded, or from a torch scheduler given to :meth:`DataParallelExecutor.watch_scheduler`
(else one window late).

After a parallelism pass, the plan changes that pass's executor instead: a factory of
:class:`~tidal.runtime.grad_sync.GradSync` built from the plan goes to its ``use_grad_sync``
(``tick_tock`` keeps one compressor state per wave, ``burst_parallel`` one per set of ranks that
syncs a layer, ``round_robin`` one per partition).

Example:
    >>> import torch
    >>> from tidal.ir.plans.compression import CompressionPlan
    >>> from tidal.runtime.data_parallel import compression_executor
    >>> model = torch.nn.Linear(8, 3)
    >>> plan = CompressionPlan(compressor="topk:0.25", mode="on", enabled=True,
    ...                        bucket_bytes=25 * 2**20, buckets=(("bias", "weight"),),
    ...                        grad_bytes=108, payload_bytes=56)
    >>> ex = compression_executor(plan, None)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    >>> loss = ex.step(model, model, (x,), y, torch.nn.functional.cross_entropy, opt)
    >>> type(ex).__name__, ex.compressor.spec(), ex.comm.bytes_sent   # 1 + 6 values, indices
    ('DataParallelExecutor', 'topk:0.25', 56)
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from tidal.ir import cost
from tidal.ir.errors import PassError
from tidal.ir.pass_api import Executor
from tidal.runtime.accordion import Accordion, LrLookahead
from tidal.runtime.compressors import Compressor, make_compressor
from tidal.runtime.grad_sync import GradSync, GradSyncFactory


def shard(value: Any, rank: int, size: int, batch: int) -> Any:
    """This rank's slice of dim 0 of every tensor whose dim 0 is the global batch."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        per = batch // size
        return value[rank * per:(rank + 1) * per]
    if isinstance(value, (tuple, list)):
        return type(value)(shard(v, rank, size, batch) for v in value)
    if isinstance(value, Mapping):
        return {k: shard(v, rank, size, batch) for k, v in value.items()}
    return value


def broadcast_state(model: torch.nn.Module, params: bool,
                    group: Optional[dist.ProcessGroup] = None) -> None:
    """Give every rank rank 0's buffers (BatchNorm statistics each rank updated from its own
    shard) and, with ``params``, its parameters (before the first step); a no-op on one rank.
    Data-parallel executors call it at the start of every step."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    tensors = list(model.buffers()) + ([p.data for p in model.parameters()] if params else [])
    for t in tensors:
        dist.broadcast(t, src=0, group=group)


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters that get gradients, by name, in registration order."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


class DataParallelExecutor:
    """Runs ``Compiled.step`` as data-parallel training with compressed gradient sync.
    ``state_dict``/``load_state_dict`` checkpoint the compressor and the Accordion controller."""

    def __init__(self, compressor: Compressor, buckets: Sequence[Sequence[str]], *,
                 accordion: Optional[Accordion] = None, accordion_interval: int = 100,
                 lr_lookahead: Optional[LrLookahead] = None,
                 group: Optional[dist.ProcessGroup] = None):
        self.compressor = compressor
        self.lr_lookahead = lr_lookahead
        self.buckets = tuple(tuple(b) for b in buckets)
        self.accordion = accordion
        self.accordion_interval = accordion_interval
        self.grad_sync = GradSync(compressor, buckets=self.buckets, group=group)
        self.comm = self.grad_sync.comm
        self.steps = 0
        self._window_lr: Optional[float] = None

    @classmethod
    def from_plan(cls, plan: Any, group: Optional[dist.ProcessGroup] = None
                  ) -> "DataParallelExecutor":
        """The executor of a ``CompressionPlan`` that wraps no parallelism pass."""
        accordion = None
        levels = plan.accordion_levels if plan.enabled else None
        if levels is not None:
            accordion = Accordion(*levels, eta=plan.accordion[2], group=group)
        lookahead = None
        if accordion is not None and plan.accordion_lr_horizon:
            lookahead = LrLookahead.from_decays(plan.accordion_lr_decays,
                                                plan.accordion_lr_horizon)
        return cls(make_compressor(plan.sync_compressor), plan.buckets, accordion=accordion,
                   accordion_interval=plan.accordion[3] if accordion is not None else 100,
                   lr_lookahead=lookahead, group=group)

    def watch_scheduler(self, scheduler: Any, steps_per_call: int = 1) -> None:
        """Let Accordion see learning-rate decays ahead in ``scheduler`` (a torch scheduler on
        ``Compiled.optimizer``, stepped once per ``steps_per_call`` steps); it is peeked,
        never advanced. Replaces the decays the plan recorded."""
        self.lr_lookahead = LrLookahead.from_scheduler(scheduler, steps_per_call)

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """Inference is not distributed: every rank runs the whole batch."""
        return gm(*args, **kwargs)


    def sync_gradients(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Synchronize every parameter's ``.grad`` bucket by bucket through the compressor
        (:class:`~tidal.runtime.grad_sync.GradSync`); returns the synchronized gradients."""
        params = _trainable(model)
        synced = self.grad_sync({n: p.grad if p.grad is not None else torch.zeros_like(p)
                                 for n, p in params.items()})
        for n, g in synced.items():
            p = params[n]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(g.reshape(p.shape))
        return synced

    def step(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """One data-parallel step on this rank's shard of the global batch; returns the loss of
        the global batch (the mean of the ranks' shard losses)."""
        world = self.comm.world
        batch = cost.example_batch(inputs)
        if batch % world.size:
            raise ValueError(f"compression: global batch {batch} does not split evenly over "
                             f"{world.size} ranks")
        broadcast_state(model, params=self.steps == 0, group=self.comm.group)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(gm(*shard(inputs, world.rank, world.size, batch)),
                       shard(targets, world.rank, world.size, batch))
        loss.backward()
        synced = self.sync_gradients(model)
        optimizer.step()
        self.steps += 1
        if self.accordion is not None:
            self._accordion_step(synced, optimizer)
        out = loss.detach().clone()
        if world.size > 1:
            dist.all_reduce(out, group=self.comm.group)
            out /= world.size
        return out

    def _accordion_step(self, synced: Mapping[str, torch.Tensor],
                        optimizer: torch.optim.Optimizer) -> None:
        self.accordion.accumulate(synced)
        if self.steps % self.accordion_interval == 0:
            lr = float(optimizer.param_groups[0]["lr"])
            ahead = None
            if self.lr_lookahead is not None:      # a decay within the next window
                ahead = self.lr_lookahead.now_and_next(self.steps, self.accordion_interval, lr)
            if ahead is None:                      # unknown schedule: a drop seen after it
                ahead = (self._window_lr, lr)
            self._window_lr = lr
            levels = self.accordion.decide(*ahead)
            self.accordion.apply(self.compressor, levels)

    def state_dict(self) -> dict[str, Any]:
        """Compressor, Accordion and step counter."""
        return {"steps": self.steps, "window_lr": self._window_lr,
                "compressor": self.compressor.state_dict(),
                "accordion": self.accordion.state_dict() if self.accordion else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.steps = state["steps"]
        self._window_lr = state["window_lr"]
        self.compressor.load_state_dict(state["compressor"])
        if self.accordion is not None and state["accordion"] is not None:
            self.accordion.load_state_dict(state["accordion"])


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
    an earlier parallelism pass's plan gave), a :class:`DataParallelExecutor`; else ``host``
    itself, its gradient sync replaced through ``host.use_grad_sync`` by
    :func:`grad_sync_factory`. Raises ``PassError`` when Accordion is asked for on top of a host
    (it needs this module's own executor), when ``host`` takes no gradient sync, or when the
    plan wraps a parallelism pass but no executor was built for it."""
    if host is None:
        if plan.wraps is not None:
            raise PassError(f"pass 'compression': the plan wraps the gradient sync of "
                            f"{plan.wraps!r}, but no executor was built for {plan.wraps!r}")
        return DataParallelExecutor.from_plan(plan)
    where = repr(plan.wraps) if plan.wraps is not None else type(host).__name__
    if plan.enabled and plan.accordion is not None:
        raise PassError(f"pass 'compression': accordion switching runs in the compression "
                        f"pass's own data-parallel executor; it is not available on top of "
                        f"{where}")
    if not callable(getattr(host, "use_grad_sync", None)):
        raise PassError(f"pass 'compression' wraps the gradient sync of a parallelism pass, but "
                        f"{where}'s executor ({type(host).__name__}) does not take one (no "
                        f"use_grad_sync)")
    host.use_grad_sync(grad_sync_factory(plan))
    return host

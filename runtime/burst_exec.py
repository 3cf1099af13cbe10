"""Runs a burst-parallel graph on every rank: forward with the plan's scatter/gather ops, the loss
on the gathered global output, backward, per-layer gradient all-reduce on the layer's subgroup,
then the optimizer step.

Every rank passes the same global batch. Each layer runs on its ranks' sample ranges (ranks
outside its set hold zero rows, so they skip its work); the model output is gathered to every
rank, so every rank computes the same global loss, and backward sends each row's gradient back
to the rank that computed the row. A parameter's gradient is then summed over the ranks of its
layer (a subgroup all-reduce) and broadcast to the other ranks, so every replica takes the same
optimizer step and the parameters stay identical everywhere. Without a process group (one
process) the ops are the identity and ``step`` is plain training.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.runtime.burst_exec import BurstExecutor
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    >>> gm = fx.symbolic_trace(model)
    >>> ex = BurstExecutor(world=1, batch=4, param_ranks=(("0.weight", (0,)), ("0.bias", (0,))))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    >>> float(ex.step(gm, model, (x,), y, torch.nn.functional.cross_entropy, opt)) > 0
    True
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from tidal.ir.collectives import SubgroupCache
from tidal.runtime.distributed import is_distributed


class BurstExecutor:
    """The executor ``burst_parallel`` returns: ``world`` ranks, the plan's global ``batch`` and,
    per parameter name of the graph module, the ranks of the layer that owns it."""

    def __init__(self, world: int, batch: int, param_ranks: tuple[tuple[str, tuple[int, ...]], ...]):
        self.world = world
        self.batch = batch
        self.param_ranks = dict(param_ranks)
        self.groups = SubgroupCache()
        self._ready = False

    def _check(self, inputs: tuple) -> None:
        size = dist.get_world_size()
        if size != self.world:
            raise ValueError(f"burst_parallel: the plan is for {self.world} GPUs but the job has "
                             f"{size} ranks; compile with tidal.Cluster(gpus={size})")
        first = next((v for v in inputs if isinstance(v, torch.Tensor)), None)
        if first is not None and first.shape[0] != self.batch:
            raise ValueError(f"burst_parallel: the plan is for a global batch of {self.batch}, "
                             f"got inputs with batch {first.shape[0]}")
        if not self._ready:
            self.groups.create(r for r in self.param_ranks.values() if len(r) < size)
            self._ready = True

    def forward(self, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        """The global output on every rank."""
        if is_distributed():
            self._check(args)
        return gm(*args, **kwargs)

    def step(self, gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple, targets: Any,
             loss_fn: Callable, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """One training step on the global batch; returns the (global) loss."""
        distributed = is_distributed()
        if distributed:
            self._check(inputs)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(gm(*inputs), targets)
        loss.backward()
        if distributed:
            self.sync_gradients(gm)
        optimizer.step()
        return loss.detach()

    def sync_gradients(self, gm: fx.GraphModule) -> None:
        """Sum each parameter's gradient over its layer's ranks and give it to every rank."""
        rank, size = dist.get_rank(), dist.get_world_size()
        by_ranks: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        everyone = tuple(range(size))
        for name, p in gm.named_parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_ranks.setdefault(self.param_ranks.get(name, everyone), []).append(p)
        for ranks in sorted(by_ranks):
            params = by_ranks[ranks]
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            if len(ranks) == size:
                dist.all_reduce(flat)
            else:
                if rank in ranks:
                    dist.all_reduce(flat, group=self.groups.get(ranks))
                dist.broadcast(flat, src=ranks[0])
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n

"""What a :class:`~tidal.runtime.switching.switcher.Switcher` runs: a job, described so that a
spawned worker process can rebuild it (every field pickles).

A :class:`SwitchJob` is a graph grouped by the ``layer_groups`` pass (``Compiled.graph_module``
of ``tidal.compile(model, inputs, passes=[LayerGroups()])``), a function giving iteration ``i``'s
``(inputs, targets)`` (a module-level function or ``functools.partial``: it crosses to the
worker by pickle) and, for a training job, a loss function and an optimizer factory. Without a
loss function the job is inference: each iteration is one forward whose output goes back to the
controller. ``activation_bytes`` is the arena room kept for an iteration's inputs beyond the
weights; ``cap`` is an opportunistic job's memory cap in bytes (AntMan): what it would hold in
the arena past the cap is allocated outside the arena instead (a spill, counted: the job runs
on, outside its cap). ``preempt_at`` says where a switch stops
the job: ``"piece"`` (default) after the pieces running when it is asked (a layer group, the
backward, the optimizer step), the unfinished iteration rolled back and run again on resume, so
a switch waits at most one piece; ``"iteration"`` at the end of the current iteration, no work
lost but a switch may wait a whole iteration.

Example:
    >>> import torch, tidal
    >>> from tidal.passes.layer_groups import LayerGroups
    >>> from tidal.runtime.switching.job import Repeat, SwitchJob, weightless
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> c = tidal.compile(m, (torch.randn(3, 4),), passes=[LayerGroups()])
    >>> job = SwitchJob("mlp", c.graph_module, Repeat(torch.ones(3, 4)))
    >>> job.training, [tuple(p.shape) for p in weightless(job.graph).parameters()][:1]
    (False, [(0,)])
    >>> import pickle
    >>> copy = pickle.loads(pickle.dumps(job))
    >>> copy.graph.code == job.graph.code, torch.equal(copy.graph(torch.ones(3, 4)), m(torch.ones(3, 4)))
    (True, True)
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any, Callable, Generic, Optional, TypeVar

import torch
import torch.fx as fx

from tidal.ir.portable_graph import PortableGraph


@dataclass(frozen=True)
class SwitchJob:
    """A job of a switcher (see the module docstring). It pickles with its graph's nodes as
    they are (:class:`PortableGraph`: a graph module's own pickling re-traces its code, which
    drops the ``group_boundary`` markers). ``batches(i)`` returns iteration
    ``i``'s inputs (a tensor or tuple of tensors) for inference, ``(inputs, targets)`` for
    training; ``optimizer`` maps the parameters to a ``torch.optim.Optimizer``."""

    name: str
    graph: fx.GraphModule
    batches: Callable[[int], Any]
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None
    optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None
    activation_bytes: int = 1 << 20
    cap: Optional[int] = None
    preempt_at: str = "piece"

    def __post_init__(self) -> None:
        if self.preempt_at not in ("piece", "iteration"):
            raise ValueError(f"SwitchJob {self.name!r}: preempt_at={self.preempt_at!r}; "
                             "choose 'piece' or 'iteration'")
        if (self.loss_fn is None) != (self.optimizer is None):
            raise ValueError(f"SwitchJob {self.name!r}: a training job needs both loss_fn and "
                             "optimizer, an inference job neither")

    @property
    def training(self) -> bool:
        return self.loss_fn is not None

    def __getstate__(self) -> dict:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["graph"] = PortableGraph.of(self.graph)
        return state

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value.build() if name == "graph" else value)


def weightless(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose parameters and buffers are empty (same dtypes and
    ``requires_grad``): what a worker process receives; its weights arrive by transmission."""
    memo: dict[int, Any] = {}
    for p in gm.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty(0, dtype=p.dtype),
                                         requires_grad=p.requires_grad)
    for b in gm.buffers():
        memo[id(b)] = torch.empty(0, dtype=b.dtype)
    return copy.deepcopy(gm, memo)


T = TypeVar("T")


@dataclass(frozen=True)
class Repeat(Generic[T]):
    """``batches`` that give the same ``batch`` at every iteration (it pickles with the job)."""

    batch: T

    def __call__(self, i: int) -> T:
        return self.batch



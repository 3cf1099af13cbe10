"""A round-robin partition's ``F`` and ``B`` on one micro-batch: the segments of its captured
joint graph, or eager autograd.

:func:`forward` runs partition p on batch b's activations (received from the previous rank) and
returns the :class:`Run` that lives until ``B``: what it sends on (or the micro-batch loss / N
on the last partition, times the micro-batch's ``weight`` rows * N / B when the global batch of
B rows does not cut into N equal micro-batches) and what ``B`` goes on with (a captured run and
the buffers the output gradients go into; eagerly, the input activations as autograd leaves).
:func:`backward` runs its backward on the gradients of its outputs (received from the next
rank), accumulates the parameters' gradients (``.grad``, as autograd does) and leaves the input
activations' gradients in ``Run.leaf_grads``, to send back. A weight scales the last partition's
loss, and the open step's loss ``scale`` (a number or a ``GradScaler``'s scale tensor) its
backward: eagerly, the loss times both before backward; a captured graph, made for the
unweighted loss / N and shared by every batch of its shape, gets its loss output weighted and
their product as its backward's seed (``tidal.ir.capture.loss_seed``), as eager
``(loss * seed).backward()`` seeds it. So every gradient sent back and made upstream is of the
scaled, weighted loss (fp16 intermediate gradients are scaled before they can underflow, as in
eager ``scaler.scale(loss).backward()``), and the sum over the micro-batches is the global
batch's mean loss.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir.compat import split_module_tuple
    >>> from tidal.runtime.programs.round_robin_stages import Partitions
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> split = split_module_tuple(fx.symbolic_trace(model), model, lambda n: int(n.name == "_2"))
    >>> parts, x, y = Partitions(split, 2, model), torch.randn(2, 4), torch.tensor([0, 1])
    >>> loss = torch.nn.functional.cross_entropy
    >>> first = forward(None, parts, 0, 0, {}, (x,), y, loss)       # eager, no captured graph
    >>> last = forward(None, parts, 0, 1, first.sent, (x,), y, loss)
    >>> backward(None, parts, 1, last, [])
    >>> [t.shape for t in last.leaf_grads], model[2].weight.grad is not None
    ([torch.Size([2, 4])], True)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from tidal.ir.capture import loss_seed
from tidal.runtime.program import CapturedRun
from tidal.runtime.programs.optimizer_wiring import accumulate_grad
from tidal.runtime.programs.round_robin_capture import StageGraph
from tidal.runtime.programs.round_robin_stages import Partitions, floats


@dataclass
class Run:
    """One (partition, batch) on one rank from its ``F`` to its ``B``."""

    sent: dict[str, torch.Tensor] = field(default_factory=dict)  # to the next rank
    loss: Optional[torch.Tensor] = None        # the last partition's micro-batch loss / N
    weight: Optional[float] = None             # rows * N / B of an uneven micro-batch
    scale: Any = None                          # the last partition's loss scale (backward)
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)   # eager: input leaves
    captured: Optional[CapturedRun] = None     # captured: the run B goes on with
    grads_in: list[torch.Tensor] = field(default_factory=list)  # captured: B's output grads
    leaf_grads: list[torch.Tensor] = field(default_factory=list)  # after B, to the previous rank


def forward(graph: Optional[StageGraph], parts: Partitions, rank: int, p: int,
            values: dict[str, torch.Tensor], inputs: tuple, target: Any,
            loss_fn: Callable, weight: Optional[float] = None, scale: Any = None) -> Run:
    """``F`` of partition ``p`` on the activations ``values`` (by name), the micro-batch
    ``inputs``/``target``: ``rank``'s captured copy of ``graph``, or eagerly without one.
    ``weight`` (None: 1) scales the last partition's loss and so its gradients; ``scale``
    (None: 1) its gradients alone (the loss it reports stays unscaled)."""
    if graph is None:
        run = _forward_eager(parts, p, values, inputs, target, loss_fn, weight)
        run.scale = scale
        return run
    trainable = parts.trainable[p]
    consts = [v for v in tree_flatten(parts.constants(p, values, inputs, target))[0]
              if isinstance(v, torch.Tensor)]
    run, grads_in = graph.run(rank, [*trainable, *[values[nm] for nm in floats(values)],
                                     *consts])
    graph.segment(run, 0)  # the run stays alive (on a GPU the copy's static buffers) until B
    out = graph.outputs(run, 0, graph.n_forward)
    if p == parts.n - 1:
        return Run(loss=out[0] if weight is None else out[0] * weight, weight=weight,
                   scale=scale, captured=run, grads_in=grads_in)
    return Run(sent=dict(zip(parts.stages[p].sends, out)), captured=run, grads_in=grads_in)


def _forward_eager(parts: Partitions, p: int, values: dict[str, torch.Tensor], inputs: tuple,
                   target: Any, loss_fn: Callable, weight: Optional[float]) -> Run:
    stage = parts.stages[p]
    leaves = {nm: t.detach().requires_grad_(True) if t.is_floating_point() else t
              for nm, t in values.items()}
    # a clone, so that an in-place first op (ReLU(inplace=True)) does not touch the leaf
    args = [parts.input(x, inputs) if x.op in ("placeholder", "get_attr") else
            (leaves[x.name].clone() if leaves[x.name].requires_grad else leaves[x.name])
            for x in stage.args]
    env = dict(leaves)
    env.update(zip(stage.produced, stage.module(*args)))
    if p < parts.n - 1:
        return Run(sent={nm: parts.sent(p, nm, env[nm]) for nm in stage.sends}, leaves=leaves)
    result = fx.node.map_arg(parts.output.args[0], lambda x: env[x.name]
                             if x.op not in ("placeholder", "get_attr")
                             else parts.input(x, inputs))
    loss = loss_fn(result, target) / parts.n
    return Run(loss=loss if weight is None else loss * weight, leaves=leaves)


def backward(graph: Optional[StageGraph], parts: Partitions, p: int, run: Run,
             grads: list[torch.Tensor]) -> None:
    """``B`` of partition ``p`` for the ``run`` its ``F`` left, on the gradients ``grads`` of
    its float outputs (none on the last partition): the captured ``B`` segment (the gradients
    copied into the run's gradient inputs unless received there; on the last partition the
    backward's seed, ``run.scale`` times ``run.weight``), or eager autograd."""
    if graph is None:
        _backward_eager(parts, p, run, grads)
        return
    if run.loss is not None:
        grads = [loss_seed(run.scale, run.grads_in[0].device, run.weight)]
    for buf, g in zip(run.grads_in, grads):
        if buf is not g:
            buf.copy_(g)
    graph.segment(run.captured, 1)
    out = graph.outputs(run.captured, graph.n_forward, None)
    run.captured, run.grads_in = None, []
    run.leaf_grads = [g.contiguous() for g in out[:graph.n_leaves]]
    param_grads = iter(out[graph.n_leaves:])
    for param, has in zip(parts.trainable[p], graph.has_grad):
        if has:
            accumulate_grad(param, next(param_grads))


def _backward_eager(parts: Partitions, p: int, run: Run, grads: list[torch.Tensor]) -> None:
    if run.loss is not None:
        (run.loss if run.scale is None else run.loss * run.scale).backward()
    else:
        produced = set(parts.stages[p].produced)
        tensors, gts = [], []
        for nm, g in zip(floats(run.sent), grads):
            if nm in produced:
                if run.sent[nm].requires_grad:
                    tensors.append(run.sent[nm])
                    gts.append(g)
            else:  # passed through this partition unchanged
                leaf = run.leaves[nm]
                leaf.grad = g.clone() if leaf.grad is None else leaf.grad + g
        if tensors:
            torch.autograd.backward(tensors, gts)
    leaves = run.leaves
    run.leaf_grads = [(leaves[k].grad if leaves[k].grad is not None
                       else torch.zeros_like(leaves[k])).contiguous() for k in floats(leaves)]

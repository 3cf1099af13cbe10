"""Cutting a captured training step's joint graph into a program's segments.

A captured step (``tidal.ir.capture.capture_train_step``) is one aten graph: forward, loss,
backward, the gradients as outputs. :func:`forward_backward` cuts it at the loss (tick-tock's
``F`` and ``B``); :func:`cut_at_markers` cuts nodes at the ``tidal::group_boundary`` markers
the ``layer_groups`` pass leaves (one segment per layer group); :func:`group_segments` gives a
grouped step's forward segment per group and backward segments that each end where a group's
gradients are complete (PipeSwitch's training step). Names only: the graph is not changed.

Example:
    >>> import torch
    >>> from tidal.ir.capture import capture_train_step
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    >>> step = capture_train_step(model, (torch.randn(2, 4),), torch.tensor([0, 2]),
    ...                           torch.nn.functional.cross_entropy)
    >>> forward, backward = forward_backward(step)
    >>> forward[0], len(forward) + len(backward) == len(step.gm.graph.nodes) - 1
    ('params_1', True)
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch.fx as fx

from tidal.ir import ops
from tidal.ir.capture import TrainStep, grad_nodes

Segment = tuple[str, ...]
"""Node names of one compute piece, in graph order."""


def forward_backward(step: TrainStep) -> tuple[Segment, Segment]:
    """The joint graph's nodes through the loss (the forward) and after it (the backward)."""
    nodes = [n for n in step.gm.graph.nodes if n.op != "output"]
    loss, _ = grad_nodes(step)
    cut = nodes.index(loss) + 1
    return tuple(n.name for n in nodes[:cut]), tuple(n.name for n in nodes[cut:])


def cut_at_markers(nodes: Iterable[fx.Node]) -> list[Segment]:
    """The names of ``nodes`` cut into layer groups: a ``tidal::group_boundary`` marker starts
    its group, nodes before the first marker (the placeholders) go to group 0. Raises
    ``ValueError`` when there is no marker."""
    head: list[str] = []
    groups: list[list[str]] = []
    for n in nodes:
        if n.op == "call_function" and n.target is ops.GROUP_BOUNDARY:
            groups.append([] if groups else head)
        (groups[-1] if groups else head).append(n.name)
    if not groups:
        raise ValueError("layer groups: the graph has no tidal::group_boundary markers: run "
                         "the layer_groups pass first")
    return [tuple(g) for g in groups]


def group_segments(step: TrainStep, groups: Sequence[Sequence[str]]
                   ) -> tuple[list[Segment], list[tuple[str, Segment]]]:
    """The forward segment of each layer group of a captured step (cut at its markers, the
    last ending at the loss) and its backward segments: ``backward k`` ends where the
    gradients of group ``k``'s parameters (``groups[k]``: their names) are complete, the last
    group first (a group whose gradients are complete earlier, or that has none, has no
    segment). Raises ``ValueError`` when the capture did not keep one marker per group."""
    nodes = [n for n in step.gm.graph.nodes if n.op != "output"]
    loss, grads = grad_nodes(step)
    end = nodes.index(loss) + 1
    forward = cut_at_markers(nodes[:end])
    if len(forward) != len(groups):
        raise ValueError(f"the captured step has {len(forward)} tidal::group_boundary markers "
                         f"before the loss, the graph {len(groups)}")
    rest = nodes[end:]
    pos = {n: i for i, n in enumerate(rest)}
    grad_of = dict(zip(step.param_names, grads))
    backward: list[tuple[str, Segment]] = []
    start = 0
    for k in reversed(range(len(groups))):
        ready = [pos[grad_of[name]] for name in groups[k] if grad_of.get(name) in pos]
        if ready and max(ready) >= start:
            backward.append((f"backward {k}", tuple(n.name for n in rest[start:max(ready) + 1])))
            start = max(ready) + 1
    if start < len(rest):  # what follows the first group's last gradient
        name, names = backward.pop() if backward else ("backward", ())
        backward.append((name, names + tuple(n.name for n in rest[start:])))
    return forward, backward

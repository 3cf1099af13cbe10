"""The weights of a grouped graph: which parameters and buffers each layer group loads, and the
store they load from.

A graph grouped by the ``layer_groups`` pass has a ``tidal::group_boundary(k)`` marker before
the first node of each group. :func:`group_tensors` reads the groups back from the markers (a
parameter or buffer belongs to the group of its first use), :func:`expected_specs` says what a
store for them must hold, and :func:`write_groups` writes the current weights as a grouped store
(:mod:`tidal.runtime.weights.store`: one contiguous, checksummed buffer per group). The program
that streams a store back in, group ``k+1`` loading while group ``k`` computes, is
:mod:`tidal.runtime.programs.layer_groups`.

Example:
    >>> import os, tempfile, torch, tidal
    >>> from tidal.passes.layer_groups import LayerGroups
    >>> from tidal.runtime.weights.loader import expected_specs, group_tensors, write_groups
    >>> from tidal.runtime.weights.store import WeightStore
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> c = tidal.compile(model, (torch.randn(3, 4),), passes=[LayerGroups(grouping="per_layer")])
    >>> groups = group_tensors(c.graph_module)
    >>> [[name for name, _ in g] for g in groups]
    [['0.weight', '0.bias'], [], ['2.weight', '2.bias']]
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> write_groups(c.graph_module, path)
    >>> with WeightStore.open(path, expected_specs(groups)) as store:
    ...     torch.equal(store.tensor("2.bias"), model[2].bias)
    True
"""
from __future__ import annotations

import torch
import torch.fx as fx

from tidal.ir import ops
from tidal.ir.node_runner import fetch_attr
from tidal.runtime.weights.store import PathLike, TensorSpec, write_store

GroupedTensors = list[list[tuple[str, torch.Tensor]]]


def group_tensors(gm: fx.GraphModule) -> GroupedTensors:
    """The parameters and buffers of each layer group, from the graph's ``group_boundary``
    markers: each tensor goes to the group of the first node that uses it; tensors no node
    uses go to the last group. Raises ``ValueError`` for a graph without markers."""
    named: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        named.setdefault(id(t), (name, t))
    groups: GroupedTensors = []
    assigned: set[int] = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is ops.GROUP_BOUNDARY:
            if n.args[0] != len(groups):
                raise ValueError(f"group_boundary node {n.name} has group {n.args[0]}, "
                                 f"expected {len(groups)} (markers out of order)")
            groups.append([])
            continue
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            used = list(mod.parameters()) + list(mod.buffers())
        elif n.op == "get_attr":
            obj = fetch_attr(gm, str(n.target))
            used = [obj] if isinstance(obj, torch.Tensor) else []
        else:
            continue
        fresh = [t for t in used if id(t) in named and id(t) not in assigned]
        if fresh and not groups:
            raise ValueError(f"node {n.name} uses weights before the first group_boundary")
        for t in fresh:
            groups[-1].append(named[id(t)])
            assigned.add(id(t))
    if not groups:
        raise ValueError("the graph has no tidal::group_boundary markers: run the "
                         "layer_groups pass first")
    groups[-1].extend(v for k, v in named.items() if k not in assigned)
    return groups


def expected_specs(groups: GroupedTensors) -> list[list[TensorSpec]]:
    """What a store for ``groups`` must hold: names, shapes and dtypes, group by group."""
    return [[TensorSpec.of(name, t) for name, t in g] for g in groups]


def write_groups(gm: fx.GraphModule, path: PathLike) -> None:
    """Write the graph module's current weights to ``path`` in its layer groups."""
    write_store(path, group_tensors(gm))

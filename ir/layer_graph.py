"""Layer graph: the traced model as a networkx DAG of layers, with branch/join detection.

A layer is a compute node of the fx graph that produces a tensor (a module call, a function such
as ``add`` or ``cat``, a method such as ``flatten``); nodes that produce no tensor (``size()``)
are looked through, so ``x.view(x.size(0), -1)`` is one edge from ``x``'s layer. DeepPool's
graph reduction needs the series-parallel structure: a *branch block* starts at a fork layer
whose output feeds several layers and ends at the join layer where all paths meet again (its
immediate post-dominator), e.g. an Inception block (fork: previous output, join: ``cat``) or a
residual block (join: ``add``).

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir import cost, layer_graph
    >>> class Res(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    ...     def forward(self, x):
    ...         x = self.a(x)
    ...         return self.b(x) + x
    >>> gm = fx.symbolic_trace(Res())
    >>> cost.annotate(gm, (torch.randn(2, 4),))
    >>> lg = layer_graph.build(gm)
    >>> [(b.fork, b.join, b.branches) for b in layer_graph.branch_blocks(lg)]
    [('a', 'add', (('b',), ()))]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import networkx as nx
import torch.fx as fx

from tidal.ir import meta
from tidal.ir.node_runner import COMPUTE_OPS

_SOURCE = "<input>"
_SINK = "<output>"


class NotSeriesParallel(ValueError):
    """The layer graph is not a nest of fork/join blocks at ``fork``: branches from it meet
    first at ``join`` (graph nodes) without a single join for all of them. The region between
    the two (``region``) is the smallest part a planner would collapse into one composite layer.
    ``fork`` is None when ``join`` reads no layer where a chain needs one."""

    def __init__(self, message: str, fork: Any, join: Any):
        super().__init__(message)
        self.fork, self.join = fork, join

    def region(self, g: nx.DiGraph) -> set:
        """The nodes of ``g`` from ``fork`` (exclusive) to ``join`` (inclusive): every node on
        a path between them, and ``join``."""
        if self.fork is None:
            return {self.join}
        return (nx.descendants(g, self.fork) & nx.ancestors(g, self.join)) | {self.join}


@dataclass(frozen=True)
class BranchBlock:
    """A fork layer, its join layer, and the layers of each parallel branch in topological
    order (an empty branch is a skip connection straight from fork to join). ``nested`` holds
    the branch blocks that lie strictly inside this one."""

    fork: str
    join: str
    branches: tuple[tuple[str, ...], ...]
    nested: tuple["BranchBlock", ...] = ()


def build(gm: fx.GraphModule) -> nx.DiGraph:
    """The layer DAG of an annotated graph (run ``tidal.ir.cost.annotate`` first).

    Nodes are fx node names with attributes ``layer`` (LayerRef), ``cost`` (NodeCost or None)
    and ``order`` (position in the fx graph); the graph attribute ``inputs`` lists the layers
    that read a model input and ``outputs`` those that feed the model output.
    """
    g = nx.DiGraph(inputs=[], outputs=[])
    feeds: dict[str, set[str]] = {}  # fx node -> layers whose values it carries
    for order, n in enumerate(gm.graph.nodes):
        sources: set[str] = set()
        for a in n.all_input_nodes:
            sources |= feeds.get(a.name, set())
        if n.op == "placeholder":
            feeds[n.name] = {_SOURCE}
        elif n.op == "output":
            g.graph["outputs"] = sorted(s for s in sources if s != _SOURCE)
        elif n.op in COMPUTE_OPS and meta.get_tensors(n):
            g.add_node(n.name, layer=meta.get_layer(n), cost=meta.get_cost(n), order=order)
            for s in sources:
                if s == _SOURCE:
                    g.graph["inputs"].append(n.name)
                else:
                    g.add_edge(s, n.name)
            feeds[n.name] = {n.name}
        else:
            feeds[n.name] = sources  # look through size(), getattr, parameters
    if not nx.is_directed_acyclic_graph(g):
        raise ValueError("layer graph has a cycle; an fx graph never should (corrupt graph?)")
    return g


def _with_terminals(g: nx.DiGraph) -> nx.DiGraph:
    h = g.copy()
    h.add_node(_SOURCE)
    h.add_node(_SINK)
    for n in g.graph["inputs"]:
        h.add_edge(_SOURCE, n)
    for n in g.nodes:
        if g.out_degree(n) == 0 or n in g.graph["outputs"]:
            h.add_edge(n, _SINK)
    return h


def chain_order(g: nx.DiGraph) -> list[str]:
    """Layers in fx execution order (a topological order)."""
    return sorted(g.nodes, key=lambda n: g.nodes[n]["order"])


def branch_blocks(g: nx.DiGraph, label: Callable[[Any], str] = str) -> list[BranchBlock]:
    """The outermost branch blocks of the layer graph, in execution order, each with its nested
    blocks. Raises ``NotSeriesParallel`` naming the fork layer when branches share layers without
    meeting at a single join (a graph that is not series-parallel there); ``label`` names a
    graph node in that message (e.g. a layer index as its node name)."""
    h = _with_terminals(g)
    ipdom = nx.immediate_dominators(h.reverse(copy=False), _SINK)
    order = {n: g.nodes[n]["order"] for n in g.nodes}
    blocks: list[BranchBlock] = []
    for fork in chain_order(g):
        succs = sorted(h.successors(fork), key=lambda s: order.get(s, 1 << 30))
        if len(succs) < 2:
            continue
        join = ipdom[fork]
        if join == _SINK:
            continue  # several model outputs, not a block
        inside = _between(h, fork, join, order)
        branches = []
        seen: set[str] = set()
        for s in succs:
            if s == join:
                branches.append(())
                continue
            members = _reach(h, s, inside)
            if members & seen:
                shared = sorted(members & seen, key=order.__getitem__)[:3]
                raise NotSeriesParallel(  # the region: from the fork to where branches meet
                    f"layer {label(fork)!r} forks into branches that share layers "
                    f"{[label(x) for x in shared]} before joining at {label(join)!r}: not "
                    f"series-parallel", fork, shared[0])
            seen |= members
            branches.append(tuple(sorted(members, key=order.__getitem__)))
        blocks.append(BranchBlock(fork=fork, join=join, branches=tuple(branches)))
    return _nest(blocks, order)


def _between(h: nx.DiGraph, fork: Any, join: Any, order: dict) -> set:
    """The nodes on a path from ``fork`` to ``join`` (both excluded). Only nodes ordered
    between the two can be on one (the order is topological), so the search stays in that
    stretch of the graph instead of walking everything after the fork."""
    last = order[join]
    ahead: set = set()
    todo = [fork]
    while todo:
        for s in h.successors(todo.pop()):
            if s != join and s not in ahead and order.get(s, last) < last:
                ahead.add(s)
                todo.append(s)
    return _reach(h, join, ahead, forward=False) - {join}


def _reach(h: nx.DiGraph, start: Any, allowed: set, forward: bool = True) -> set:
    """``start`` and the nodes reachable from it (backwards with ``forward=False``) through
    ``allowed`` nodes only."""
    step = h.successors if forward else h.predecessors
    out = {start}
    todo = [start]
    while todo:
        for n in step(todo.pop()):
            if n in allowed and n not in out:
                out.add(n)
                todo.append(n)
    return out & (allowed | {start})


def _nest(blocks: list[BranchBlock], order: dict[str, int]) -> list[BranchBlock]:
    """Put each block inside the smallest block whose branches contain its fork."""
    def span(b: BranchBlock) -> set[str]:
        return {n for br in b.branches for n in br}

    children: dict[int, list[BranchBlock]] = {}
    roots: list[BranchBlock] = []
    for i, b in enumerate(blocks):
        parents = [j for j, p in enumerate(blocks) if j != i and b.fork in span(p)]
        if parents:
            parent = min(parents, key=lambda j: len(span(blocks[j])))
            children.setdefault(parent, []).append(b)
        else:
            roots.append(b)

    def rebuild(b: BranchBlock) -> BranchBlock:
        i = blocks.index(b)
        kids = tuple(rebuild(c) for c in children.get(i, []))
        return BranchBlock(b.fork, b.join, b.branches, kids)

    return sorted((rebuild(b) for b in roots), key=lambda b: order[b.fork])

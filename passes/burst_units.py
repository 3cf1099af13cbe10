"""The layers ``burst_parallel`` places: fx nodes grouped into *units* by where the samples are.

The batch-dimension analysis (``tidal.ir.batch_dim``) says, for every value, which dimension
holds the samples. From it each compute node gets a role:

- **cut**: one tensor whose dimension 0 holds the samples (``batch``, or ``folded`` like Swin's
  windows ``B*nW``): it can be split by rows, so a unit boundary may pass through it;
- **replicated**: carries no samples (position ids, masks built from shapes, parameter views,
  sequence lengths): every rank computes it where it is read, from the values it was traced
  with (it reads only shapes of batch values), and it is never scattered or gathered;
- **size**: a number that is a multiple of the batch (``x.size(0)``): recomputed for each GPU
  set that reads it, from a row-count stand-in of the tensor it measures (no data moves);
- **input-derived**: a cut value computed from model inputs only, without parameters (an
  attention mask expanded from ``attention_mask``): recomputed for each GPU set from that set's
  rows of the inputs, so it never ties the layers that read it into one block;
- **other**: anything else (a tuple of tensors such as ``split`` or an LSTM's output, samples in
  another dimension, a reduction over samples, what the analysis cannot decide). It is grouped
  with every node that reads it, so no boundary passes through it. An in-place write
  (``mask[..., :n] = ...``) is grouped with the values it writes and reads, and the value it
  writes is never recomputed per GPU set.

A unit is a connected group of cut/other nodes (one node for most layers). A unit holding a
reduction over samples or an undecided value must see the whole batch: it is *pinned* to one
GPU (``Unit.pinned`` names the node and why). Units that would depend on each other both ways
are merged; so are units whose outputs nothing reads (an LSTM's unused ``(h_n, c_n)``, the
attention weights ``nn.MultiheadAttention`` returns) with the unit that feeds them. Finally,
while the unit graph is not a chain of nested fork/join blocks (DeepPool's graph reduction
needs one: Q, K and V sharing the attention scores, a value read by every decoder layer), the
smallest offending region, from the fork to its join, is *collapsed* into one composite unit
(``Unit.collapsed`` says what and why), so a plan always exists.

Example:
    >>> import torch, torch.fx as fx
    >>> from tidal.ir import batch_dim, cost
    >>> from tidal.passes import burst_units
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2)
    ...         self.pos = torch.nn.Embedding(6, 4)
    ...     def forward(self, ids):
    ...         pos = self.pos(torch.arange(ids.size(1)))       # replicated
    ...         return self.head(self.emb(ids) + pos)
    >>> gm, ids = fx.symbolic_trace(Net()), torch.randint(0, 10, (4, 6))
    >>> cost.annotate(gm, (ids,))
    >>> _ = batch_dim.analyze(gm, (ids,), 4)
    >>> [u.name for u in burst_units.build(gm).units]
    ['emb', 'add', 'head']
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Optional

import networkx as nx
import torch
import torch.fx as fx

from tidal.ir import batch_dim, meta
from tidal.ir.layer_graph import NotSeriesParallel
from tidal.ir.node_runner import COMPUTE_OPS, fetch_attr
from tidal.passes.burst_problem import check_structure

CUT, REPLICATED, SIZE, INPUT, OTHER = "cut", "replicated", "size", "input-derived", "other"


@dataclass(frozen=True)
class Unit:
    """One layer of a burst plan: fx nodes ``members`` (graph order), the cut members any node
    outside the unit reads (``outputs``), why it must run on one
    GPU (``pinned``, empty if it may be split) and what was collapsed into it (``collapsed``).
    ``name`` is its last output's node name."""

    name: str
    members: tuple[str, ...]
    outputs: tuple[str, ...]
    pinned: str = ""
    collapsed: str = ""


@dataclass(frozen=True)
class Units:
    """The units of a graph in topological order, each one's predecessors (indices of the units
    whose outputs it reads), every compute node's role (by node name) and the values written in
    place (``mutated``)."""

    units: tuple[Unit, ...]
    preds: tuple[tuple[int, ...], ...]
    roles: dict
    mutated: frozenset = frozenset()
    """Values written in place after they are computed: each read from another GPU set moves
    them anew, so it sees the writes made before it."""

    @functools.cached_property
    def _by_member(self) -> dict[str, Unit]:
        return {m: u for u in self.units for m in u.members}

    def of(self, node_name: str) -> Optional[Unit]:
        """The unit holding ``node_name`` (None for replicated, size and input-derived nodes)."""
        return self._by_member.get(node_name)


def _fact(n: fx.Node) -> Optional[batch_dim.Fact]:
    return meta.get_batch_dim(n)


def _is_cut(n: fx.Node) -> bool:
    fact = _fact(n)
    return isinstance(fact, batch_dim.BatchDim) and fact.splits and fact.dim == 0 \
        and len(meta.get_tensors(n)) == 1


def _pin_reason(n: fx.Node) -> str:
    fact = _fact(n)
    if fact is None:
        return f"{n.name!r} was not analysed for its batch dimension"
    for leaf in batch_dim.leaves(fact):
        if leaf.kind == batch_dim.UNKNOWN:
            return leaf.reason or f"{n.name!r}: the batch dimension is unknown"
        if leaf.kind == batch_dim.REDUCED:
            return (f"{n.name!r} reduces over samples ({leaf.reason or 'no sample dimension, '}"
                    f"computed from samples): a shard of the batch would compute something else")
    return ""


def _uses_parameter(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return any(True for _ in gm.get_submodule(n.target).parameters())
    return any(a.op == "get_attr" and isinstance(fetch_attr(gm, a.target), torch.nn.Parameter)
               for a in n.all_input_nodes)


def splits_rows(n: fx.Node) -> bool:
    """Whether ``n``'s value holds the samples in dimension 0 (split and moved by rows)."""
    fact = _fact(n)
    return isinstance(fact, batch_dim.BatchDim) and fact.splits and fact.dim == 0


def roles(gm: fx.GraphModule) -> tuple[dict[str, str], dict[str, str]]:
    """Each compute node's role (module docstring) and, per node that must see the whole batch,
    why (a reduction, an undecided value, a read of an input whose samples are not in dim 0)."""
    role: dict[str, str] = {}
    pins: dict[str, str] = {}
    odd_inputs: dict[str, str] = {}
    mutated = {n.all_input_nodes[0].name for n in gm.graph.nodes
               if batch_dim.mutates(n) and n.all_input_nodes}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            fact = _fact(n)
            if isinstance(fact, batch_dim.BatchDim) and fact.splits and fact.dim != 0:
                odd_inputs[n.name] = (f"it reads input {n.name!r}, whose samples are in dim "
                                      f"{fact.dim} (burst_parallel splits inputs by dim 0)")
            continue
        if n.op not in COMPUTE_OPS:
            continue
        kinds = {leaf.kind for leaf in batch_dim.leaves(_fact(n))}
        ins = n.all_input_nodes
        reads_other = any(role.get(a.name) == OTHER for a in ins)
        odd = [odd_inputs[a.name] for a in ins if a.name in odd_inputs]
        if batch_dim.mutates(n) and any(role.get(a.name) in (CUT, OTHER) for a in ins):
            role[n.name] = OTHER  # an in-place write: in the unit of what it writes and reads
        elif _fact(n) is not None and kinds <= {batch_dim.REPLICATED}:
            role[n.name] = REPLICATED
        elif _fact(n) is not None and kinds <= {batch_dim.REPLICATED, batch_dim.SIZE}:
            role[n.name] = OTHER if reads_other or odd else SIZE
            if odd:  # the size of an input split by another dim: not recomputable per GPU set
                pins[n.name] = odd[0]
        elif _is_cut(n) and not odd:
            derived = all(a.op in ("placeholder", "get_attr") or role.get(a.name) in
                          (REPLICATED, SIZE, INPUT) for a in ins)
            role[n.name] = INPUT if derived and not _uses_parameter(gm, n) \
                and n.name not in mutated else CUT  # a written value is not recomputed
        else:
            role[n.name] = OTHER
            why = _pin_reason(n) or (odd[0] if odd else "")
            if why:
                pins[n.name] = why
    return role, pins


class _Groups:
    """Union-find over node names; the representative of a group is its smallest member."""

    def __init__(self, names: Iterable[str], order: dict[str, int]):
        self.parent = {n: n for n in names}
        self.order = order

    def find(self, n: str) -> str:
        while self.parent[n] != n:
            self.parent[n] = self.parent[self.parent[n]]
            n = self.parent[n]
        return n

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            lo, hi = sorted((ra, rb), key=self.order.__getitem__)
            self.parent[hi] = lo

    def groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for n in sorted(self.parent, key=self.order.__getitem__):
            out.setdefault(self.find(n), []).append(n)
        return out


def build(gm: fx.GraphModule) -> Units:
    """The units of a graph annotated by ``tidal.ir.cost.annotate`` and analysed by
    ``tidal.ir.batch_dim.analyze``. A model output with no sample dimension 0 pins its unit
    (computed whole on one GPU, then copied to every rank); raises ``ValueError`` naming a
    model output that is not one tensor with a dimension 0 (a scalar)."""
    nodes = list(gm.graph.nodes)
    order = {n.name: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    role, pins = roles(gm)
    placed = [n for n in nodes if role.get(n.name) in (CUT, OTHER)]
    uf = _Groups((n.name for n in placed), order)
    for n in placed:
        if role[n.name] == OTHER:
            for u in n.users:
                if role.get(u.name) in (CUT, OTHER):
                    uf.union(n.name, u.name)
            if batch_dim.mutates(n):
                for a in n.all_input_nodes:
                    if role.get(a.name) in (CUT, OTHER):
                        uf.union(n.name, a.name)
    out_node = next(n for n in nodes if n.op == "output")
    whole: dict[str, str] = {}  # model outputs with no sample dim 0: gathered from one GPU
    for a in out_node.all_input_nodes:
        if role.get(a.name) == OTHER:
            tensors = meta.get_tensors(a)
            if len(tensors) != 1 or not tensors[0].shape:
                raise ValueError(f"burst_parallel: the model output {a.name!r} is not one "
                                 f"tensor with a dimension 0 ({_describe(a)}); burst_parallel "
                                 f"gathers outputs by rows")
            whole[a.name] = (f"the model output {a.name!r} has no sample dimension 0 "
                             f"({_describe(a)}): it is computed whole on one GPU")
    collapsed: dict[str, list[str]] = {}
    while True:
        groups = uf.groups()
        g = _quotient(groups, uf, by_name, out_node)
        merged = _merge_cycles_and_dead(g, uf, out_node, groups)
        if merged:
            continue
        topo = list(nx.lexicographical_topological_sort(g, key=order.__getitem__))
        index = {r: i for i, r in enumerate(topo)}
        preds = [tuple(sorted(index[p] for p in g.predecessors(r))) for r in topo]
        region = _non_series_parallel(topo, preds, g)
        if region is None:
            break
        region_nodes, why = region
        keep = min(region_nodes, key=order.__getitem__)
        text = collapsed.setdefault(keep, [])
        text.extend(t for r in region_nodes - {keep} for t in collapsed.pop(r, []))
        text.append(why)
        for r in region_nodes:
            uf.union(keep, r)
    units = []
    for r in topo:
        members = tuple(groups[r])
        outs = tuple(m for m in members if (role[m] == CUT or m in whole) and any(
            u.op == "output" or u.name not in uf.parent or uf.find(u.name) != r
            for u in by_name[m].users)) or (members[-1],)
        pinned = next((pins[m] for m in members if m in pins), "") or \
            next((whole[m] for m in members if m in whole), "")
        reasons = list(dict.fromkeys(t for m in members for t in collapsed.get(m, [])))
        why = "" if not reasons else "collapsed (not series-parallel: " + "; ".join(
            reasons[:2]) + (f"; {len(reasons) - 2} more" if len(reasons) > 2 else "") + ")"
        units.append(Unit(max(outs, key=order.__getitem__), members, outs, pinned, why))
    mutated = frozenset(n.all_input_nodes[0].name for n in nodes
                        if batch_dim.mutates(n) and n.all_input_nodes)
    return Units(tuple(units), tuple(preds), role, mutated)


def _describe(n: fx.Node) -> str:
    fact = _fact(n)
    return batch_dim.node_kind(fact) if not isinstance(fact, batch_dim.BatchDim) else (
        f"{fact.kind}" + (f" in dim {fact.dim}" if fact.dim is not None else "")
        + (f": {fact.reason}" if fact.reason else ""))


def _quotient(groups: dict[str, list[str]], uf: _Groups, by_name: dict,
              out_node: fx.Node) -> nx.DiGraph:
    """Units as graph nodes (by representative), an edge where one reads another's member."""
    g = nx.DiGraph()
    g.add_nodes_from(groups)
    g.graph["outputs"] = {uf.find(a.name) for a in out_node.all_input_nodes
                          if a.name in uf.parent}
    for r, members in groups.items():
        for m in members:
            for a in by_name[m].all_input_nodes:
                if a.name in uf.parent and uf.find(a.name) != r:
                    g.add_edge(uf.find(a.name), r)
    return g


def _merge_cycles_and_dead(g: nx.DiGraph, uf: _Groups, out_node: fx.Node,
                           groups: dict[str, list[str]]) -> bool:
    """Merge units on a cycle, then a unit nothing reads (not the model output) into the unit
    that feeds it (or the next one). Returns whether anything was merged."""
    merged = False
    for scc in nx.strongly_connected_components(g):
        if len(scc) > 1:
            first = min(scc, key=uf.order.__getitem__)
            for r in scc:
                uf.union(first, r)
            merged = True
    if merged:
        return True
    order = sorted(g.nodes, key=uf.order.__getitem__)
    outputs = g.graph["outputs"]
    sinks = [r for r in order if g.out_degree(r) == 0]
    for r in sinks:
        if r in outputs or len(order) == 1:
            continue
        feeders = sorted(g.predecessors(r), key=uf.order.__getitem__)
        other = feeders[-1] if feeders else order[order.index(r) + 1 if r != order[-1] else -2]
        uf.union(other, r)
        return True
    if len(sinks) > 1:  # several outputs: everything from the first of them on becomes one unit
        start = order.index(sinks[0])
        for r in order[start + 1:]:
            uf.union(sinks[0], r)
        return True
    return False


def _non_series_parallel(topo: list[str], preds: list[tuple[int, ...]], g: nx.DiGraph
                         ) -> Optional[tuple[set, str]]:
    """None when the planner can search the unit graph, else the units to collapse and why."""
    try:
        check_structure(topo, preds)
    except NotSeriesParallel as e:  # its fork and join are indices into topo
        fork = None if e.fork is None else topo[e.fork]
        region = NotSeriesParallel(str(e), fork, topo[e.join]).region(g)
        if len(region) < 2:  # a unit that reads no unit where a chain needs one: join the
            region.add(topo[max(e.join - 1, 0) if e.join > 0 else 1])  # one before it
        if fork is None:
            why = f"{topo[e.join]!r} reads no layer where the chain needs one"
        else:
            why = f"branches from {fork!r} meet at {topo[e.join]!r}"
        return region, why
    return None

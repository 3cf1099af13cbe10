"""What each pass's plan adds to the dump of the graph after it (a :class:`viz.Overlay`).

* ``burst_parallel``: every layer's GPU count and ranks (from the node's ``burst_parallel``
  pass meta) as a label line and a fill per count, with a legend; each scatter/gather says how
  many GPUs hold the value before and after it.
* ``layer_groups``: one cluster per weight-transfer group (from the ``group_boundary(k)``
  marker to the next), labelled with the group's layers, bytes and predicted transfer and
  execution times from the ``LayerGroupPlan``; each marker is tied to its group's first node.
* ``round_robin``: each ``submod_k`` lists what its partition holds: member layers (first, last,
  count and kinds), output shapes, predicted forward/backward time and weight bytes.

The overlay is chosen by the plan's registered kind; a plan without one draws the plain graph.

Example:
    >>> import torch, tidal
    >>> from tidal.compiler.viz_passes import overlay_for
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> c = tidal.compile(model, (torch.randn(2, 8),), passes=["layer_groups"])
    >>> r = c.records[-1]
    >>> sorted(set(overlay_for(r.plan, r.graph_before, r.graph_after).groups.values()))[0][:9]
    'group 0: '
"""
from __future__ import annotations

import operator
from types import MappingProxyType
from typing import Any, Callable, Optional, Sequence

import torch.fx as fx

from tidal.compiler import viz
from tidal.ir import meta, ops
from tidal.ir.collectives import GATHER, SCATTER
from tidal.ir.plan import plan_kind

_GPU_FILLS = ("#ffffe5", "#f7fcb9", "#d9f0a3", "#addd8e", "#8fd18f")
_STRUCTURAL = ("placeholder", "output")


def _us(x: float) -> str:
    return f"{x:.3g} us"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3g} MB"


# ----------------------------------------------------------------------------- burst_parallel


def _gpu_fills(counts: Sequence[int]) -> dict[int, str]:
    """A fill per GPU count, light for few GPUs, dark for many."""
    ordered = sorted(set(counts))
    last = max(len(ordered) - 1, 1)
    top = len(_GPU_FILLS) - 1
    return {g: _GPU_FILLS[round(i * top / last)] for i, g in enumerate(ordered)}


def _holders(flat: Sequence[int]) -> str:
    """Who holds a value laid out as ``[lo0, hi0, lo1, hi1, ...]`` (sample range per rank):
    ``4 GPUs``, or ``replicated`` when several ranks hold the same whole range."""
    held = [(lo, hi) for lo, hi in zip(flat[::2], flat[1::2]) if hi > lo]
    if len(held) > 1 and len(set(held)) == 1:
        return "replicated"
    return f"{len(held)} GPU" + ("" if len(held) == 1 else "s")


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


def _burst(plan: Any, before: Optional[fx.Graph], after: fx.Graph) -> viz.Overlay:
    """GPU count per layer (label and fill) and per scatter/gather (holders before -> after)."""
    fills = _gpu_fills([l.gpus for l in plan.layers])
    lines: dict[str, tuple[str, ...]] = {}
    node_fills: dict[str, str] = {}
    for n in after.nodes:
        placed = meta.get_pass_meta(n, "burst_parallel")
        if isinstance(placed, meta.BurstPlacement):    # a layer (a transfer holds its rows)
            unit = "GPU" if placed.gpus == 1 else "GPUs"
            lines[n.name] = (f"{placed.gpus} {unit} · {_ranks_text(placed.ranks)}",)
            node_fills[n.name] = fills.get(placed.gpus, _GPU_FILLS[0])
        elif n.target in (SCATTER, GATHER) and len(n.args) == 3:
            lines[n.name] = (f"{_holders(n.args[1])} → {_holders(n.args[2])}",)
    legend = (("GPUs per layer:", ""),) + tuple((str(g), c) for g, c in fills.items())
    return viz.Overlay(lines=lines, fills=node_fills, legend=legend)


# ----------------------------------------------------------------------------- layer_groups


def _group_label(plan: Any, k: int) -> str:
    """The cluster label of group ``k``: layers, bytes, transfer and execution times."""
    a, b = plan.groups[k]
    span = plan.layers[a] if a == b else f"{plan.layers[a]} … {plan.layers[b]}"
    t = plan.times[k]
    return (f"group {k}: layers {a}-{b} ({b - a + 1}) {span}\n"
            f"{_mb(plan.group_bytes[k])} · transfer {_us(plan.transfer_us[k])} · "
            f"execute {_us(plan.exec_us[k])}\n"
            f"loaded at {_us(t.tx_end)}, runs {t.ex_start:.3g}-{t.ex_end:.3g} us")


def _layer_groups(plan: Any, before: Optional[fx.Graph], after: fx.Graph) -> viz.Overlay:
    """A cluster per group, from its ``group_boundary(k)`` marker up to the next marker; each
    marker drawn inline between the node before it and its group's first node."""
    groups: dict[str, str] = {}
    lines: dict[str, tuple[str, ...]] = {}
    order: list[tuple[str, str]] = []
    label, marker, previous = None, None, None
    for n in after.nodes:
        if n.target is ops.GROUP_BOUNDARY and 0 <= n.args[0] < len(plan.groups):
            k = n.args[0]
            label, marker = _group_label(plan, k), n.name
            lines[n.name] = (f"waits for group {k}: {_mb(plan.group_bytes[k])}",)
            groups[n.name] = label
            order += [(previous, n.name)] if previous else []
            continue
        if marker is not None and n.op != "output":
            order.append((marker, n.name))
            marker = None
        if label is not None and n.op not in _STRUCTURAL:
            groups[n.name] = label
        previous = n.name
    return viz.Overlay(lines=lines, groups=groups, order_edges=tuple(order))


# ----------------------------------------------------------------------------- round_robin


def _partition_members(plan: Any, before: fx.Graph) -> list[list[fx.Node]]:
    """The nodes of each partition: in graph order, from its first layer to the next one's."""
    starts = {name: p for p, name in enumerate(plan.first_layers)}
    members: list[list[fx.Node]] = [[] for _ in plan.first_layers]
    p = 0
    for n in before.nodes:
        p = starts.get(n.name, p)
        if n.op not in _STRUCTURAL:
            members[p].append(n)
    return members


def _outputs(members: Sequence[fx.Node]) -> list[fx.Node]:
    """The members whose value is used outside the partition."""
    inside = set(members)
    return [n for n in members if any(u not in inside for u in n.users)]


def _partition_lines(plan: Any, p: int, members: Sequence[fx.Node]) -> tuple[str, ...]:
    """Label lines of partition ``p``: layers, kinds, output shapes, times, weights."""
    outs = _outputs(members)
    shapes = ", ".join(viz.format_shape(t) for n in outs for t in meta.get_tensors(n))
    last = members[-1].name if members else "?"
    return (f"partition {p}: {plan.layers_per_partition[p]} layers, {len(members)} nodes",
            f"{plan.first_layers[p]} … {last}",
            viz.kind_summary(members),
            f"out {shapes or '?'}",
            f"fwd {_us(plan.fwd_us[p])} · bwd {_us(plan.bwd_us[p])} "
            f"(micro-batch {plan.micro_batch})",
            f"weights {_mb(plan.param_bytes[p])}")


def _round_robin(plan: Any, before: Optional[fx.Graph], after: fx.Graph) -> viz.Overlay:
    """Each ``submod_k`` with what its partition holds; each ``getitem`` of a partition with a
    single output with that output's shape."""
    calls = [n for n in after.nodes if n.op == "call_module"]
    if before is None or len(calls) != plan.partitions:
        return viz.Overlay()
    members = _partition_members(plan, before)
    lines = {c.name: _partition_lines(plan, p, members[p]) for p, c in enumerate(calls)}
    for p, call in enumerate(calls):
        outs = _outputs(members[p])
        for user in call.users:
            if user.target is operator.getitem and len(outs) == 1:
                lines[user.name] = tuple(viz.format_shape(t) for t in meta.get_tensors(outs[0]))
    return viz.Overlay(lines=lines)


_Builder = Callable[[Any, Optional[fx.Graph], fx.Graph], viz.Overlay]
_BUILDERS: "MappingProxyType[str, _Builder]" = MappingProxyType({
    "BurstPlan": _burst,
    "LayerGroupPlan": _layer_groups,
    "RoundRobinPlan": _round_robin,
})


def overlay_for(plan: Any, before: Optional[fx.Graph], after: fx.Graph
                ) -> Optional[viz.Overlay]:
    """The overlay for the graph ``after`` a pass whose plan is ``plan`` (``before`` the graph
    it started from), or None when the plan's kind has none."""
    build = _BUILDERS.get(plan_kind(type(plan))) if plan is not None else None
    return build(plan, before, after) if build is not None else None

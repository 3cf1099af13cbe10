"""Memory timeline of one training iteration: the peak/valley curve of Wavelet's Figure 1a.

From the captured training step (``tidal.ir.capture.capture_train_step``: forward, loss
and backward as one aten graph with fake-tensor values in ``node.meta["val"]``) this computes,
after each node, the bytes of activation storage that are live (liveness over the joint graph;
views and in-place results share their base's storage and are counted once; parameters,
buffers and the gradients and loss the step returns are not activations), the predicted time of each node (FLOPs from torch's flop formulas
at the cluster's peak throughput, plus the bytes it writes at ``mem_gbps``), the forward
duration (which sets the tock wave's offset in tick-tock scheduling) and the activation bytes
saved for backward (forward values the backward reads).

``interleave(timeline, offset_us)`` overlays a tick and a tock wave (the tock shifted by the
offset) in steady state and returns the tick, tock and summed curves on a common time grid.

Example:
    >>> import torch
    >>> from tidal.ir.capture import capture_train_step
    >>> from tidal.ir.memory_timeline import memory_timeline, interleave
    >>> m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> x, y = torch.randn(8, 64), torch.zeros(8, dtype=torch.long)
    >>> tl = memory_timeline(capture_train_step(m, (x,), y, torch.nn.functional.cross_entropy))
    >>> tl.peak_bytes >= tl.saved_bytes > 0 and tl.forward_us > 0
    True
    >>> il = interleave(tl, tl.forward_us)
    >>> il.peak_sum <= 2 * tl.peak_bytes
    True
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from tidal.ir.cluster import Cluster
from tidal.ir.plot import Axis, Guide, Series, color, line_chart

DEFAULT_MEM_GBPS = 1555.0
"""Default device-memory bandwidth in GB/s for the bytes term of a node's time (A100 40 GB)."""

_CONSTANT_PREFIXES = ("params", "buffers", "seed")


@dataclass(frozen=True)
class MemoryTimeline:
    """One iteration's activation memory and time, node by node.

    ``nodes`` the aten node names in execution order; ``live_bytes[k]`` the activation bytes
    live after node k; ``time_us[k]`` node k's predicted time; ``forward_nodes`` how many of the
    nodes are the forward (up to and including the loss); ``saved_bytes`` the activation bytes
    the forward leaves for the backward.
    """

    nodes: tuple[str, ...]
    live_bytes: tuple[int, ...]
    time_us: tuple[float, ...]
    forward_nodes: int
    saved_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Highest live activation bytes over the iteration."""
        return max(self.live_bytes, default=0)

    @property
    def iteration_us(self) -> float:
        """Predicted time of the whole iteration (forward and backward)."""
        return float(sum(self.time_us))

    @property
    def forward_us(self) -> float:
        """Predicted forward time: the offset at which the tock wave starts."""
        return float(sum(self.time_us[: self.forward_nodes]))

    def curve(self) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """(end time of each node in us, live bytes after it): the step curve of Figure 1a."""
        ends, t = [], 0.0
        for dt in self.time_us:
            t += dt
            ends.append(t)
        return tuple(ends), self.live_bytes

    def at(self, t_us: float) -> int:
        """Live activation bytes at time ``t_us`` into the iteration (periodic in the
        iteration time)."""
        period = self.iteration_us
        if period <= 0:
            return self.peak_bytes
        t = t_us % period
        ends, live = self.curve()
        for end, b in zip(ends, live):
            if t < end:
                return b
        return live[-1] if live else 0


@dataclass(frozen=True)
class Interleaving:
    """Tick, tock and summed live activation bytes sampled on ``times_us`` over one period."""

    times_us: tuple[float, ...]
    tick: tuple[int, ...]
    tock: tuple[int, ...]
    offset_us: float

    @property
    def total(self) -> tuple[int, ...]:
        """Tick plus tock at each sample."""
        return tuple(a + b for a, b in zip(self.tick, self.tock))

    @property
    def peak_sum(self) -> int:
        """Peak of the summed curve (the memory two interleaved waves need)."""
        return max(self.total, default=0)

    @property
    def peak_gang(self) -> int:
        """Peak of two waves started together (twice one wave's peak)."""
        return 2 * max(self.tick, default=0)


def _fake_values(node: fx.Node) -> list[torch.Tensor]:
    return [v for v in tree_flatten(node.meta.get("val"))[0] if isinstance(v, torch.Tensor)]


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # fake tensors without a storage: the dense size
        return t.numel() * t.element_size()


def _aliased_input(node: fx.Node) -> Optional[fx.Node]:
    """The input node whose storage ``node``'s output shares (a view, ``detach``, an in-place
    op or ``getitem`` of a tuple that holds views), or None for a fresh allocation."""
    target = node.target
    if node.op != "call_function":
        return None
    schema = getattr(target, "_schema", None)
    if schema is not None:
        if not any(r.alias_info is not None for r in schema.returns):
            return None
        for a in node.args:
            if isinstance(a, fx.Node):
                return a
        return None
    if getattr(target, "__name__", "") == "getitem":
        src = node.args[0]
        return src if isinstance(src, fx.Node) and _aliased_input(src) is not None else None
    return None


def _loss_node(gm: fx.GraphModule) -> fx.Node:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = [a for a in tree_flatten(out.args[0])[0] if isinstance(a, fx.Node)]
    if not flat:
        raise ValueError("memory_timeline: the training-step graph returns no loss node")
    return flat[0]


def node_flops(node: fx.Node) -> float:
    """FLOPs of one aten node from torch's flop formulas on its fake values (0 for ops with
    no formula: elementwise, views, copies)."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0.0

    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args = tree_map(val, node.args)
    kwargs = tree_map(val, dict(node.kwargs))
    try:
        return float(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # a formula that does not accept this call form
        return 0.0


def memory_timeline(step: Any, cluster: Optional[Cluster] = None,
                    mem_gbps: float = DEFAULT_MEM_GBPS) -> MemoryTimeline:
    """The activation-memory timeline of a captured training step (a ``TrainStep`` or its
    ``GraphModule``). Times use ``cluster``'s peak throughput (default ``Cluster(gpus=1)``)
    and ``mem_gbps`` for the bytes each node writes."""
    gm = step.gm if hasattr(step, "gm") else step
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"memory_timeline(step): expected a TrainStep or GraphModule, got "
                        f"{type(step).__name__}")
    if mem_gbps <= 0:
        raise ValueError(f"memory_timeline(mem_gbps={mem_gbps!r}): must be > 0")
    cluster = cluster or Cluster(gpus=1)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    order = {n: i for i, n in enumerate(nodes)}
    loss = _loss_node(gm)
    fwd_end = order[loss]
    if loss.op == "call_function" and getattr(loss.target, "__name__", "") == "getitem":
        fwd_end = max(order[u] for u in loss.args[0].users)  # the loss op's other outputs

    root: dict[fx.Node, fx.Node] = {}
    size: dict[fx.Node, int] = {}
    constant: set[fx.Node] = set()
    for n in nodes:
        src = _aliased_input(n)
        root[n] = root[src] if src is not None and src in root else n
        if root[n] is n:  # a tuple's bytes belong to the getitem nodes that take it apart
            multi = isinstance(n.meta.get("val"), (tuple, list))
            size[n] = 0 if multi else sum(_storage_bytes(t) for t in _fake_values(n))
        if n.op == "placeholder" and n.name.startswith(_CONSTANT_PREFIXES):
            constant.add(n)
    is_const = {n: root[n] in constant for n in nodes}

    last_use: dict[fx.Node, int] = {}
    born: dict[fx.Node, int] = {}
    saved: set[fx.Node] = set()
    for n in nodes:
        r = root[n]
        born.setdefault(r, order[n])
        last_use[r] = max(last_use.get(r, order[n]), order[n])
        for a in n.all_input_nodes:
            ra = root[a]
            last_use[ra] = max(last_use.get(ra, order[n]), order[n])
            if order[n] > fwd_end and order[a] <= fwd_end and not is_const[a]:
                saved.add(ra)
    returned = {root[a] for a in next(n for n in gm.graph.nodes
                                      if n.op == "output").all_input_nodes}

    delta = [0] * (len(nodes) + 1)
    for r, b in size.items():
        if r in constant or r in returned or not b:
            continue
        delta[born[r]] += b
        end = last_use.get(r, born[r])
        if end < len(nodes):
            delta[end + 1] -= b
    live, cur = [], 0
    for k in range(len(nodes)):
        cur += delta[k]
        live.append(cur)

    bytes_per_us = mem_gbps * 1e3
    times = []
    for n in nodes:
        if n.op != "call_function":
            times.append(0.0)
            continue
        written = size.get(n, 0) if root[n] is n else 0
        times.append(cluster.compute_us(node_flops(n)) + written / bytes_per_us)
    return MemoryTimeline(
        nodes=tuple(n.name for n in nodes), live_bytes=tuple(live), time_us=tuple(times),
        forward_nodes=fwd_end + 1,
        saved_bytes=int(sum(size[r] for r in saved if r not in returned)))


def interleave(timeline: MemoryTimeline, offset_us: float, samples: int = 200) -> Interleaving:
    """Overlay two waves of ``timeline`` in steady state, the tock ``offset_us`` after the tick
    (Wavelet's tick-tock: offset = the forward time), sampled ``samples`` times per period."""
    if samples < 2:
        raise ValueError(f"interleave(samples={samples!r}): need at least 2")
    period = timeline.iteration_us
    times = tuple(period * k / samples for k in range(samples))
    tick = tuple(timeline.at(t) for t in times)
    tock = tuple(timeline.at(t - offset_us) for t in times)
    return Interleaving(times_us=times, tick=tick, tock=tock, offset_us=float(offset_us))


@contextlib.contextmanager
def saved_activations(model: torch.nn.Module) -> Iterator[dict[int, int]]:
    """While active, the storages autograd saves for backward (``saved_tensors_hooks``), by
    data pointer -> bytes: each storage once, ``model``'s parameters and buffers excluded."""
    constant = {t.untyped_storage().data_ptr() for t in list(model.parameters()) +
                list(model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in constant:
            seen[s.data_ptr()] = int(s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def measure_saved_bytes(model: torch.nn.Module, inputs: tuple, targets: Any, loss_fn: Any) -> int:
    """Bytes of activation storage eager autograd actually saves for backward in one forward
    (:func:`saved_activations`)."""
    with saved_activations(model) as seen:
        loss = loss_fn(model(*inputs), targets)
    del loss
    return sum(seen.values())


def timeline_svg(il: Interleaving, title: str = "activation memory", width: int = 720,
                 height: int = 260) -> str:
    """The tick, tock and summed curves of an ``Interleaving`` as an SVG line chart (MiB over
    one period in us), with the gang-scheduled peak (twice one wave's peak) as a dashed level."""
    period = (il.times_us[-1] + (il.times_us[1] - il.times_us[0])) if len(il.times_us) > 1 \
        else 1.0
    mib = 2 ** 20
    ymax = max(max(il.total, default=0), il.peak_gang, 1) / mib
    series = [Series(name, tuple((t, v / mib) for t, v in zip(il.times_us, values)), color(i))
              for i, (name, values) in enumerate((("tick", il.tick), ("tock", il.tock),
                                                  ("sum", il.total)))]
    gang = Guide("2x peak (gang)", 0.0, il.peak_gang / mib, period, il.peak_gang / mib)
    return line_chart(series, Axis(0.0, period, "time in one period (us)"),
                      Axis(0.0, ymax, "live activations (MiB)", fmt="{:.3g}"),
                      title=f"{title}: tock offset {il.offset_us:.3g} us, peak tick+tock "
                            f"{il.peak_sum / mib:.3g} MiB vs gang {il.peak_gang / mib:.3g} MiB",
                      guides=[gang], width=width, height=height)

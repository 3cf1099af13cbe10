"""The burst-parallel plan (DeepPool §4): where each layer runs, on how many GPUs and which
ranks, the samples each rank processes and the predicted costs, beside the data-parallel
baseline. The planner that makes it is ``tidal.passes.burst_planner``; the runtime
(``tidal.runtime.burst_exec``) reads it.

Example:
    >>> from tidal.ir.plan import Plan
    >>> from tidal.ir.plans.burst import BurstPlan, LayerPlacement
    >>> l = LayerPlacement("fc", 2, (0, 1), ((0, 2), (2, 4)), 10.0, 1.0, 2.0, 1.3)
    >>> plan = BurstPlan(world=2, batch=4, amp_limit=2.0, algorithm="given", layers=(l,),
    ...                  parallel_branches=(), time_us=13.0, gpu_sec_us=26.0, dp_time_us=13.0,
    ...                  dp_gpu_sec_us=26.0, single_gpu_us=20.0)
    >>> plan.is_data_parallel, Plan.from_json(plan.to_json()) == plan
    (True, True)
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass

from tidal.ir.plan import Plan


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer runs: ``gpus`` ranks ``ranks`` (contiguous), the sample range
    ``[lo, hi)`` of the global batch each of them processes, and its predicted costs."""

    layer: str
    gpus: int
    ranks: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    comp_us: float
    comm_us: float
    sync_us: float
    amp: float
    parallel: bool = False


def _ms(us: float) -> str:
    """A duration in microseconds as ms (or us when below 0.1 ms), 3 significant digits."""
    return f"{us / 1e3:.3g} ms" if us >= 100 else f"{us:.3g} us"


@dataclass(frozen=True)
class BurstPlan(Plan):
    """A burst-parallel plan: per-layer placement, predicted iteration time and GPU-sec, and the
    data-parallel baseline under the same cost model. ``parallel_branches`` lists the
    ``(join layer, branch index)`` of branches run on GPUs of their own."""

    world: int
    batch: int
    amp_limit: float
    algorithm: str
    layers: tuple[LayerPlacement, ...]
    parallel_branches: tuple[tuple[str, int], ...]
    time_us: float
    gpu_sec_us: float
    dp_time_us: float
    dp_gpu_sec_us: float
    single_gpu_us: float
    fallback: bool = False
    composites: tuple[tuple[str, str], ...] = ()
    """``(layer, what)`` for each layer that is several graph nodes planned as one: what was
    collapsed into it (a region that is not series-parallel) or why it runs on one GPU."""

    @property
    def is_data_parallel(self) -> bool:
        """Every layer on all GPUs."""
        return all(l.gpus == self.world for l in self.layers)

    def layer(self, name: str) -> LayerPlacement:
        """The placement of layer ``name``."""
        for l in self.layers:
            if l.layer == name:
                return l
        raise KeyError(f"BurstPlan has no layer {name!r}")

    def summary(self) -> str:
        """One line: what the plan uses and its predicted time against data parallelism. A
        plan that keeps every layer on one GPU says so plainly, with why data parallelism is
        predicted worse."""
        used = max((l.gpus for l in self.layers), default=1)
        speed = self.dp_time_us / self.time_us if self.time_us > 0 else 1.0
        if used == 1 and self.world > 1:
            return (f"plan: 1 GPU of {self.world}, batch {self.batch}: predicted "
                    f"{_ms(self.time_us)}; data parallelism predicted worse "
                    f"({_ms(self.dp_time_us)}, {speed:.3g}x slower) because syncing its "
                    f"gradients costs more than the {_ms(self.single_gpu_us)} of compute it "
                    f"would split")
        kind = "data parallel" if self.is_data_parallel else f"burst on up to {used}"
        return (f"{kind} of {self.world} GPUs, batch {self.batch}: predicted "
                f"{_ms(self.time_us)} vs DP {_ms(self.dp_time_us)} "
                f"({speed:.2f}x), GPU-sec amp {self.amplification:.2f} (limit {self.amp_limit:g})")

    @property
    def amplification(self) -> float:
        """GPU-sec of the plan over the single-GPU iteration time."""
        return self.gpu_sec_us / self.single_gpu_us if self.single_gpu_us > 0 else 1.0

    def table(self) -> str:
        """Per-layer GPUs, ranks, comp/comm/sync µs and amplification, then the totals."""
        from tidal.ir.table import format_table

        rows = [[l.layer, l.gpus, f"{l.ranks[0]}-{l.ranks[-1]}", round(l.comp_us, 1),
                 round(l.comm_us, 1), round(l.sync_us, 1), round(l.amp, 2),
                 "yes" if l.parallel else ""] for l in self.layers]
        text = format_table(["layer", "GPUs", "ranks", "comp us", "comm us", "sync us", "amp",
                             "parallel"], rows)
        dp_amp = self.dp_gpu_sec_us / self.single_gpu_us if self.single_gpu_us > 0 else 1.0
        lines = [text,
                 f"predicted iteration: {self.time_us:.1f} us (GPU-sec amp "
                 f"{self.amplification:.2f}, limit {self.amp_limit:g}, {self.algorithm} search)",
                 f"data parallel:       {self.dp_time_us:.1f} us (GPU-sec amp {dp_amp:.2f}); "
                 f"speedup {self.dp_time_us / max(self.time_us, 1e-12):.3f}x"]
        if self.fallback:
            lines.append("the search could not beat data parallelism: plan is data parallel")
        lines += [f"layer {name}: {what}" for name, what in self.composites]
        return "\n".join(lines)

    def svg(self, width: int = 720) -> str:
        """A bar chart of GPUs per layer (DeepPool's Figure 5 view) as SVG text: one bar per
        layer in execution order, labelled with the layer name below and its GPU count above,
        y ticks at the counts used; the canvas widens so every bar keeps room for its label."""
        n = max(len(self.layers), 1)
        left, top, plot_h = 40, 34, 150
        bar = max(14.0, (width - left - 10) / n)
        width = int(math.ceil(left + n * bar + 10))
        longest = max((len(l.layer) for l in self.layers), default=1)
        base = top + plot_h
        height = int(base + 0.9 * 5.6 * min(longest, _LABEL_CHARS) + 30)
        parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                 f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">',
                 f'<text x="{left}" y="14">GPUs per layer (of {self.world}); predicted '
                 f'{self.time_us:.0f} us vs DP {self.dp_time_us:.0f} us</text>']
        parts += _svg_gpu_ticks(self.world, {l.gpus for l in self.layers}, left, width, top,
                                plot_h)
        parts += [_svg_layer_bar(l, left + k * bar, bar, base, plot_h / max(self.world, 1))
                  for k, l in enumerate(self.layers)]
        parts.append(f'<text x="{left}" y="{height - 8}">layers in execution order '
                     f'(orange: branch on GPUs of its own)</text></svg>')
        return "\n".join(parts)


_LABEL_CHARS = 24


def _svg_gpu_ticks(world: int, counts: set, left: float, width: float, top: float,
                   plot_h: float) -> list[str]:
    """The axis line and a labelled tick with a grid line at 0, ``world`` and each count used."""
    base = top + plot_h
    parts = [f'<line x1="{left}" y1="{base}" x2="{width - 10}" y2="{base}" stroke="#000"/>']
    for g in sorted({0, world} | set(counts)):
        y = base - g * plot_h / max(world, 1)
        parts.append(f'<line x1="{left - 3}" y1="{y:.1f}" x2="{width - 10}" y2="{y:.1f}" '
                     f'stroke="#ddd"/><text x="{left - 5}" y="{y + 3:.1f}" '
                     f'text-anchor="end">{g}</text>')
    return parts


def _svg_layer_bar(l: "LayerPlacement", x: float, bar: float, base: float, scale: float) -> str:
    """One layer's bar, its GPU count above it and its name below the axis (rotated)."""
    bh = l.gpus * scale
    color = "#d95f02" if l.parallel else "#1b9e77"
    name = l.layer if len(l.layer) <= _LABEL_CHARS else l.layer[:_LABEL_CHARS - 1] + "…"
    cx, ly = x + bar / 2, base + 8
    return (f'<rect x="{x:.2f}" y="{base - bh:.2f}" width="{max(bar - 1, 0.5):.2f}" '
            f'height="{bh:.2f}" fill="{color}"><title>{html.escape(l.layer)}: {l.gpus} GPUs'
            f'</title></rect>'
            f'<text x="{cx:.1f}" y="{base - bh - 2:.1f}" text-anchor="middle" font-size="8">'
            f'{l.gpus}</text>'
            f'<text class="layer" x="{cx:.1f}" y="{ly:.1f}" text-anchor="end" font-size="9" '
            f'transform="rotate(-60 {cx:.1f} {ly:.1f})">{html.escape(name)}</text>')

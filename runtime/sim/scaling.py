"""Weak, strong and batch-optimal scaling (DeepPool §2, Figure 1), simulated.

Time to accuracy at ``G`` GPUs and global batch ``B`` is ``steps(B) × iteration(G, B)``: the
number of steps to the target accuracy at that batch comes from a statistical-efficiency table
(an input: global batch -> steps, e.g. from Shallue et al.'s measurements), interpolated
log-log between its rows; the iteration time comes from the simulator. Weak scaling keeps the
per-GPU batch, strong scaling the global batch, batch-optimal scaling picks the table's batch
with the shortest time at each scale. Speedups are over the fastest run on ``gpus[0]`` (one
GPU), so every strategy is measured against the same baseline and batch-optimal is never below
the others.

Example:
    >>> from tidal.runtime.sim.scaling import StepsTable, scaling_speedups
    >>> table = StepsTable(((32, 4000.0), (256, 800.0), (2048, 400.0)))
    >>> iteration = lambda gpus, batch: 10.0 * batch / gpus + 50.0 * (gpus > 1)
    >>> s = scaling_speedups(iteration, table, gpus=(1, 8), per_gpu_batch=32, global_batch=256)
    >>> [round(v, 2) for v in s["strong"]]
    [0.63, 4.32]
"""
from __future__ import annotations

import csv
import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, Union


@dataclass(frozen=True)
class StepsTable:
    """Steps to the target accuracy at each global batch, ``rows`` sorted by batch."""

    rows: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if len(self.rows) < 2:
            raise ValueError("StepsTable: need at least two (global batch, steps) rows")
        batches = [b for b, _ in self.rows]
        if batches != sorted(set(batches)) or any(b < 1 or s <= 0 for b, s in self.rows):
            raise ValueError("StepsTable: batches must be distinct, increasing and >= 1, "
                             "steps > 0")

    @classmethod
    def load(cls, path: Union[str, Path]) -> "StepsTable":
        """Read a CSV with columns ``global_batch,steps``: ``#`` comment lines and one header
        row before the data are skipped."""
        rows: list[tuple[int, float]] = []
        header_seen = False
        with open(path, newline="") as f:
            for n, row in enumerate(csv.reader(f), 1):
                if not row or row[0].strip().startswith("#"):
                    continue
                try:
                    rows.append((int(row[0]), float(row[1])))
                except (ValueError, IndexError):
                    if not rows and not header_seen:
                        header_seen = True
                        continue  # a header before the first row
                    raise ValueError(f"{path}:{n}: expected global_batch,steps, got {row}")
        return cls(tuple(sorted(rows)))

    def steps(self, batch: int) -> float:
        """Steps at ``batch``: log-log interpolation between rows, flat beyond them."""
        rows = self.rows
        if batch <= rows[0][0]:
            return rows[0][1]
        if batch >= rows[-1][0]:
            return rows[-1][1]
        for (b0, s0), (b1, s1) in zip(rows, rows[1:]):
            if b0 <= batch <= b1:
                w = (math.log(batch) - math.log(b0)) / (math.log(b1) - math.log(b0))
                return math.exp(math.log(s0) + w * (math.log(s1) - math.log(s0)))
        raise AssertionError("unreachable")


def scaling_speedups(iteration_us: Callable[[int, int], float], table: StepsTable,
                     gpus: Sequence[int], per_gpu_batch: int, global_batch: int
                     ) -> dict[str, list[float]]:
    """Speedup in time to accuracy of weak, strong and batch-optimal scaling at each GPU count
    in ``gpus`` (the first should be 1) over the fastest run on ``gpus[0]``.
    ``iteration_us(g, b)`` is one iteration's time on ``g`` GPUs at global batch ``b``."""
    def tta(g: int, b: int) -> float:
        return table.steps(b) * iteration_us(g, b)

    def best(g: int) -> float:
        return min(tta(g, b) for b, _ in table.rows if b >= g and b % g == 0)

    times = {"weak": [tta(g, per_gpu_batch * g) for g in gpus],
             "strong": [tta(g, global_batch) for g in gpus],
             "batch-optimal": [best(g) for g in gpus]}
    base = times["batch-optimal"][0]
    return {mode: [base / x for x in t] for mode, t in times.items()}


_COLORS = {"weak": "#1f77b4", "strong": "#ff7f0e", "batch-optimal": "#2ca02c"}


@dataclass(frozen=True)
class _Axes:
    """The plot area of a log-log chart (pixels) and its data ranges (``x``: GPU counts,
    ``y``: speedups); ``x``/``y`` map data to pixels, clamped into the plot area."""

    left: float
    right: float
    top: float
    bottom: float
    x_range: tuple[float, float]
    y_range: tuple[float, float]

    @staticmethod
    def _frac(v: float, lo: float, hi: float) -> float:
        if not (v > 0 and math.isfinite(v)) or hi <= lo:
            return 0.0 if not v > lo else 1.0
        return min(max((math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo)), 0.0), 1.0)

    def x(self, g: float) -> float:
        return self.left + (self.right - self.left) * self._frac(g, *self.x_range)

    def y(self, s: float) -> float:
        return self.bottom - (self.bottom - self.top) * self._frac(s, *self.y_range)


def _log_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks covering ``[lo, hi]`` (only powers of ten when that gives over 8), starting
    at or below ``lo`` and ending at or above ``hi``."""
    for mantissas in ((1, 2, 5), (1,)):
        first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        ticks = sorted(m * 10.0 ** e for e in range(first, last + 1) for m in mantissas)
        below = [t for t in ticks if t <= lo * (1 + 1e-9)]
        above = [t for t in ticks if t >= hi * (1 - 1e-9)]
        ticks = [t for t in ticks if below[-1] <= t <= above[0]]
        if len(ticks) <= 8:
            return ticks
    return ticks


def _speedup_axes(gpus: Sequence[int], speedups: dict[str, list[float]], width: int,
                  height: int) -> tuple[_Axes, list[float]]:
    """Axes that hold every speedup and the linear-scaling diagonal, and the y ticks."""
    values = [v for vals in speedups.values() for v in vals if v > 0 and math.isfinite(v)]
    values += [1.0, gpus[-1] / gpus[0]]
    ticks = _log_ticks(min(values), max(values))
    x_range = (float(gpus[0]), float(max(gpus[-1], gpus[0])))
    axes = _Axes(left=64, right=width - 20, top=62, bottom=height - 46, x_range=x_range,
                 y_range=(ticks[0], ticks[-1]))
    return axes, ticks


def _axis_marks(axes: _Axes, gpus: Sequence[int], ticks: Sequence[float],
                height: int) -> list[str]:
    """Frame, y ticks with labels and grid lines, x tick labels, axis titles."""
    a = axes
    parts = [f'<rect x="{a.left}" y="{a.top}" width="{a.right - a.left}" '
             f'height="{a.bottom - a.top}" fill="none" stroke="#888"/>', '<g class="y-ticks">']
    for t in ticks:
        y = a.y(t)
        parts.append(f'<line x1="{a.left - 4}" y1="{y:.1f}" x2="{a.right}" y2="{y:.1f}" '
                     f'stroke="#e5e5e5"/><text x="{a.left - 6}" y="{y + 4:.1f}" '
                     f'text-anchor="end">{t:g}×</text>')
    parts.append('</g><g class="x-ticks">')
    parts += [f'<text x="{a.x(g):.1f}" y="{a.bottom + 16}" text-anchor="middle">{g}</text>'
              for g in gpus]
    parts.append(f'</g><text x="{(a.left + a.right) / 2}" y="{height - 10}" '
                 f'text-anchor="middle">GPUs</text>')
    parts.append(f'<text x="14" y="{(a.top + a.bottom) / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {(a.top + a.bottom) / 2})">'
                 f'speedup in time to accuracy</text>')
    return parts


def scaling_svg(gpus: Sequence[int], speedups: dict[str, list[float]], title: str,
                width: int = 560, height: int = 380) -> str:
    """A log-log line chart of speedup against GPU count, one line per strategy, with the
    linear-scaling diagonal. The y range covers every value (labelled ticks at 1-2-5 steps);
    every mark lies inside the ``0 0 width height`` view box."""
    axes, ticks = _speedup_axes(gpus, speedups, width, height)
    a = axes
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
             f'<defs><clipPath id="plot"><rect x="{a.left}" y="{a.top}" width="{a.right - a.left}" '
             f'height="{a.bottom - a.top}"/></clipPath></defs>',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13">'
             f'{html.escape(title)}</text>']
    parts += _axis_marks(axes, gpus, ticks, height)
    parts.append(f'<g clip-path="url(#plot)"><line x1="{a.x(gpus[0]):.1f}" y1="{a.y(1):.1f}" '
                 f'x2="{a.x(gpus[-1]):.1f}" y2="{a.y(gpus[-1] / gpus[0]):.1f}" stroke="#bbb" '
                 f'stroke-dasharray="4 3"/>')
    for mode, vals in speedups.items():
        pts = " ".join(f"{a.x(g):.1f},{a.y(v):.1f}" for g, v in zip(gpus, vals))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{_COLORS.get(mode, "#555")}" '
                     f'stroke-width="2"/>')
    parts.append("</g>")
    entries = [(f"{mode} ({vals[-1]:.2f}× at {gpus[-1]})", _COLORS.get(mode, "#555"))
               for mode, vals in speedups.items()] + [("- - linear scaling", "#999")]
    column = (width - a.left) / 2
    parts += [f'<text x="{a.left + (k % 2) * column:.1f}" y="{34 + 14 * (k // 2)}" '
              f'fill="{color}">{html.escape(text)}</text>'
              for k, (text, color) in enumerate(entries)]
    parts.append("</svg>")
    return "\n".join(parts)


def gpu_counts(gpus: int) -> list[int]:
    """The powers of two up to ``gpus``: 1, 2, 4, ..."""
    return [1 << k for k in range(gpus.bit_length()) if 1 << k <= gpus]


def simulate_scaling(gm, cluster, table: StepsTable, global_batch: int
                     ) -> tuple[list[int], int, dict[str, list[float]]]:
    """Weak, strong and batch-optimal speedups of data parallelism for an annotated graph on
    ``cluster`` (1, 2, 4, ... ``cluster.gpus`` GPUs, iteration times simulated from
    ``runtime.sim.programs``): returns the GPU counts, the weak-scaling per-GPU batch
    (``global_batch / cluster.gpus``) and :func:`scaling_speedups`."""
    from dataclasses import replace

    from tidal.runtime.sim.programs import data_parallel, layer_times, summarize

    gpus = gpu_counts(cluster.gpus)
    cache: dict[int, object] = {}

    def times(b: int):
        if b not in cache:
            cache[b] = layer_times(gm, cluster, b)
        return cache[b]

    def iteration(g: int, b: int) -> float:
        return summarize(data_parallel(times, g, b, replace(cluster, gpus=g)), g, b).iteration_us

    per_gpu = max(1, global_batch // cluster.gpus)
    return gpus, per_gpu, scaling_speedups(iteration, table, gpus, per_gpu, global_batch)


def scaling_text(gpus: Sequence[int], speedups: dict[str, list[float]]) -> str:
    """The speedups as a plain-text table (one row per strategy, one column per GPU count)."""
    head = f"{'strategy':14s}" + "".join(f"{g:>9d}" for g in gpus)
    rows = [f"{mode:14s}" + "".join(f"{v:8.2f}x" for v in vals) for mode, vals in speedups.items()]
    return "\n".join([head + "   (GPUs)"] + rows)

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


def scaling_svg(gpus: Sequence[int], speedups: dict[str, list[float]], title: str,
                width: int = 560, height: int = 360) -> str:
    """A log-log line chart of speedup against GPU count, one line per strategy, with the
    linear-scaling diagonal."""
    pad, colors = 50, {"weak": "#1f77b4", "strong": "#ff7f0e", "batch-optimal": "#2ca02c"}
    top = max([max(v) for v in speedups.values()] + [gpus[-1] / gpus[0]])
    lx = lambda g: pad + (width - 2 * pad) * math.log(g / gpus[0]) / max(math.log(gpus[-1] / gpus[0]), 1e-9)  # noqa: E731
    ly = lambda s: height - pad - (height - 2 * pad) * math.log(max(s, 1e-3)) / max(math.log(top), 1e-9)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13">{title}</text>',
             f'<line x1="{lx(gpus[0])}" y1="{ly(1)}" x2="{lx(gpus[-1])}" '
             f'y2="{ly(gpus[-1] / gpus[0])}" stroke="#bbb" stroke-dasharray="4 3"/>']
    for g in gpus:
        parts.append(f'<text x="{lx(g)}" y="{height - pad + 16}" text-anchor="middle">{g}</text>')
    parts.append(f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">GPUs</text>')
    parts.append(f'<text x="12" y="{height / 2}" transform="rotate(-90 12 {height / 2})" '
                 f'text-anchor="middle">speedup in time to accuracy</text>')
    for k, (mode, vals) in enumerate(speedups.items()):
        pts = " ".join(f"{lx(g):.1f},{ly(v):.1f}" for g, v in zip(gpus, vals))
        c = colors.get(mode, "#555")
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        parts.append(f'<text x="{pad + 8}" y="{pad + 14 * k}" fill="{c}">{mode} '
                     f'(x{vals[-1]:.2f} at {gpus[-1]})</text>')
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

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
    >>> from tidal.sim.scaling import StepsTable, scaling_speedups
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

from tidal.ir.plot import Axis, Guide, Series, color, line_chart, log_ticks


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
                width: int = 560, height: int = 380) -> str:
    """A log-log line chart of speedup against GPU count, one line per strategy, with the
    linear-scaling diagonal. The y range covers every value (labelled ticks at 1-2-5 steps);
    every mark lies inside the ``0 0 width height`` view box."""
    values = [v for vals in speedups.values() for v in vals if v > 0 and math.isfinite(v)]
    values += [1.0, gpus[-1] / gpus[0]]
    ticks = log_ticks(min(values), max(values))
    x = Axis(float(gpus[0]), float(max(gpus[-1], gpus[0])), "GPUs", log=True,
             ticks=tuple(float(g) for g in gpus))
    y = Axis(ticks[0], ticks[-1], "speedup in time to accuracy", log=True, ticks=ticks,
             fmt="{:g}×")
    series = [Series(f"{mode} ({vals[-1]:.2f}× at {gpus[-1]})", tuple(zip(gpus, vals)),
                     color(k), width=2.0) for k, (mode, vals) in enumerate(speedups.items())]
    linear = Guide("linear scaling", gpus[0], 1.0, gpus[-1], gpus[-1] / gpus[0])
    return line_chart(series, x, y, title=title, guides=[linear], width=width, height=height)


def gpu_counts(gpus: int) -> list[int]:
    """The powers of two up to ``gpus``: 1, 2, 4, ..."""
    return [1 << k for k in range(gpus.bit_length()) if 1 << k <= gpus]


def simulate_scaling(gm, cluster, table: StepsTable, global_batch: int
                     ) -> tuple[list[int], int, dict[str, list[float]]]:
    """Weak, strong and batch-optimal speedups of data parallelism for an annotated graph on
    ``cluster`` (1, 2, 4, ... ``cluster.gpus`` GPUs, iteration times simulated from
    ``sim.programs``): returns the GPU counts, the weak-scaling per-GPU batch
    (``global_batch / cluster.gpus``) and :func:`scaling_speedups`."""
    from dataclasses import replace

    from tidal.sim.programs import data_parallel, layer_times, summarize

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

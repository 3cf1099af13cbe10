"""The burst-parallel plan (DeepPool §4): where each layer runs, on how many GPUs and which
ranks, the samples each rank processes and the predicted costs, beside the data-parallel
baseline. The planner that makes it is ``tidal.passes.burst_planner``; the runtime
(``tidal.runtime.programs.burst``) reads it.

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

from dataclasses import dataclass
from typing import ClassVar

from tidal.ir.plan import Plan
from tidal.ir.plot import Axis, Column, Key, bar_chart, color


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer runs: ``gpus`` ranks ``ranks`` (contiguous), the sample range
    ``[lo, hi)`` of the global batch each of them processes, and its predicted costs:
    forward + backward (``comp_us``), moving its input (``comm_us``) and the time its gradient
    sync adds to the iteration (``sync_us``: all of it when sync follows the layer, or only
    what runs past the end of backward when sync overlaps backward)."""

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

    pass_name: ClassVar[str] = "burst_parallel"

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

    def world_size(self) -> int:
        """The ranks the plan runs on: its ``world``."""
        return self.world

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
        layer in execution order, labelled with the layer name below (class ``layer``) and its
        GPU count above, y ticks at the counts used; the canvas widens so every bar keeps room
        for its label."""
        ticks = tuple(sorted({0, self.world} | {l.gpus for l in self.layers}))
        columns = [Column(l.layer, l.gpus, color(1) if l.parallel else color(0),
                          f"{l.layer}: {l.gpus} GPUs") for l in self.layers]
        keys = [Key("layer on its GPUs", color(0))]
        if any(l.parallel for l in self.layers):
            keys.append(Key("branch on GPUs of its own", color(1)))
        return bar_chart(columns, Axis(0, max(self.world, 1), "GPUs", ticks=ticks),
                         title=f"GPUs per layer (of {self.world}); predicted "
                               f"{self.time_us:.0f} us vs DP {self.dp_time_us:.0f} us",
                         x_label="layers in execution order", legend=keys, width=width,
                         label_class="layer")

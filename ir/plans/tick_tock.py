"""The plan of the ``tick_tock`` pass (Wavelet §3.2): ranks, the per-wave batch, the tock offset,
the activation-memory peaks and the tick/tock schedule. The pass is ``tidal.passes.tick_tock``;
the runtime's program builder (``tidal.runtime.programs.tick_tock``) runs the plan."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from tidal.ir.memory_fit import MemoryFit, StepBytes
from tidal.ir.plan import Plan
from tidal.ir.schedule import Schedule


@dataclass(frozen=True)
class TickTockPlan(Plan):
    """Ranks, the per-wave batch of one rank, the predicted forward (the tock offset) and
    iteration times, the activation-memory peaks (one wave; tick+tock interleaved; two waves
    started together) and the schedule; under a memory budget (``Cluster(memory_gb=...)``) the
    batches it allows (``memory``) and one wave step's memory predicted beside measured
    (``step_bytes``)."""

    pass_name: ClassVar[str] = "tick_tock"

    ranks: int
    wave_batch: int
    offset_us: float
    iteration_us: float
    saved_bytes: int
    peak_bytes: int
    peak_interleaved: int
    peak_gang: int
    schedule: Schedule
    memory: Optional[MemoryFit] = None
    step_bytes: Optional[StepBytes] = None

    def summary(self) -> str:
        mib = 2 ** 20
        return (f"2 waves x {self.ranks} ranks, batch {self.wave_batch}/wave/rank, tock offset "
                f"{self.offset_us:.3g} us; peak activations {self.peak_interleaved / mib:.3g} "
                f"MiB interleaved vs {self.peak_gang / mib:.3g} MiB gang")

    def table(self) -> str:
        return "\n".join([self.summary(), self.schedule.table()])

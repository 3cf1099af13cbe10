"""The plan of the ``round_robin`` pass (Wavelet §3.3): the partitions, their predicted times
and weight bytes, the cut bytes and the round-robin schedule. The pass is
``tidal.passes.round_robin``; the runtime's program builder (``tidal.runtime.programs.round_robin``) runs the plan."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tidal.ir.plan import Plan
from tidal.ir.schedule import Schedule


@dataclass(frozen=True)
class RoundRobinPlan(Plan):
    """The partitions (layer names, first layer of each), their predicted times and weight
    bytes, the cut bytes and the schedule."""

    pass_name: ClassVar[str] = "round_robin"

    partitions: int
    micro_batch: int
    first_layers: tuple[str, ...]
    layers_per_partition: tuple[int, ...]
    fwd_us: tuple[float, ...]
    bwd_us: tuple[float, ...]
    param_bytes: tuple[int, ...]
    cut_bytes: tuple[float, ...]
    schedule: Schedule

    def summary(self) -> str:
        return (f"{self.partitions} partitions of {list(self.layers_per_partition)} layers, "
                f"micro-batch {self.micro_batch}, "
                f"{int(self.schedule.note('switches_per_rank'))} switches/rank/step")

    def table(self) -> str:
        rows = [f"partition {p}: from {self.first_layers[p]} ({self.layers_per_partition[p]} "
                f"layers) fwd {self.fwd_us[p]:.3g} us bwd {self.bwd_us[p]:.3g} us, "
                f"{self.param_bytes[p] / 2**20:.3g} MiB weights"
                for p in range(self.partitions)]
        return "\n".join([self.summary(), *rows, self.schedule.table()])

    def switch_bytes_per_step(self) -> int:
        """Weight bytes one rank loads per step: every partition in the forward and every
        partition but the last again in the backward."""
        return int(sum(self.param_bytes) + sum(self.param_bytes[:-1]))

"""``CompressionPlan``: what the ``compression`` pass chose, as the data the runtime builds the
gradient sync from.

The plan names the compressor by its spec (:mod:`tidal.ir.compression_model`), whether it is on,
the buckets (parameter names in sync order) and their byte cap, and Accordion's settings: the
``low``/``high`` levels, ``eta``, the window in optimizer steps, and the learning-rate decays
ahead recorded from the schedule given to the pass (``accordion_lr_decays``, up to
``accordion_lr_horizon`` optimizer steps). ``wraps`` names the parallelism pass whose gradient
sync it replaces (None: the runtime trains data parallel on its own). The runtime reads it in
:func:`tidal.runtime.programs.compression.compression_executor`.

Example:
    >>> from tidal.ir.plan import Plan
    >>> from tidal.ir.plans.compression import CompressionPlan
    >>> plan = CompressionPlan(compressor="powersgd:2", mode="on", enabled=True,
    ...                        bucket_bytes=25 * 2**20, buckets=(("fc.bias", "fc.weight"),),
    ...                        grad_bytes=4 * 330, payload_bytes=4 * 92,
    ...                        accordion=(2.0, 1.0, 0.5, 10))
    >>> plan.summary(), plan.sync_compressor, plan.accordion_levels
    ('powersgd:2: 1 bucket, 330 -> 92 floats/step (3.6x)', 'powersgd:2', (2, 1))
    >>> Plan.from_json(plan.to_json()) == plan
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from tidal.ir import compression_model
from tidal.ir.plan import Plan


@dataclass(frozen=True)
class CompressionPlan(Plan):
    """What the pass chose: the compressor spec (kept when ``enabled`` is false, which means a
    plain all-reduce), the buckets (parameter names in sync order), gradient and payload bytes
    per step per rank, and the model's prediction (``mode="auto"``). ``accordion``: ``(low,
    high, eta, interval)`` or None; ``accordion_lr_decays``: ``(steps done, lr now, lowest lr
    of the next window)`` at each window end with a decay ahead, among the window ends whose
    next window lies within the first ``accordion_lr_horizon`` optimizer steps (0: no schedule
    was given; beyond the horizon the runtime sees a decay one window late). ``wraps``: the
    parallelism pass whose gradient sync this plan replaces, or None."""

    pass_name: ClassVar[str] = "compression"

    compressor: str
    mode: str
    enabled: bool
    bucket_bytes: int
    buckets: tuple[tuple[str, ...], ...]
    grad_bytes: int
    payload_bytes: int
    predicted_sync_ms: Optional[float] = None
    predicted_compressed_ms: Optional[float] = None
    accordion: Optional[tuple[float, float, float, int]] = None
    accordion_lr_decays: tuple[tuple[int, float, float], ...] = ()
    accordion_lr_horizon: int = 0
    wraps: Optional[str] = None

    @property
    def ratio(self) -> float:
        """Gradient bytes over bytes sent."""
        return self.grad_bytes / max(1, self.payload_bytes)

    @property
    def sync_compressor(self) -> str:
        """The spec the runtime syncs with: the compressor, or ``"none"`` (plain averaging
        all-reduce) when compression is off."""
        return self.compressor if self.enabled else "none"

    @property
    def accordion_levels(self) -> Optional[tuple[Any, Any]]:
        """Accordion's ``(low, high)`` levels in the compressor's level type (a PowerSGD rank
        as an int), or None without Accordion."""
        if self.accordion is None:
            return None
        name = compression_model.parse_spec(self.compressor).name
        return (compression_model.as_level(name, self.accordion[0]),
                compression_model.as_level(name, self.accordion[1]))

    def summary(self) -> str:
        name = self.compressor if self.enabled else "off (plain all-reduce)"
        n = len(self.buckets)
        return (f"{name}: {n} bucket{'s' if n != 1 else ''}, {self.grad_bytes // 4} -> "
                f"{self.payload_bytes // 4} floats/step ({self.ratio:.2g}x)")

    def table(self) -> str:
        lines = [self.summary()]
        if self.wraps is not None:
            lines.append(f"gradient sync of {self.wraps}")
        if self.predicted_sync_ms is not None:
            lines.append(f"predicted step: sync SGD {self.predicted_sync_ms:.3g} ms, "
                         f"{self.compressor} {self.predicted_compressed_ms:.3g} ms")
        if self.accordion is not None:
            low, high, eta, interval = self.accordion
            lines.append(f"accordion: levels {low:g} (critical) / {high:g}, eta {eta:g}, "
                         f"window {interval} steps")
            if self.accordion_lr_horizon:
                ends = ", ".join(str(d[0]) for d in self.accordion_lr_decays) or "none"
                lines.append(f"accordion: learning-rate decay ahead after steps {ends} "
                             f"(schedule read for {self.accordion_lr_horizon} steps)")
        lines += [f"bucket {i}: {', '.join(b)}" for i, b in enumerate(self.buckets)]
        return "\n".join(lines)

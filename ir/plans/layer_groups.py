"""The plan of the ``layer_groups`` pass (PipeSwitch's pipelined model transmission): the layer
groups, their bytes and the predicted pipeline, and the pipeline model it is predicted with.

Groups are sent one after another over one link; a group of layers ``i..j`` takes
``T(i, j) = overhead_us + bytes(i..j) / bytes_per_us`` to send and ``E(i, j) = sum(exec_us[i..j])``
to run; group ``k`` runs once its transfer is done and group ``k-1`` has run. The planner that
chooses the groups is ``tidal.passes.group_planner``; the runtime
(``tidal.runtime.programs.layer_groups``) streams the weights in group by group.

Example:
    >>> from tidal.ir.plans.layer_groups import timeline
    >>> [t.ex_end for t in timeline(((0, 0), (1, 1)), [100, 100], [5.0, 5.0], 100.0, 0.0)]
    [6.0, 11.0]
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

from tidal.ir.plan import Plan
from tidal.ir.table import format_table

Groups = tuple[tuple[int, int], ...]
"""A grouping: consecutive inclusive layer ranges ``(first, last)`` covering ``0..n-1``."""


@dataclass(frozen=True)
class GroupTimes:
    """Predicted timeline of one group: transfer and execution start/end in microseconds."""

    tx_start: float
    tx_end: float
    ex_start: float
    ex_end: float


class GroupCosts:
    """Validated per-layer costs with prefix sums, for O(1) ``T(i, j)`` and ``E(i, j)``, and the
    pipeline timeline of a grouping under them. Raises ``ValueError`` naming the value at fault."""

    def __init__(self, layer_bytes: Sequence[float], exec_us: Sequence[float],
                 bytes_per_us: float, overhead_us: float):
        if not bytes_per_us > 0 or not math.isfinite(bytes_per_us):
            raise ValueError(f"bytes_per_us={bytes_per_us!r}: the link bandwidth must be > 0")
        if not overhead_us >= 0:
            raise ValueError(f"overhead_us={overhead_us!r}: must be >= 0")
        if len(layer_bytes) != len(exec_us):
            raise ValueError(f"layer_bytes has {len(layer_bytes)} layers but exec_us has "
                             f"{len(exec_us)}")
        if not len(layer_bytes):
            raise ValueError("no layers to group")
        for name, values in (("layer_bytes", layer_bytes), ("exec_us", exec_us)):
            for i, v in enumerate(values):
                if not (float(v) >= 0 and math.isfinite(float(v))):
                    raise ValueError(f"{name}[{i}]={v!r}: must be a finite number >= 0")
        self.n = len(layer_bytes)
        self.bw = float(bytes_per_us)
        self.oh = float(overhead_us)
        self.bytes_prefix = [0.0] + list(itertools.accumulate(float(b) for b in layer_bytes))
        self.exec_prefix = [0.0] + list(itertools.accumulate(float(e) for e in exec_us))

    def nbytes(self, i: int, j: int) -> float:
        return self.bytes_prefix[j + 1] - self.bytes_prefix[i]

    def T(self, i: int, j: int) -> float:
        """Transfer time of layers i..j (0 for an empty range)."""
        return 0.0 if j < i else self.oh + (self.bytes_prefix[j + 1] - self.bytes_prefix[i]) / self.bw

    def E(self, i: int, j: int) -> float:
        """Execution time of layers i..j (0 for an empty range)."""
        return 0.0 if j < i else self.exec_prefix[j + 1] - self.exec_prefix[i]

    def timeline(self, groups: Groups) -> tuple[GroupTimes, ...]:
        """The timeline of ``groups`` (not checked: see :meth:`check`)."""
        tx = ex = 0.0
        out = []
        for a, b in groups:
            tx_start, tx = tx, tx + self.T(a, b)
            ex_start = max(tx, ex)
            ex = ex_start + self.E(a, b)
            out.append(GroupTimes(tx_start, tx, ex_start, ex))
        return tuple(out)

    def check(self, groups: Groups) -> None:
        """Raise ``ValueError`` unless ``groups`` are consecutive ranges covering every layer."""
        n, nxt = self.n, 0
        for a, b in groups:
            if a != nxt or b < a:
                raise ValueError(f"groups {groups} are not consecutive ranges covering 0..{n - 1}")
            nxt = b + 1
        if nxt != n:
            raise ValueError(f"groups {groups} do not cover layers 0..{n - 1}")


def timeline(groups: Groups, layer_bytes: Sequence[float], exec_us: Sequence[float],
             bytes_per_us: float, overhead_us: float) -> tuple[GroupTimes, ...]:
    """The predicted transfer/execution timeline of ``groups`` (one entry per group)."""
    c = GroupCosts(layer_bytes, exec_us, bytes_per_us, overhead_us)
    c.check(groups)
    return c.timeline(groups)


@dataclass(frozen=True)
class LayerGroupPlan(Plan):
    """What the ``layer_groups`` pass chose: the layer groups, their bytes and the predicted
    pipeline (microseconds from the start of the first transfer), beside the per-layer and
    single-group pipelines."""

    pass_name: ClassVar[str] = "layer_groups"

    layers: tuple[str, ...]
    layer_bytes: tuple[int, ...]
    layer_exec_us: tuple[float, ...]
    groups: tuple[tuple[int, int], ...]
    group_bytes: tuple[int, ...]
    transfer_us: tuple[float, ...]
    exec_us: tuple[float, ...]
    times: tuple[GroupTimes, ...]
    total_us: float
    per_layer_us: float
    single_group_us: float
    bytes_per_us: float
    overhead_us: float
    strategy: str = "optimal"
    weight_store: Optional[str] = None
    """A weight store path: the runtime streams the weights in from it, group by group, on the
    compiled model's first call (``layer_groups(weight_store=...)``)."""

    def timeline_of(self, groups: Groups) -> tuple[GroupTimes, ...]:
        """The predicted timeline of another grouping of the same layers."""
        return timeline(groups, self.layer_bytes, self.layer_exec_us, self.bytes_per_us,
                        self.overhead_us)

    def summary(self) -> str:
        return (f"{len(self.groups)} groups of {len(self.layers)} layers, "
                f"{self.total_us / 1e3:.3g} ms predicted (per-layer "
                f"{self.per_layer_us / 1e3:.3g} ms, one group {self.single_group_us / 1e3:.3g} ms)")

    def table(self) -> str:
        rows = []
        for k, ((a, b), nbytes, t, e, tm) in enumerate(zip(
                self.groups, self.group_bytes, self.transfer_us, self.exec_us, self.times)):
            span = self.layers[a] if a == b else f"{self.layers[a]} .. {self.layers[b]}"
            rows.append([k, f"{a}-{b} ({b - a + 1}) {span}", nbytes, round(t, 1), round(e, 1),
                         f"{tm.tx_start:.1f}-{tm.tx_end:.1f}", f"{tm.ex_start:.1f}-{tm.ex_end:.1f}"])
        head = format_table(["group", "layers", "bytes", "T us", "E us", "transfer us",
                             "execute us"], rows)
        return head + "\n" + self.summary()

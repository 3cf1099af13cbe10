"""The plan of the ``clustered_attention`` pass (CHAI): per attention layer, the cluster count
chosen by the offline calibration (``tidal.passes.chai_calibrate``), the elbow, the error curve
and CHAI-static's membership, with an exact JSON round trip. The decode runtime
(``tidal.runtime.chai.decode``) reads it.

Example:
    >>> from tidal.ir.plan import Plan
    >>> from tidal.ir.plans.chai import ChaiPlan, LayerChoice
    >>> c = LayerChoice(layer=0, scope="layers.0.attn", num_heads=4, num_kv_heads=2, head_dim=8,
    ...                 chosen_k=2, elbow_k=2)
    >>> plan = ChaiPlan(layers=(c,))
    >>> c.kv_of_head, plan.counts(), Plan.from_json(plan.to_json()) == plan
    ((0, 0, 1, 1), {0: 2}, True)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from tidal.ir.head_clusters import FIRST_TOKENS, check_count, kv_head_map
from tidal.ir.plan import Plan


@dataclass(frozen=True)
class LayerChoice:
    """One attention layer's calibration result: ``chosen_k`` (None: left unclustered),
    ``elbow_k``, the clustering ``errors`` for k = 1..H, and CHAI-static's ``static_labels`` /
    ``static_reps`` at the chosen k (empty when unclustered)."""

    layer: int
    scope: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    chosen_k: Optional[int]
    elbow_k: int
    errors: tuple[float, ...] = ()
    static_labels: tuple[int, ...] = ()
    static_reps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.chosen_k is not None:
            check_count(self.chosen_k, self.num_heads, f"layer {self.layer} ({self.scope})")

    @property
    def kv_of_head(self) -> tuple[int, ...]:
        """The KV head each query head reads (``head_clusters.kv_head_map``)."""
        return kv_head_map(self.num_heads, self.num_kv_heads)


@dataclass(frozen=True)
class ChaiPlan(Plan):
    """Per-layer cluster counts for ``clustered_attention``; ``mode`` "online" (membership from
    each sequence's first ``first_tokens`` tokens) or "static" (the offline membership);
    ``clustering`` how heads are clustered online (``tidal.ir.head_clusters.CLUSTERINGS``:
    "kmeans" for ``calibrate(mode="paper")``)."""

    pass_name: ClassVar[str] = "clustered_attention"

    layers: tuple[LayerChoice, ...]
    mode: str = "online"
    first_tokens: int = FIRST_TOKENS
    clustering: str = "linkage"
    budget: str = ""
    baseline_metric: float = 0.0
    final_metric: float = 0.0
    verdict: str = ""
    held_out_baseline: float = 0.0
    held_out_metric: float = 0.0
    backed_off: tuple[int, ...] = ()
    softened: tuple[int, ...] = ()

    def counts(self) -> dict[int, Optional[int]]:
        """Layer index -> chosen k (None: unclustered)."""
        return {c.layer: c.chosen_k for c in self.layers}

    def clustered_layers(self) -> int:
        """How many layers are clustered with fewer clusters than heads."""
        return sum(c.chosen_k is not None and c.chosen_k < c.num_heads for c in self.layers)

    def summary(self) -> str:
        ks = ",".join("-" if c.chosen_k is None else str(c.chosen_k) for c in self.layers)
        return (f"{self.clustered_layers()}/{len(self.layers)} layers clustered "
                f"(k per layer: {ks}; {self.mode}"
                + ("" if self.clustering == "linkage" else f", {self.clustering}") + ")" + (f"; {self.verdict}" if self.verdict else ""))

    def table(self) -> str:
        lines = [f"{'layer':>5}  {'scope':<34} {'H':>3} {'KV':>3} {'elbow':>5} {'chosen':>6}  "
                 f"error curve k=1..H (normalised)"]
        for c in self.layers:
            e0 = c.errors[0] if c.errors and c.errors[0] > 0 else 1.0
            curve = " ".join(f"{v / e0:.2f}" for v in c.errors)
            lines.append(f"{c.layer:>5}  {c.scope:<34} {c.num_heads:>3} {c.num_kv_heads:>3} "
                         f"{c.elbow_k:>5} {'-' if c.chosen_k is None else c.chosen_k:>6}  {curve}")
        if self.budget:
            lines.append(f"budget: {self.budget}; metric {self.baseline_metric:.4g} -> "
                         f"{self.final_metric:.4g} on the choose split")
        if self.held_out_baseline:
            lines.append(f"held-out check: {self.held_out_baseline:.4g} -> "
                         f"{self.held_out_metric:.4g}; layers backed off: "
                         f"{', '.join(map(str, self.backed_off)) or 'none'}; softened to "
                         f"the mildest useful k: {', '.join(map(str, self.softened)) or 'none'}")
        if self.verdict:
            lines.append(self.verdict)
        return "\n".join(lines)

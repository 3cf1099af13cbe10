"""CHAI's offline phase: how many clusters each attention layer gets.

Pure functions over tensors of attention probabilities (no model here; the glue that runs a
model lives in ``clustered_attention``). Which heads share scores (``membership``,
``online_memberships``, ``static_membership``, the tie rule ``first_best``) is shared with the
decode runtime and lives in ``tidal.ir.head_clusters``; the plan (``ChaiPlan``,
``LayerChoice``) in ``tidal.ir.plans.chai``.

- ``HeadStats`` accumulates, per layer and per calibration sequence, the k-means clustering error
  of the layer's heads for k = 1..H (the elbow plot, dissertation §6.2.2, Fig. 6.5) and the mean
  head-to-head cosine similarity (for CHAI-static's fixed membership). It copies the sampled
  rows of the model's attention to the host: k-means (seeded draws from a CPU generator) runs on
  the CPU, so a plan is the same whichever device the model ran on (``kmeans_sse`` itself takes
  points on any device and does the same).
- ``elbow(errors)``: the elbow rule. The error curve is normalised to [0, 1] on both axes and the
  elbow is the k farthest below the straight line from (1, e(1)) to (H, e(H)) (the "kneedle"
  rule of Satopää et al. 2011); a curve with no point below the line (no plateau: heads are not
  redundant) gives k = H.
- Every clustering decision (k-means assignment, the elbow, the order layers are tried in, as
  well as the merge order and representatives of ``tidal.ir.head_clusters``) is a comparison
  of float scores that different kernels or operation orders compute with different rounding.
  Scores that agree within ``TIE_RTOL`` (relative) or ``TIE_ATOL`` (absolute) count as equal
  and the lowest index wins (``first_best``), so a plan does not depend on the machine it was
  computed on.
- ``choose_counts``: the accuracy-budgeted choice, made so that it holds on text it has not
  seen. The calibration set is split in two (``split_holdout``: every other batch by default):
  1. *Choose* on the first split under a tighter internal budget (``margin`` times the
     tolerance; default half: perplexity +1.5 % relative, or embedding cosine >= 0.995 for a
     0.99 budget). Layers are tried from the most redundant (lowest area under the normalised
     error curve); for each, the smallest k whose metric stays within the internal budget is
     kept together with the layers already accepted; a layer for which even its mildest
     useful k breaks it stays unclustered (``None``). The mildest useful k
     (``mildest_useful_k``) is H - 1 under multi-head attention; under grouped-query attention
     it is the largest k for which the decode can compute fewer score rows than H (rows come
     in blocks of one per query head of each kept KV head): 6 of 9 heads with 3 KV heads,
     since 7 or 8 clusters need all 3 KV heads and 3 rows each, which saves nothing.
  2. *Verify* the accepted layers on the held-out split under the full budget (default
     perplexity +3 % relative, or cosine >= 0.99). If they break it, the last-accepted layers
     are backed off until the held-out check fits: first softened to the mildest clustering
     (the mildest useful k, "M" below), then, if all of them at M still break it, dropped.
     The rungs of this ladder (all as chosen; the first j as chosen and the rest at M; all at
     M; the first j at M and the rest dropped; none) are ordered from most to least
     clustering, and the highest rung that fits is found by bisection; with no layer left
     the model stays unchanged.
  Greedy acceptance on one text overfits it (each layer and its smallest k are accepted
  exactly when the cost happens to look small there); the margin leaves room for that, and
  the held-out check catches what the margin did not.
- ``verdict``: a plain statement of how much redundancy the calibration found, for the plan
  (``tidal.ir.plans.chai.ChaiPlan``: the per-layer choices, chosen k, elbow k, the error
  curve, CHAI-static membership).

Example:
    >>> import torch
    >>> from tidal.passes.chai_calibrate import kmeans_errors, elbow
    >>> f = torch.tensor([[1., 0, 0], [0.9, 0.1, 0], [0, 1, 0], [0, 0.95, 0.05]])
    >>> elbow(kmeans_errors(f))
    2
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from tidal.ir.head_clusters import (FIRST_TOKENS, TIE_ATOL, TIE_RTOL, check_count,
                                    cosine_similarity, first_best, same_score, tie_stable_order)
from tidal.ir.plans.chai import LayerChoice


def _distances(x: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Euclidean distances ``[N, C]``, computed directly (not through a matrix product, whose
    cancellation leaves equal points at a small nonzero distance)."""
    return torch.cdist(x, centres, compute_mode="donot_use_mm_for_euclid_dist")


def nearest_centres(x: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Each point's nearest centre; of centres at tying distances (``same_score``), the
    lowest."""
    d = _distances(x, centres)
    best = d.min(dim=1, keepdim=True).values
    ties = d <= torch.maximum(best * (1 + TIE_RTOL), best + TIE_ATOL)
    index = torch.arange(d.shape[1], device=d.device).expand_as(d)
    return index.masked_fill(~ties, d.shape[1]).min(dim=1).values


def kmeans_sse(points: torch.Tensor, k: int, *, restarts: int = 3, iters: int = 30,
               seed: int = 0) -> float:
    """Smallest within-cluster sum of squared distances of k-means (k-means++ seeding, Lloyd
    iterations) over ``restarts`` seeded runs, on the rows of ``points`` ``[N, F]`` (on any
    device: they are copied to the CPU, where the seeded draws are made, so the result does
    not depend on the device)."""
    x = points.detach().reshape(points.shape[0], -1).to("cpu", torch.float64)
    n = x.shape[0]
    check_count(k, n)
    if k == n:
        return 0.0
    gen = torch.Generator().manual_seed(seed)
    best = math.inf
    for _ in range(restarts):
        centres = x[torch.randint(n, (1,), generator=gen)]
        while centres.shape[0] < k:
            d2 = _distances(x, centres).min(dim=1).values.square()
            probs = d2 / d2.sum() if d2.sum() > 0 else torch.full((n,), 1.0 / n)
            centres = torch.cat((centres, x[torch.multinomial(probs, 1, generator=gen)]))
        for _ in range(iters):
            assign = nearest_centres(x, centres)
            new = torch.stack([x[assign == c].mean(0) if (assign == c).any() else centres[c]
                               for c in range(k)])
            if torch.equal(new, centres):
                break
            centres = new
        sse = _distances(x, centres).min(dim=1).values.square().sum().item()
        best = min(best, sse)
    return best


def kmeans_errors(points: torch.Tensor) -> tuple[float, ...]:
    """Clustering error (k-means SSE) of the rows of ``points`` for k = 1..N."""
    return tuple(kmeans_sse(points, k) for k in range(1, points.shape[0] + 1))


def elbow(errors: Sequence[float]) -> int:
    """The elbow of an error curve ``errors[k-1]`` for k = 1..H (kneedle rule, module doc)."""
    h = len(errors)
    if h <= 2:
        return h
    span = errors[0] - errors[-1]
    if span <= 0 or same_score(errors[0], errors[-1]):   # flat curve: the heads are all alike
        return 1
    e = [(x - errors[-1]) / span for x in errors]
    gaps = [(1 - (k / (h - 1))) - e[k] for k in range(h)]   # chord minus curve
    best = first_best(range(h), gaps.__getitem__)
    return best + 1 if gaps[best] > 0 and not same_score(gaps[best], 0.0) else h


def redundancy(errors: Sequence[float]) -> float:
    """Mean normalised clustering error over k = 1..H-1 (lower: more redundant heads)."""
    if len(errors) < 2 or errors[0] <= 0:
        return 0.0
    return sum(errors[:-1]) / errors[0] / (len(errors) - 1)


class HeadStats:
    """Accumulates per-layer clustering-error curves and head similarity over calibration
    sequences: ``add(layer, probs)`` with ``probs`` ``[B, H, Tq, Tk]``.

    A sequence's heads are compared on a sample of ``rows`` query rows spread over the sequence
    (their full attention rows), which is what the heads would share after token 5.
    """

    def __init__(self, rows: int = 32) -> None:
        self.rows = rows
        self.sse: dict[int, list[float]] = {}
        self.sim: dict[int, torch.Tensor] = {}
        self.count: dict[int, int] = {}

    def add(self, layer: int, probs: torch.Tensor) -> None:
        """Add one batch of attention probabilities of ``layer``."""
        t = probs.shape[2]
        idx = torch.linspace(min(FIRST_TOKENS, t - 1), t - 1, min(self.rows, t)).long()
        rows = probs.detach()[:, :, idx.to(probs.device)]   # the same rows on every device
        for seq in rows.to("cpu", torch.float64):           # k-means on the host
            points = seq.flatten(1)
            curve = kmeans_errors(points)
            acc = self.sse.setdefault(layer, [0.0] * len(curve))
            for i, v in enumerate(curve):
                acc[i] += v
            sim = cosine_similarity(points)
            self.sim[layer] = self.sim.get(layer, torch.zeros_like(sim)) + sim
            self.count[layer] = self.count.get(layer, 0) + 1

    def errors(self, layer: int) -> tuple[float, ...]:
        """Mean clustering error for k = 1..H of ``layer``."""
        return tuple(v / self.count[layer] for v in self.sse[layer])

    def similarity(self, layer: int) -> torch.Tensor:
        """Mean head-to-head cosine similarity ``[H, H]`` of ``layer``."""
        return self.sim[layer] / self.count[layer]


@dataclass(frozen=True)
class Budget:
    """An accuracy budget: ``metric`` is "perplexity" (lower is better; allowed up to
    ``baseline * (1 + tolerance)``) or "cosine" (higher is better; allowed down to
    ``min_cosine``)."""

    metric: str = "perplexity"
    tolerance: float = 0.03
    min_cosine: float = 0.99

    def allows(self, value: float, baseline: float) -> bool:
        """Whether ``value`` is within budget of ``baseline``."""
        if self.metric == "perplexity":
            return value <= baseline * (1 + self.tolerance)
        if self.metric == "cosine":
            return value >= self.min_cosine
        raise ValueError(f"unknown budget metric {self.metric!r}: use 'perplexity' or 'cosine'")

    def describe(self) -> str:
        """E.g. ``perplexity within +3.0%``."""
        if self.metric == "perplexity":
            return f"perplexity within +{self.tolerance:.1%}"
        return f"embedding cosine >= {self.min_cosine:.4g}"

    def tightened(self, margin: float) -> "Budget":
        """The budget with ``margin`` (0..1] of its allowance: the perplexity tolerance times
        ``margin``, or ``1 - (1 - min_cosine) * margin``."""
        if not 0 < margin <= 1:
            raise ValueError(f"margin must be in (0, 1], got {margin!r}")
        return replace(self, tolerance=self.tolerance * margin,
                       min_cosine=1 - (1 - self.min_cosine) * margin)


def split_holdout(batches: Sequence[Any], holdout: float = 0.5) -> tuple[list, list]:
    """``(choose, check)``: the calibration ``batches`` split so that a share ``holdout`` of
    them, spread evenly (every other batch for 0.5), is held out for the check."""
    if not 0 < holdout < 1:
        raise ValueError(f"holdout must be in (0, 1), got {holdout!r}")
    check = [i for i in range(len(batches)) if int((i + 1) * holdout) > int(i * holdout)]
    choose = [i for i in range(len(batches)) if i not in check]
    if not choose or not check:
        raise ValueError(f"holdout={holdout} of {len(batches)} calibration batch(es) leaves "
                         f"one side empty: give at least 2 batches (or holdout=None)")
    return [batches[i] for i in choose], [batches[i] for i in check]


@dataclass(frozen=True)
class Choice:
    """What ``choose_counts`` decided: ``counts`` (layer -> k, None: unclustered), the metric
    on the choose split (``metric``) and on the held-out split (``held_out``, NaN without a
    check) for those counts, the layers ``backed_off`` by the held-out check (in the order
    they were dropped), the number of ``evaluations``, and the layers ``softened`` by the
    check to their mildest useful k."""

    counts: dict[int, Optional[int]]
    metric: float
    held_out: float
    backed_off: tuple[int, ...]
    evaluations: int
    softened: tuple[int, ...] = ()


def decode_score_rows(k: int, num_heads: int, num_kv_heads: int) -> int:
    """The fewest score rows a one-token decode step computes for ``k`` clusters: rows come in
    blocks, one per kept KV head, each as wide as the most representatives any kept KV head
    has (at most its query heads), so the best case is over the number of kept KV heads m of
    ``m * ceil(k / m)``."""
    check_count(k, num_heads)
    group = num_heads // num_kv_heads
    return min(m * -(-k // m) for m in range(-(-k // group), num_kv_heads + 1))


def mildest_useful_k(num_heads: int, num_kv_heads: int) -> int:
    """The largest k < H whose decode can compute fewer score rows than H (0: none can)."""
    return max((k for k in range(1, num_heads)
                if decode_score_rows(k, num_heads, num_kv_heads) < num_heads), default=0)


def choose_counts(errors: Mapping[int, Sequence[float]],
                  evaluate: Callable[[Mapping[int, int]], float], budget: Budget,
                  baseline: float, log: Callable[[str], None] = lambda m: None, *,
                  check: Optional[Callable[[Mapping[int, int]], float]] = None,
                  check_baseline: Optional[float] = None, margin: float = 0.5,
                  mildest: Optional[Mapping[int, int]] = None) -> Choice:
    """Each layer's cluster count under ``budget`` (rule in the module docstring).

    ``errors[layer]`` is the layer's error curve (k = 1..H); ``evaluate(counts)`` the metric on
    the choose split with ``counts`` (layer -> k) clustered and the other layers intact, and
    ``baseline`` its value with none clustered; ``check``/``check_baseline`` the same on the
    held-out split (None: no held-out check, only the internal budget). The choice is made
    under ``budget.tightened(margin)`` and verified under ``budget``. ``mildest[layer]``: the
    largest k worth trying (``mildest_useful_k``; default H - 1); a layer whose mildest is 0
    stays unclustered. Assumes the metric is monotone in k within a layer and in the number of
    clustered layers (bisection).

    Example:
        >>> curves = {0: (4.0, 1.0, 0.0), 1: (4.0, 3.0, 0.0)}   # layer 0 the more redundant
        >>> def perplexity(counts):                 # +0.1 per head clustered away
        ...     return 10.0 + 0.1 * sum(3 - k for k in counts.values())
        >>> choice = choose_counts(curves, perplexity, Budget(tolerance=0.03), 10.0)
        >>> choice.counts, choice.evaluations
        ({0: 2, 1: None}, 3)
    """
    if check is not None and check_baseline is None:
        raise ValueError("choose_counts: check needs check_baseline (its metric unclustered)")
    mild = {l: len(errors[l]) - 1 if mildest is None else mildest[l] for l in errors}
    accepted, evals = _accept_layers(errors, evaluate, budget.tightened(margin), baseline,
                                     mild, log)
    size = len(accepted)
    rung, held_out = 2 * size, math.nan
    if check is not None:
        rung, held_out, checks = _highest_fitting_rung(accepted, mild, check, check_baseline,
                                                       budget, log)
        evals += checks
    final = _ladder(accepted, mild, rung)
    backed = tuple(l for l, _, _ in reversed(accepted) if l not in final)
    softened = tuple(l for l, k, _ in accepted if l in final and final[l] != k)
    if backed or softened:
        log(f"held-out check: backed off layer(s) {list(backed)}, softened to the mildest k: "
            f"{list(softened)}")
    if rung == 2 * size:
        metric = accepted[-1][2] if accepted else baseline
    elif not final:
        metric = baseline
    else:
        metric = evaluate(final)
        evals += 1
    return Choice({l: final.get(l) for l in sorted(errors)}, metric, held_out, backed,
                  evals, softened)


Accepted = list[tuple[int, int, float]]
"""The layers ``choose_counts`` accepted, in order: ``(layer, k, metric on the choose split)``."""


def _accept_layers(errors: Mapping[int, Sequence[float]],
                   evaluate: Callable[[Mapping[int, int]], float], inner: Budget,
                   baseline: float, mild: Mapping[int, int],
                   log: Callable[[str], None]) -> tuple[Accepted, int]:
    """The choose step: layers tried from the most redundant, each kept at the smallest k
    within ``inner`` together with the layers already accepted (not at all when even its
    mildest k ``mild[layer]`` breaks it); the accepted layers and the evaluations made."""
    accepted: Accepted = []
    evals = 0
    for layer in tie_stable_order(sorted(errors), lambda l: redundancy(errors[l])):
        top = mild[layer]
        if len(errors[layer]) < 2 or top < 1:
            continue
        chosen = {l: k for l, k, _ in accepted}
        k, measured = _smallest_allowed(top, lambda k: evaluate({**chosen, layer: k}),
                                        lambda value: inner.allows(value, baseline))
        evals += len(measured)
        if k is None:
            log(f"layer {layer}: unclustered (k={top} gives {measured[top]:.4g})")
            continue
        accepted.append((layer, k, measured[k]))
        log(f"layer {layer}: k={k} ({measured[k]:.4g})")
    return accepted, evals


def _smallest_allowed(top: int, metric_of: Callable[[int], float],
                      allows: Callable[[float], bool]) -> tuple[Optional[int], dict[int, float]]:
    """The smallest k in 1..``top`` whose metric ``allows`` accepts, by bisection (None: not
    even ``top``), and every metric measured on the way (k -> value)."""
    measured: dict[int, float] = {}

    def ok(k: int) -> bool:
        if k not in measured:
            measured[k] = metric_of(k)
        return allows(measured[k])

    if not ok(top):
        return None, measured
    lo, hi = 1, top        # hi is within budget
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi, measured


def _ladder(accepted: Accepted, mild: Mapping[int, int], n: int) -> dict[int, int]:
    """Rung ``n`` of the back-off ladder (0: nothing clustered, 2 * size: as chosen): up to
    ``size`` (the number accepted), the first n accepted layers at their mildest useful k;
    beyond, all of them, the first n - size at their chosen k and the rest at the mildest."""
    size = len(accepted)
    if n <= size:
        return {l: mild[l] for l, _, _ in accepted[:n]}
    return {l: (k if i < n - size else mild[l]) for i, (l, k, _) in enumerate(accepted)}


def _highest_fitting_rung(accepted: Accepted, mild: Mapping[int, int],
                          check: Callable[[Mapping[int, int]], float], check_baseline: float,
                          budget: Budget, log: Callable[[str], None]
                          ) -> tuple[int, float, int]:
    """The verify step: ``(rung, held-out metric, checks made)`` for the highest rung of the
    back-off ladder whose held-out metric fits ``budget`` (by bisection; rung 0, nothing
    clustered, fits by definition)."""
    top = 2 * len(accepted)
    results = {0: check_baseline}

    def fits(n: int) -> bool:
        if n not in results:
            results[n] = check(_ladder(accepted, mild, n))
            log(f"held-out check, back-off rung {n}/{top} "
                f"({_ladder(accepted, mild, n)}): {results[n]:.4g}")
        return budget.allows(results[n], check_baseline)

    rung = top
    if accepted and not fits(rung):
        lo, hi = 0, rung       # rung lo fits, rung hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        rung = lo
    held_out = results[rung] if accepted else check_baseline
    return rung, held_out, len(results) - 1


def verdict(plan_layers: Sequence[LayerChoice], model_name: str = "the model") -> str:
    """A plain statement of how much redundancy the calibration found."""
    clustered = [c for c in plan_layers if c.chosen_k is not None and c.chosen_k < c.num_heads]
    heads = sum(c.num_heads for c in plan_layers)
    kept = sum(c.num_heads if c.chosen_k is None else c.chosen_k for c in plan_layers)
    if not clustered:
        return (f"{model_name} has too little head redundancy to gain: no layer can be "
                f"clustered within the budget, so it is left unchanged")
    share = 1 - kept / heads
    if share < 0.1:
        return (f"{model_name} has little head redundancy: within the budget only "
                f"{len(clustered)} of {len(plan_layers)} layers cluster, removing {share:.1%} "
                f"of score computations; expect little gain")
    return (f"{len(clustered)} of {len(plan_layers)} layers clustered, {share:.1%} of score "
            f"computations removed")

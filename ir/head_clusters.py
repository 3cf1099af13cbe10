"""CHAI's head clustering as the graph and the decode runtime both use it: which heads of one
attention layer share scores (dissertation ch. 6, §6.2.3).

``membership(features, k, kv_of_head)`` clusters the heads by average-linkage agglomeration on
cosine distance (as CHAI's public code does, rather than the K-Means the text mentions):
deterministic (no random restarts, so a sequence always gets the same membership), and cosine
ignores the scale of a head's score rows. Each cluster's representative is the member most
similar on average to the others; under grouped-query attention it is chosen among members
whose KV head is already needed, when possible, so that whole KV heads drop out of the K cache.
``sequence_memberships`` is the one entry point for a layer's per-sequence membership from
attention probabilities (online, through ``online_memberships``, or the fixed clusters of
CHAI-static): the graph's modules (``tidal.passes.chai_modules``), tidal's decoder
(``tidal.runtime.chai.decode``) and the generation cache (``tidal.runtime.chai.cache``) all
call it, on the same features (``head_features``); ``static_membership`` gives CHAI-static's
fixed clusters from an averaged similarity; ``kv_head_map`` the KV head of each query head.

Clustering runs on the host: the features (a few rows per head) are copied to the CPU once, as
float64, rather than deciding each merge with a device round trip (``.item()``) per pair.

Every clustering decision is a comparison of float scores that different kernels or operation
orders compute with different rounding. Scores that agree within ``TIE_RTOL`` (relative) or
``TIE_ATOL`` (absolute) count as equal and the lowest index wins (``first_best``), so a result
does not depend on the machine it was computed on. The offline planner that chooses each
layer's cluster count is ``tidal.passes.chai_calibrate``.

Example:
    >>> import torch
    >>> from tidal.ir.head_clusters import membership
    >>> f = torch.tensor([[1., 0, 0], [0.9, 0.1, 0], [0, 1, 0], [0, 0.95, 0.05]])
    >>> m = membership(f, 2, kv_of_head=(0, 1, 2, 3))
    >>> m.labels, m.representatives, m.rep_of_head
    ((0, 0, 1, 1), (0, 2), (0, 0, 2, 2))
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Any, Callable, Optional, Sequence

import torch

FIRST_TOKENS = 5
"""Tokens processed with full multi-head attention before membership is fixed (§6.2.3)."""

TIE_RTOL = 1e-6
"""Scores within this relative difference of each other count as a tie (lowest index wins)."""

TIE_ATOL = 1e-12
"""Scores within this absolute difference of each other count as a tie (e.g. around 0)."""


def same_score(a: float, b: float) -> bool:
    """Whether two scores are equal up to ``TIE_RTOL`` / ``TIE_ATOL`` (rounding noise)."""
    return abs(a - b) <= max(TIE_RTOL * max(abs(a), abs(b)), TIE_ATOL)


def first_best(items: Sequence[Any], score: Callable[[Any], float], *,
               lowest: bool = False) -> Any:
    """The first of ``items`` whose ``score`` ties (``same_score``) with the highest score
    (``lowest``: the lowest), so that rounding noise never decides between near-equal items.

    Example:
        >>> first_best([0, 1, 2], {0: 0.5, 1: 0.5 + 1e-12, 2: 0.1}.__getitem__)
        0
    """
    scores = [score(i) for i in items]
    best = min(scores) if lowest else max(scores)
    return next(i for i, s in zip(items, scores) if same_score(s, best))


def tie_stable_order(items: Sequence[Any], score: Callable[[Any], float]) -> list[Any]:
    """``items`` by ascending ``score``; items whose scores tie keep their given order."""
    rest, out = list(items), []
    while rest:
        out.append(first_best(rest, score, lowest=True))
        rest.remove(out[-1])
    return out


def check_count(k: int, num_heads: int, where: str = "") -> None:
    """Raise ``ValueError`` unless ``1 <= k <= num_heads``."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_heads:
        raise ValueError(f"{where + ': ' if where else ''}cluster count {k!r} is outside "
                         f"1..{num_heads} (the layer has {num_heads} heads)")


def cosine_similarity(features: torch.Tensor) -> torch.Tensor:
    """``[H, H]`` cosine similarity of the rows of ``features`` ``[H, F]`` (float64), exactly
    symmetric."""
    f = features.reshape(features.shape[0], -1).double()
    f = f / f.norm(dim=1, keepdim=True).clamp_min(1e-12)
    sim = f @ f.T
    return (sim + sim.T) / 2


def average_linkage(sim: torch.Tensor, k: int) -> tuple[int, ...]:
    """Cluster labels (numbered by first member) from average-linkage agglomeration of the
    similarity matrix ``sim`` ``[H, H]`` into ``k`` clusters. Of pairs of clusters whose
    linkage ties (``same_score``), the pair with the lowest first members merges."""
    n = sim.shape[0]
    check_count(k, n)
    clusters: list[list[int]] = [[h] for h in range(n)]    # kept ordered by first member
    s = sim.double()
    while len(clusters) > k:
        a, b = first_best(list(combinations(range(len(clusters)), 2)),
                          lambda p: s[clusters[p[0]]][:, clusters[p[1]]].mean().item())
        clusters[a] = sorted(clusters[a] + clusters[b])
        del clusters[b]
    labels = [0] * n
    for i, members in enumerate(clusters):
        for h in members:
            labels[h] = i
    return tuple(labels)


def _kv_cover(groups_per_cluster: list[set[int]]) -> set[int]:
    """A smallest set of KV heads meeting every cluster (exact up to 12 KV heads, else greedy)."""
    universe = sorted(set().union(*groups_per_cluster))
    if len(universe) <= 12:
        for size in range(1, len(universe) + 1):
            for subset in combinations(universe, size):
                if all(g & set(subset) for g in groups_per_cluster):
                    return set(subset)
    chosen: set[int] = set()
    uncovered = list(range(len(groups_per_cluster)))
    while uncovered:
        best = max(universe, key=lambda u: sum(u in groups_per_cluster[c] for c in uncovered))
        chosen.add(best)
        uncovered = [c for c in uncovered if best not in groups_per_cluster[c]]
    return chosen


@dataclass(frozen=True)
class Membership:
    """Cluster ``labels`` per head and each cluster's ``representatives`` (a head index)."""

    labels: tuple[int, ...]
    representatives: tuple[int, ...]

    @property
    def rep_of_head(self) -> tuple[int, ...]:
        """For every head, the head whose scores it uses."""
        return tuple(self.representatives[c] for c in self.labels)


def representatives(labels: Sequence[int], sim: torch.Tensor,
                    kv_of_head: Sequence[int]) -> tuple[int, ...]:
    """Per cluster, the member with the highest mean similarity to the other members,
    restricted to a smallest set of KV heads that meets every cluster (so the most KV heads can
    be dropped); of members whose scores tie (``same_score``), the lowest head."""
    k = max(labels) + 1
    members = [[h for h, c in enumerate(labels) if c == i] for i in range(k)]
    keep = _kv_cover([{kv_of_head[h] for h in m} for m in members])
    reps = []
    for m in members:
        allowed = [h for h in m if kv_of_head[h] in keep]
        reps.append(first_best(allowed, lambda h: _mean_similarity(sim, h, m)))
    return tuple(reps)


def _mean_similarity(sim: torch.Tensor, head: int, members: Sequence[int]) -> float:
    """Mean similarity of ``head`` to the other ``members`` (0 for a lone member)."""
    others = [h for h in members if h != head]
    return sim[head, others].mean().item() if others else 0.0


CLUSTERINGS = ("linkage", "kmeans")
"""How heads are clustered: ``"linkage"`` (average linkage on cosine distance, as CHAI's public
code) or ``"kmeans"`` (K-means on the normalised features, as the dissertation's text says)."""


def kmeans_labels(features: torch.Tensor, k: int, iterations: int = 100) -> tuple[int, ...]:
    """K-means cluster labels (numbered by first member) of the rows of ``features`` ``[H,
    ...]``, each normalised to unit length (float64), deterministic: the first centroid is head
    0, each next one the head farthest from the centroids so far; Lloyd iterations until the
    labels stop changing; ties (``same_score``) go to the lowest index.

    >>> f = torch.tensor([[1., 0], [0.9, 0.1], [0, 1.], [0.1, 0.9]])
    >>> kmeans_labels(f, 2)
    (0, 0, 1, 1)
    """
    n = features.shape[0]
    check_count(k, n)
    x = features.reshape(n, -1).double()
    x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    chosen = [0]
    while len(chosen) < k:
        far = [min(float((x[h] - x[c]).norm()) for c in chosen) for h in range(n)]
        chosen.append(first_best([h for h in range(n) if h not in chosen], far.__getitem__))
    centroids = x[chosen].clone()
    labels: list[int] = []
    for _ in range(iterations):
        new = [first_best(list(range(k)), lambda c, h=h: float((x[h] - centroids[c]).norm()),
                          lowest=True) for h in range(n)]
        if new == labels:
            break
        labels = new
        for c in range(k):
            members = [h for h in range(n) if labels[h] == c]
            if members:
                centroids[c] = x[members].mean(dim=0)
    order = {c: i for i, c in enumerate(dict.fromkeys(labels))}
    return tuple(order[c] for c in labels)


def membership(features: torch.Tensor, k: int, kv_of_head: Sequence[int],
               clustering: str = "linkage") -> Membership:
    """Cluster the heads (rows of ``features`` ``[H, ...]``) into ``k`` clusters
    (``clustering``: see :data:`CLUSTERINGS`) and pick representatives (see the module
    docstring)."""
    if clustering not in CLUSTERINGS:
        raise ValueError(f"head clustering {clustering!r} is not one of {CLUSTERINGS}")
    features = features.detach().to("cpu", torch.float64)   # on the host (module docstring)
    sim = cosine_similarity(features)
    labels = average_linkage(sim, k) if clustering == "linkage" else kmeans_labels(features, k)
    return Membership(labels, representatives(labels, sim, kv_of_head))


def kv_head_map(num_heads: int, num_kv_heads: int) -> tuple[int, ...]:
    """The KV head each of ``num_heads`` query heads reads under grouped-query attention
    (``num_heads / num_kv_heads`` consecutive query heads share one).

    >>> kv_head_map(4, 2)
    (0, 0, 1, 1)
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    return tuple(h // group for h in range(num_heads))


def sequence_memberships(probs: torch.Tensor, k: int, kv_of_head: Sequence[int],
                         first: int = FIRST_TOKENS, clustering: str = "linkage",
                         static: Optional[Membership] = None) -> tuple[Membership, ...]:
    """One membership per sequence of ``probs`` ``[B, H, Tq >= first, Tk]``: ``static`` (the
    fixed clusters of CHAI-static) for every sequence when given, else each sequence's own
    from its first ``first`` rows (:func:`online_memberships`). The one rule by which the
    graph's modules, the decoder and the generation cache fix a layer's membership.

    >>> p = torch.eye(4).expand(1, 4, 4, 4).clone()    # every head attends alike
    >>> [m.representatives for m in sequence_memberships(p, 1, (0, 0, 1, 1), first=4)]
    [(0,)]
    >>> fixed = Membership((0, 0, 1, 1), (1, 2))
    >>> sequence_memberships(p.expand(2, -1, -1, -1), 2, (0, 0, 1, 1), static=fixed)[1] == fixed
    True
    """
    if static is not None:
        return (static,) * probs.shape[0]
    return online_memberships(probs, k, kv_of_head, first, clustering)


def online_memberships(probs: torch.Tensor, k: int, kv_of_head: Sequence[int],
                       first: int = FIRST_TOKENS, clustering: str = "linkage"
                       ) -> tuple[Membership, ...]:
    """Each sequence's membership from its first ``first`` query tokens: ``probs``
    ``[B, H, Tq, Tk]`` attention probabilities (``Tq >= first``). The one function the graph
    and the decode runtime both use, so that they cluster alike."""
    rows = probs[:, :, :first].detach().cpu()   # one copy to the host for the batch
    return tuple(membership(head_features(p, first), k, kv_of_head, clustering) for p in rows)


def static_membership(sim: torch.Tensor, k: int, kv_of_head: Sequence[int]) -> Membership:
    """Membership from an (averaged) similarity matrix: CHAI-static's fixed clusters."""
    sim = sim.detach().to("cpu", torch.float64)
    labels = average_linkage(sim, k)
    return Membership(labels, representatives(labels, sim, kv_of_head))


def head_features(probs: torch.Tensor, first: int = FIRST_TOKENS) -> torch.Tensor:
    """One sequence's per-head features: the attention rows of its first ``first`` query
    tokens, ``probs`` ``[H, Tq, Tk]`` -> ``[H, first * T]``, keys past the last one any of
    these rows attends to dropped (a causal prompt's first tokens give the same features
    however many keys follow them)."""
    rows = probs[:, :first]
    seen = rows.ne(0).flatten(0, 1).any(dim=0).nonzero()
    width = int(seen.max()) + 1 if seen.numel() else rows.shape[-1]
    return rows[..., :width].flatten(1)

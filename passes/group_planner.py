"""PipeSwitch's optimal model-aware grouping: which consecutive layers to transmit together.

Layers ``0..n-1`` run in order. Layer ``l`` owns ``layer_bytes[l]`` bytes of weights and takes
``exec_us[l]`` to execute. A grouping cuts the layers into consecutive groups. Groups are sent
one after another over one link; a group of layers ``i..j`` takes
``T(i, j) = overhead_us + bytes(i..j) / bytes_per_us`` to send, and
``E(i, j) = sum(exec_us[i..j])`` to run. Group ``k`` runs once its transfer is done and group
``k-1`` has run. The planner finds the grouping whose last group finishes first. The pipeline
model (``GroupCosts``, ``timeline``) and the plan (``LayerGroupPlan``) are data in
``tidal.ir.plans.layer_groups``, where the runtime reads them.

Four solvers give the same optimum (to floating-point rounding):

* :func:`pipeswitch_search`: PipeSwitch's Algorithm 1, a recursive search with its two
  prunings (the lower bound of pruning 1, the hidden-transfer prefix ``j*`` of pruning 2), kept
  as the reference. It is exponential in the worst case.
* :func:`optimal_grouping`: tidal's exact algorithm (below), ``O(m log n)`` per feasibility test
  and ~45 tests.
* :func:`dp_grouping`: a dynamic program over (last layer, number of groups), ``O(K n^2)``
  vectorised, the cross-check on models too large for the reference search.
* :func:`brute_force`: every one of the ``2^(n-1)`` groupings, for tests with ``n <= 12``.

**Why the fast algorithm is exact.** Unrolling ``ex_end_k = max(tx_end_k, ex_end_{k-1}) +
E_k`` gives the finish time as ``max_k (tx_end_k + E(a_k, n-1))``: some group's transfer end
followed by every layer from that group on. The ``k``-th group (1-based) ``[a_k, b_k]`` ends
its transfer at ``k * overhead + bytes(0..b_k) / bandwidth``, so a grouping finishes by ``X``
iff every group satisfies ``k*overhead + P(b_k) + Etail(a_k) <= X``. Testing that for a given
``X`` is a greedy walk: make each group as long as the bound allows. By induction the greedy
group ends are never before those of any feasible grouping (a later start only shrinks
``Etail``, and a layer that a feasible grouping puts in group ``k' > k`` satisfies the bound for
``k``), so the greedy walk reaches the last layer iff some grouping finishes by ``X``. Bisection
on ``X`` between a lower bound and the best grouping found so far (each feasible test lowers the
upper end to the true time of the grouping it found) ends with a grouping whose time is within
``rel_tol`` of the optimum; with the default ``1e-13`` that is the optimum to double precision.

Example:
    >>> from tidal.passes.group_planner import optimal_grouping, pipeswitch_search
    >>> bytes_, exec_ = [100, 100, 4000, 100], [5.0, 40.0, 5.0, 10.0]
    >>> fast = optimal_grouping(bytes_, exec_, bytes_per_us=100.0, overhead_us=2.0)
    >>> ref = pipeswitch_search(bytes_, exec_, bytes_per_us=100.0, overhead_us=2.0)
    >>> fast.groups, round(fast.time_us, 6) == round(ref.time_us, 6)
    (((0, 0), (1, 1), (2, 2), (3, 3)), True)
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from tidal.ir.plans.layer_groups import GroupCosts, Groups, LayerGroupPlan, timeline


@dataclass(frozen=True)
class Grouping:
    """A grouping and its pipeline finish time in microseconds; ``visited`` counts the search
    states a solver examined (recursive calls, feasibility tests or groupings)."""

    groups: Groups
    time_us: float
    visited: int = 0


class SearchBudgetExceeded(RuntimeError):
    """:func:`pipeswitch_search` examined more states than its ``max_calls`` budget."""


def pipeline_time(groups: Groups, layer_bytes: Sequence[float], exec_us: Sequence[float],
                  bytes_per_us: float, overhead_us: float) -> float:
    """Finish time in microseconds of the last group of ``groups``."""
    return timeline(groups, layer_bytes, exec_us, bytes_per_us, overhead_us)[-1].ex_end


def per_layer(n: int) -> Groups:
    """One group per layer."""
    return tuple((i, i) for i in range(n))


def single_group(n: int) -> Groups:
    """All layers in one group (load everything, then run)."""
    return ((0, n - 1),)


def pipeswitch_search(layer_bytes: Sequence[float], exec_us: Sequence[float], *,
                      bytes_per_us: float, overhead_us: float, prune_bound: bool = True,
                      prune_hidden: bool = True, max_calls: Optional[int] = None) -> Grouping:
    """PipeSwitch's Algorithm 1 (FindOptGrouping), the reference solver.

    ``F(B, x)`` is the best finish time of layers ``x..n-1`` measured from the moment the link
    is free after the groups ``B`` already formed; ``B.delay`` is how long after that moment
    ``B``'s execution ends. Pruning 2 (``prune_hidden``): layers whose transfer hides behind
    ``B.delay`` (``T(x, j*) <= B.delay``) always join the next group, so only first groups
    ending at ``i >= j*`` are tried. Pruning 1 (``prune_bound``): once a grouping is known, a
    first group ``[x, i]`` is skipped when ``min(T(x,i) + T(i+1,n-1), max(T(x,i), B.delay) +
    E(x,i) + E(i+1,n-1))`` already exceeds it. ``max_calls`` bounds the recursive calls
    (``SearchBudgetExceeded`` past it), for the ablations of PipeSwitch's Table 5.
    """
    c = GroupCosts(layer_bytes, exec_us, bytes_per_us, overhead_us)
    n, T, E = c.n, c.T, c.E
    calls = 0

    def find(x: int, delay: float) -> tuple[float, Groups]:
        nonlocal calls
        calls += 1
        if max_calls is not None and calls > max_calls:
            raise SearchBudgetExceeded(f"pipeswitch_search: more than {max_calls} calls")
        if x == n:
            return delay, ()
        j_star = x
        if prune_hidden:
            for i in range(x, n):
                if T(x, i) <= delay:
                    j_star = i
                else:
                    break
        best_time, best_groups = math.inf, None
        for i in range(j_star, n):
            t_first = T(x, i)
            if prune_bound and best_groups is not None:
                trans_time = t_first + T(i + 1, n - 1)
                exec_time = max(t_first, delay) + E(x, i) + E(i + 1, n - 1)
                if min(trans_time, exec_time) > best_time:
                    continue
            rest_time, rest = find(i + 1, max(t_first, delay) + E(x, i) - t_first)
            if t_first + rest_time < best_time:
                best_time, best_groups = t_first + rest_time, ((x, i),) + rest
        return best_time, best_groups

    time_us, groups = find(0, 0.0)
    return Grouping(groups, c.timeline(groups)[-1].ex_end, calls)


def _greedy(c: GroupCosts, limit: float, tails: list[float], tx_prefix: list[float]
            ) -> Optional[Groups]:
    """The greedy grouping that finishes by ``limit``, or None if no grouping does."""
    groups = []
    a, k, n = 0, 1, c.n
    while a < n:
        b = bisect.bisect_right(tx_prefix, limit - k * c.oh - tails[a]) - 1
        if b < a:
            return None
        b = min(b, n - 1)
        groups.append((a, b))
        a, k = b + 1, k + 1
    return tuple(groups)


def optimal_grouping(layer_bytes: Sequence[float], exec_us: Sequence[float], *,
                     bytes_per_us: float, overhead_us: float, rel_tol: float = 1e-13
                     ) -> Grouping:
    """The optimal grouping by bisection over the finish time with an exact greedy
    feasibility test (see the module docstring for the proof)."""
    c = GroupCosts(layer_bytes, exec_us, bytes_per_us, overhead_us)
    n = c.n
    total_e = c.exec_prefix[-1]
    tails = [total_e - c.exec_prefix[a] for a in range(n)]
    tx_prefix = [c.bytes_prefix[b + 1] / c.bw for b in range(n)]

    def cost(groups: Groups) -> float:
        return c.timeline(groups)[-1].ex_end

    best = single_group(n)
    hi = cost(best)
    lo = max(c.oh + tx_prefix[0] + tails[0], c.oh + tx_prefix[-1] + c.E(n - 1, n - 1))
    tests = 0
    found = _greedy(c, lo, tails, tx_prefix)
    tests += 1
    if found is not None and cost(found) <= hi:
        return Grouping(found, cost(found), tests)
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        found = _greedy(c, mid, tails, tx_prefix)
        tests += 1
        if found is None:
            lo = mid
            continue
        t = cost(found)
        if t < hi:
            best, hi = found, t
        else:  # rounding put the greedy grouping at the upper end: the optimum is found
            break
    return Grouping(best, hi, tests)


def dp_grouping(layer_bytes: Sequence[float], exec_us: Sequence[float], *, bytes_per_us: float,
                overhead_us: float) -> Grouping:
    """The optimal grouping by dynamic programming over (last layer, number of groups).

    With ``k`` groups covering layers ``0..j`` the link is free at ``k * overhead + P(j)``
    whatever the cut points, so the earliest execution end ``D[k][j]`` is all the future
    depends on: ``D[k][j] = min_i max(k*overhead + P(j), D[k-1][i]) + E(i+1, j)``. Each ``k``
    is one vectorised ``n x n`` step; ``k`` stops at the bound ``(best - P(n-1)) / overhead``.
    """
    c = GroupCosts(layer_bytes, exec_us, bytes_per_us, overhead_us)
    n = c.n
    tx = np.asarray(c.bytes_prefix[1:]) / c.bw
    ends = np.asarray(c.exec_prefix[1:])  # ends[j] = E(0, j)
    prev = c.oh + tx + ends
    best_time, best_k = float(prev[-1]), 1
    k_max = n if c.oh == 0 else min(n, int((best_time - tx[-1]) / c.oh) + 1)
    invalid = np.tril(np.ones((n, n), dtype=bool))  # i >= j: no layer left for group k
    cols = np.arange(n)
    parents = []
    for k in range(2, k_max + 1):
        cand = np.maximum(k * c.oh + tx[None, :], prev[:, None]) + (ends[None, :] - ends[:, None])
        cand[invalid] = np.inf
        arg = cand.argmin(axis=0)
        prev = cand[arg, cols]
        parents.append(arg)
        if prev[-1] < best_time:
            best_time, best_k = float(prev[-1]), k
        if c.oh > 0 and k * c.oh + tx[-1] >= best_time:
            break
    groups = []
    j = n - 1
    for k in range(best_k, 1, -1):
        i = int(parents[k - 2][j])
        groups.append((i + 1, j))
        j = i
    groups.append((0, j))
    groups.reverse()
    return Grouping(tuple(groups), c.timeline(tuple(groups))[-1].ex_end, len(parents) + 1)


def brute_force(layer_bytes: Sequence[float], exec_us: Sequence[float], *, bytes_per_us: float,
                overhead_us: float) -> Grouping:
    """The best of all ``2^(n-1)`` groupings (for tests; refuses ``n > 16``)."""
    c = GroupCosts(layer_bytes, exec_us, bytes_per_us, overhead_us)
    n = c.n
    if n > 16:
        raise ValueError(f"brute_force: {n} layers is too many (at most 16)")
    best, best_time, count = None, math.inf, 0
    for mask in range(1 << (n - 1)):
        cuts = [i for i in range(n - 1) if mask >> i & 1]
        starts, ends = [0] + [i + 1 for i in cuts], cuts + [n - 1]
        groups = tuple(zip(starts, ends))
        t = c.timeline(groups)[-1].ex_end
        count += 1
        if t < best_time:
            best, best_time = groups, t
    return Grouping(best, best_time, count)


SOLVERS = {"fast": optimal_grouping, "dp": dp_grouping, "pipeswitch": pipeswitch_search}
"""Solvers by name for :func:`make_plan`'s ``algorithm``."""


def make_plan(layer_names: Sequence[str], layer_bytes: Sequence[int], exec_us: Sequence[float],
              *, bytes_per_us: float, overhead_us: float, strategy: str = "optimal",
              algorithm: str = "fast") -> LayerGroupPlan:
    """Group the layers (``strategy``: ``optimal``, ``per_layer`` or ``single``; the optimum
    from ``algorithm``: ``fast`` or ``pipeswitch``) and return the plan with its timelines."""
    c = GroupCosts(layer_bytes, exec_us, bytes_per_us, overhead_us)
    if len(layer_names) != c.n:
        raise ValueError(f"{len(layer_names)} layer names for {c.n} layers")
    if strategy == "optimal":
        if algorithm not in SOLVERS:
            raise ValueError(f"algorithm={algorithm!r}: expected one of {sorted(SOLVERS)}")
        groups = SOLVERS[algorithm](layer_bytes, exec_us, bytes_per_us=bytes_per_us,
                                    overhead_us=overhead_us).groups
    elif strategy == "per_layer":
        groups = per_layer(c.n)
    elif strategy == "single":
        groups = single_group(c.n)
    else:
        raise ValueError(f"strategy={strategy!r}: expected 'optimal', 'per_layer' or 'single'")
    times = c.timeline(groups)
    return LayerGroupPlan(
        layers=tuple(layer_names), layer_bytes=tuple(int(b) for b in layer_bytes),
        layer_exec_us=tuple(float(e) for e in exec_us), groups=tuple(groups),
        group_bytes=tuple(int(round(c.nbytes(a, b))) for a, b in groups),
        transfer_us=tuple(c.T(a, b) for a, b in groups),
        exec_us=tuple(c.E(a, b) for a, b in groups), times=times, total_us=times[-1].ex_end,
        per_layer_us=c.timeline(per_layer(c.n))[-1].ex_end,
        single_group_us=c.timeline(single_group(c.n))[-1].ex_end,
        bytes_per_us=c.bw, overhead_us=c.oh, strategy=strategy)

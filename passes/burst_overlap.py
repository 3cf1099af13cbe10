"""The burst planner's search when gradient sync overlaps backward
(``BurstProblem(overlap=OverlapSync(...))``, what ``burst_parallel``'s default
``sync="overlap"`` builds): :func:`plan_overlap`, a heuristic around the exact DP.

A plan's time is then that of the runtime's execution, where each bucket's all-reduce runs
beside the rest of backward and only what runs past its end counts
(``tidal.passes.burst_evaluate``); that time is not a sum of per-layer terms, so the DP
(``tidal.passes.burst_search``) runs on per-layer costs linearised at a reference plan, which
the plan it finds corrects; the best plan found is then improved one layer's count at a time
(``_polish``).

Example:
    >>> import functools
    >>> import numpy as np
    >>> from tidal.passes.burst_evaluate import evaluate_plan
    >>> from tidal.passes.burst_problem import BurstProblem, OverlapSync
    >>> from tidal.passes.burst_search import search_plan
    >>> comp = np.array([[400., 200., 100.], [40., 38., 37.], [300., 150., 75.]])
    >>> sync = np.array([[0., 5., 8.], [0., 50., 80.], [0., 5., 8.]])
    >>> ov = OverlapSync(comp * 2 / 3, np.array([2e4, 3e5, 2e4]), bucket_bytes=25 * 2**20)
    >>> p = BurstProblem(("conv", "fc", "head"), ((), (0,), (1,)), comp, sync,
    ...                  np.array([64., 64., 64.]), (1, 2, 4), 8, 1e4, 1.0, overlap=ov)
    >>> search = functools.partial(search_plan, p, 2.0, "exact", 0.0, True, True)
    >>> ks, par = plan_overlap(p, search, evaluate_plan(p, p.dp_counts, set()), 2.0, 0.0, 8)
    >>> ks.tolist()
    [2, 0, 2]
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from tidal.passes.burst_evaluate import PlanEval, amplification, assign_ranks, evaluate_plan
from tidal.passes.burst_problem import BurstProblem


def plan_overlap(p: BurstProblem, search: Callable[..., Optional[tuple]], dp: PlanEval,
                 amp_limit: float, amp_min_us: float, rounds: int
                 ) -> Optional[tuple[np.ndarray, set]]:
    """The search under :class:`~tidal.passes.burst_problem.OverlapSync`: the best plan found
    (count indices, parallel branches), or None when none beats data parallelism (``dp``)
    under that execution. ``search(sync)`` runs the DP on per-layer syncs ``sync``
    (``tidal.passes.burst_search.search_plan`` with the problem and options bound).

    Why not one DP: the communication stream takes the buckets one after another, so what an
    all-reduce adds to the iteration depends on every bucket issued before it and on all the
    backward after it; the exposed time is a running maximum over buckets, not a sum of
    per-layer terms, and no state of (layer, GPU count) carries it. So the DP is run on a
    linearisation, then corrected: at a reference plan each layer gets a budget, the time
    between when its gradients start moving and the end of backward
    (:class:`~tidal.passes.burst_evaluate.PlanEval`); the DP (exact for these costs,
    amplification limit included) charges a layer on ``g`` GPUs
    ``max(0, sync(i, g) - budget)``, which at the reference plan sums to exactly the time its
    syncs run past backward. The plan found is evaluated under the execution model and
    becomes the next reference, up to ``rounds`` searches or until a plan repeats. Two starting
    points: zero budgets (every sync in full: the no-overlap search) and data parallelism's
    budgets. The best plan evaluated that keeps every layer's amplification (with its exposed
    sync) within the limit is then improved one layer's count at a time (``_polish``),
    and wins if it beats data parallelism: never slower than data parallelism, nor than the
    no-overlap plan, under the execution model. Not exact: on seeded random chains it finds
    the optimum of exhaustive search in most cases and stays within a few per cent of it
    (``tests/test_burst_planner.py``)."""
    best: Optional[tuple[np.ndarray, set, float]] = None
    seen: set = set()
    for budget in (np.zeros(len(p.names)), dp.budget):
        for _ in range(rounds):
            with np.errstate(invalid="ignore"):  # inf - budget stays inf
                found = search(np.maximum(p.sync - budget[:, None], 0.0))
            if found is None:
                break
            ks, par, _ = found
            key = (tuple(ks.tolist()), tuple(sorted(par)))
            if key in seen:
                break
            seen.add(key)
            ev = evaluate_plan(p, ks, par)
            if (best is None or ev.time < best[2]) and _fits(p, ks, ev, amp_limit, amp_min_us):
                best = (ks, par, ev.time)
            budget = ev.budget
    if best is None:
        return None
    ks, par, time = _polish(p, *best, amp_limit, amp_min_us)
    return (ks, par) if time < dp.time * (1 - 1e-12) else None


def _fits(p: BurstProblem, ks: np.ndarray, ev: PlanEval, amp_limit: float, amp_min_us: float
          ) -> bool:
    """Every layer's amplification is within ``amp_limit``."""
    return bool(np.all(amplification(p, ks, ev, amp_min_us) <= amp_limit * (1 + 1e-9)))


def _polish(p: BurstProblem, ks: np.ndarray, par: set, time: float, amp_limit: float,
            amp_min_us: float, sweeps: int = 2, evaluations: int = 2000
            ) -> tuple[np.ndarray, set, float]:
    """Local search under the execution model: each layer that computes or syncs in turn moves
    to the next smaller or larger count when that shortens the iteration (the better of the
    two; within the amplification limit and the GPUs), up to ``sweeps`` passes over those
    layers and ``evaluations`` plans evaluated."""
    ks = ks.copy()
    left = evaluations
    movable = np.nonzero((p.comp[:, 0] > 0) | (p.overlap.param_bytes > 0))[0].tolist()
    for _ in range(sweeps):
        moved = False
        for i in movable:
            best = None
            for k in (ks[i] - 1, ks[i] + 1):
                if not 0 <= k < len(p.counts) or left <= 0 or not np.isfinite(p.comp[i, k]):
                    continue
                trial = ks.copy()
                trial[i] = k
                offset = assign_ranks(p, trial, par)
                if np.any(offset + p.counts[trial] > p.gpus):
                    continue
                left -= 1
                ev = evaluate_plan(p, trial, par, offset)
                if ev.time < time * (1 - 1e-12) and _fits(p, trial, ev, amp_limit, amp_min_us):
                    best, time = k, ev.time
            if best is not None:
                ks[i], moved = best, True
        if not moved or left <= 0:
            break
    return ks, par, time

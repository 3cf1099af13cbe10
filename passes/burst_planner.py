"""DeepPool's burst-parallel planner (§4): per-layer GPU counts under a GPU-sec amplification
limit, as a pure function of numpy cost arrays.

Inputs (a :class:`BurstProblem`): the layer DAG (names in topological order and each layer's
predecessors), ``comp[i, k]`` (forward + backward µs of layer ``i`` at the per-GPU batch
``ceil(B / counts[k])``), ``sync[i, k]`` (gradient all-reduce µs of its parameters on
``counts[k]`` GPUs), the bytes per sample of each layer's output, the link bandwidth and
latency. The time model (DeepPool §4.1):

* a layer on ``g`` GPUs costs ``comm_in + comp(i, g) + sync(i, g)``; its GPU-sec amplification
  is ``Amp(i, g) = T(i, g) * g / comp(i, 1)`` with ``T`` that sum;
* moving a layer's output between GPU sets (``comm``) costs, forward and backward, the largest
  number of samples one GPU sends or receives times the bytes per sample over the bandwidth,
  plus the latency. Nested sets share their first ranks (``g -> h`` moves
  ``max(ceil(B/s) - ceil(B/b), ceil(B/b))`` samples per GPU, ``s``/``b`` the smaller/bigger
  count); a branch placed on other GPUs moves every sample (``ceil(B / min(g, h))``);
* a branch/join block (``tidal.ir.layer_graph.branch_blocks``) is reduced to one transition
  ``tr(fork, h) -> (join, g)``: each branch is searched with the fork fixed at ``h``, the
  critical (longest) branch stays on the fork's GPUs and each other branch moves to GPUs of its
  own (after those the branches that stay use) when that shortens the block and the GPUs fit
  (DeepPool's multi-chain graph reduction);
  branches on the same GPUs run one after another, branches on other GPUs overlap. Blocks
  nested inside a branch run serially. Communication into a join is charged to the block.

Two searches: ``algorithm="paper"`` is Algorithm 1 as printed (tables S and T, a predecessor
state is eligible when ``Amp(i-1, h) <= max(bestAmp, AmpLimit)``, scanned in increasing ``h``;
the last layer is checked by a final zero-cost step). ``algorithm="exact"`` (default) enforces
``Amp(i, g) <= limit`` on each edge ``(i-1, h) -> (i, g)``, which makes the chain DP an exact
constrained shortest path (it equals exhaustive search). Either way data parallelism (every
layer on all ``G`` GPUs) is the baseline: a plan that does not beat it is replaced by it
(``BurstPlan.fallback``). The plan is data in ``tidal.ir.plans.burst``, where the runtime
reads it.

Gradient sync that overlaps backward (``BurstProblem(overlap=OverlapSync(...))``, what
``burst_parallel``'s default ``sync="overlap"`` builds): a plan's time is that of the runtime's
execution, where each bucket's all-reduce runs beside the rest of backward and only what runs
past its end counts (:class:`OverlapSync`); the data-parallel baseline is DDP's. That time is
not a sum of per-layer terms, so the search runs the DP above on per-layer costs linearised at
a reference plan and corrects them from the plan it finds
(``tidal.passes.burst_overlap.plan_overlap``); the plan returned is never predicted slower than
data parallelism, nor than the no-overlap search's plan, under that execution.

The planner's parts, one module each: the problem and the layer DAG's structure
(``tidal.passes.burst_problem``), the time model (``tidal.passes.burst_evaluate``), the DP
(``tidal.passes.burst_search``, batched in ``tidal.passes.burst_search_fast``, their shared
block reduction and backtracking in ``tidal.passes.burst_dp``) and the search under overlap
(``tidal.passes.burst_overlap``). This module makes the plan (:func:`plan_burst`,
:func:`plan_from_counts`) and re-exports the names callers use.

Example:
    >>> import numpy as np
    >>> from tidal.passes.burst_planner import BurstProblem, plan_burst
    >>> counts = (1, 2, 4)
    >>> comp = np.array([[400., 200., 100.], [40., 38., 37.], [300., 150., 75.]])
    >>> sync = np.array([[0., 5., 8.], [0., 50., 80.], [0., 5., 8.]])
    >>> p = BurstProblem(("conv", "fc", "head"), ((), (0,), (1,)), comp, sync,
    ...                  act_bytes=np.array([64., 64., 64.]), counts=counts, batch=8,
    ...                  bytes_per_us=1e4, latency_us=1.0)
    >>> plan = plan_burst(p, amp_limit=2.0)
    >>> [l.gpus for l in plan.layers], plan.time_us < plan.dp_time_us
    ([4, 1, 4], True)

    The same layers when sync overlaps backward (backward is 2/3 of each layer's time; fc syncs
    300 kB): in buckets of 100 kB, fc's all-reduce runs beside conv's backward and data
    parallelism wins; in one bucket (DDP's 25 MiB), issued after the last backward, it does not.

    >>> from tidal.passes.burst_planner import OverlapSync
    >>> for cap in (1e5, 25 * 2**20):
    ...     ov = OverlapSync(comp * 2 / 3, np.array([2e4, 3e5, 2e4]), bucket_bytes=cap)
    ...     q = BurstProblem(p.names, p.preds, comp, sync, p.act_bytes, counts, 8, 1e4, 1.0,
    ...                      overlap=ov)
    ...     plan = plan_burst(q, amp_limit=2.0)
    ...     print([l.gpus for l in plan.layers], round(plan.time_us), round(plan.dp_time_us))
    [4, 4, 4] 221 221
    [4, 1, 4] 228 269
"""
from __future__ import annotations

import functools
from typing import Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from tidal.ir.burst_rows import split_rows as split_batch
from tidal.ir.plans.burst import BurstPlan, LayerPlacement
from tidal.passes.burst_evaluate import (PlanEval, amplification, assign_ranks, evaluate,
                                         evaluate_plan)
from tidal.passes.burst_overlap import plan_overlap
from tidal.passes.burst_problem import (BurstProblem, OverlapSync, all_blocks, allreduce_us,
                                        candidate_counts, chain_members, check_structure,
                                        per_gpu_batch)
from tidal.passes.burst_search import search_plan

__all__ = ["BurstProblem", "OverlapSync", "allreduce_us", "candidate_counts", "check_structure",
           "evaluate", "per_gpu_batch", "plan_burst", "plan_from_counts", "split_batch"]

_ALGORITHMS = ("exact", "paper")


def plan_burst(problem: BurstProblem, amp_limit: float = 2.0, *, algorithm: str = "exact",
               amp_min_us: float = 0.0, parallel_branches: bool = True,
               fast: bool = True, rounds: int = 8) -> BurstPlan:
    """The burst-parallel plan minimising predicted iteration time under ``amp_limit``.

    ``algorithm``: ``"exact"`` (per-edge amplification check, an exact DP) or ``"paper"``
    (Algorithm 1 as printed). ``amp_min_us``: layers whose single-GPU time is at most this are
    not amplification-checked (DeepPool's code uses 300 µs). ``parallel_branches``: allow
    branches on GPUs of their own. ``fast=False`` runs the straightforward (unbatched) search
    of ``"exact"``, which gives the same plan more slowly. Falls back to data parallelism
    (``fallback=True``) when the search does not beat it. ``rounds``: searches from each
    starting point of a problem with ``overlap``
    (``tidal.passes.burst_overlap.plan_overlap``). Raises
    ``ValueError`` for ``amp_limit < 1`` or an unknown algorithm."""
    if isinstance(amp_limit, bool) or not isinstance(amp_limit, (int, float)) \
            or not amp_limit >= 1:
        raise ValueError(f"amp_limit={amp_limit!r}: the amplification limit must be >= 1")
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: expected one of {_ALGORITHMS}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"plan_burst(rounds={rounds!r}): must be a positive int")
    p = problem
    dp_ks = p.dp_counts
    if len(p.counts) == 1:
        return _make_plan(p, dp_ks, set(), amp_limit, algorithm, amp_min_us)
    search = functools.partial(search_plan, p, float(amp_limit), algorithm, float(amp_min_us),
                               parallel_branches, fast)
    dp = evaluate_plan(p, dp_ks, set())
    if p.overlap is not None:
        found = plan_overlap(p, search, dp, float(amp_limit), float(amp_min_us), rounds)
    else:
        found = search()
        if found is not None and not found[2] < dp.time * (1 - 1e-12):
            found = None
    if found is None:
        return _make_plan(p, dp_ks, set(), amp_limit, algorithm, amp_min_us, fallback=True)
    return _make_plan(p, found[0], found[1], amp_limit, algorithm, amp_min_us, dp=dp)


def plan_from_counts(problem: BurstProblem, counts: Union[Mapping[str, int], Sequence[int]],
                     parallel: Iterable[tuple[str, int]] = (), *, amp_limit: float = 2.0,
                     algorithm: str = "given", amp_min_us: float = 0.0) -> BurstPlan:
    """A :class:`BurstPlan` for GPU ``counts`` chosen by hand (per layer, by name or in layer
    order; each one of ``problem.counts``) with the branches ``parallel`` (``(join name,
    branch index)``) on GPUs of their own. Raises ``ValueError`` for a count that is not a
    candidate or a placement that needs more than ``G`` GPUs.

    >>> import numpy as np
    >>> p = BurstProblem(("a", "b"), ((), (0,)), np.array([[100., 60.], [80., 40.]]),
    ...                  np.zeros((2, 2)), np.array([8., 8.]), (1, 2), 4, 1e3, 1.0)
    >>> plan = plan_from_counts(p, {"a": 1, "b": 2})
    >>> [l.ranks for l in plan.layers], round(plan.time_us, 3)
    ([(0,), (0, 1)], 142.032)
    """
    p = problem
    if isinstance(counts, Mapping):
        missing = [n for n in p.names if n not in counts]
        if missing:
            raise ValueError(f"plan_from_counts: no GPU count for layer {missing[0]!r}")
        values = [counts[n] for n in p.names]
    else:
        values = list(counts)
        if len(values) != len(p.names):
            raise ValueError(f"plan_from_counts: {len(values)} counts for {len(p.names)} layers")
    index = {int(c): k for k, c in enumerate(p.counts)}
    ks = []
    for n, v in zip(p.names, values):
        if v not in index:
            raise ValueError(f"plan_from_counts: layer {n!r} on {v!r} GPUs; candidates are "
                             f"{tuple(index)}")
        ks.append(index[v])
    joins = {p.names[j]: (j, blk) for j, blk in all_blocks(p.top)}
    par = set()
    for name, b in parallel:
        if name not in joins or not 0 <= b < len(joins[name][1].branches) \
                or joins[name][1].branches[b] is None:
            raise ValueError(f"plan_from_counts: parallel branch ({name!r}, {b}) is not a "
                             f"non-empty branch of a block joining at {name!r}")
        par.add((joins[name][0], b))
    return _make_plan(p, np.array(ks), par, amp_limit, algorithm, amp_min_us)


def _make_plan(p: BurstProblem, ks: np.ndarray, par: set, amp_limit: float, algorithm: str,
               amp_min_us: float, fallback: bool = False,
               dp: Optional[PlanEval] = None) -> BurstPlan:
    """The :class:`BurstPlan` of count indices ``ks`` with the branches ``par`` on GPUs of
    their own: each layer's ranks, sample ranges, costs and amplification, beside data
    parallelism (``dp``: its evaluation, if already made). Raises ``ValueError`` for a
    placement beyond the ``G`` GPUs."""
    ev = evaluate_plan(p, ks, par)
    offset = assign_ranks(p, ks, par)
    G, B = p.gpus, p.batch
    ar = np.arange(len(p.names))
    gpus = p.counts[ks]
    beyond = np.nonzero(offset + gpus > G)[0]
    if len(beyond):
        i = int(beyond[0])
        raise ValueError(f"layer {p.names[i]!r}: placed on ranks {offset[i]}.."
                         f"{offset[i] + gpus[i] - 1}, beyond the {G} GPUs (too many branches "
                         f"in parallel)")
    comp = p.comp[ar, ks]
    gpu_sec = 0.0
    for x in ((ev.comm + comp + ev.sync) * gpus).tolist():
        gpu_sec += x
    amp = amplification(p, ks, ev, amp_min_us)
    in_parallel = _parallel_layers(p, par)
    splits: dict[int, tuple[tuple[int, int], ...]] = {}
    ranks: dict[tuple[int, int], tuple[int, ...]] = {}
    layers = []
    for i, (name, g, o, cp, cm, sy, a) in enumerate(zip(
            p.names, gpus.tolist(), offset.tolist(), comp.tolist(), ev.comm.tolist(),
            ev.sync.tolist(), amp.tolist())):
        if g not in splits:
            splits[g] = split_batch(B, g)
        if (o, g) not in ranks:
            ranks[o, g] = tuple(range(o, o + g))
        layers.append(LayerPlacement(name, g, ranks[o, g], splits[g], cp, cm, sy, a,
                                     i in in_parallel))
    dp_ks = p.dp_counts
    dp = dp if dp is not None else evaluate_plan(p, dp_ks, set())
    dp_sec = float(np.sum((dp.comm + p.comp[ar, dp_ks] + dp.sync) * p.counts[dp_ks]))
    return BurstPlan(
        world=G, batch=B, amp_limit=float(amp_limit), algorithm=algorithm, layers=tuple(layers),
        parallel_branches=tuple(sorted((p.names[j], b) for j, b in par)),
        time_us=float(ev.time), gpu_sec_us=float(gpu_sec), dp_time_us=float(dp.time),
        dp_gpu_sec_us=dp_sec, single_gpu_us=float(np.sum(p.comp[:, 0])), fallback=fallback)


def _parallel_layers(p: BurstProblem, par: set) -> set:
    """Every layer inside a branch of ``par`` (on GPUs of its own)."""
    out: set = set()
    for j, blk in all_blocks(p.top):
        for b, br in enumerate(blk.branches):
            if (j, b) in par:
                out |= set(chain_members(br))
    return out

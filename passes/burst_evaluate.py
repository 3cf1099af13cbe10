"""The burst-parallel planner's time model (DeepPool §4.1): a plan's predicted iteration time,
each layer's incoming communication and the sync it adds, where each layer's ranks start, and
its GPU-sec amplification.

A plan is given as count *indices* per layer (``ks``: layer ``i`` on ``problem.counts[ks[i]]``
GPUs) and the set ``par`` of ``(join index, branch index)`` pairs whose branch runs on GPUs of
its own. Without :class:`~tidal.passes.burst_problem.OverlapSync` every layer pays its
transfer in, its compute and its sync one after another; with it, the time is that of the
runtime's execution, each gradient bucket's all-reduce beside the rest of backward
(:func:`evaluate_plan`).

Example:
    >>> import numpy as np
    >>> from tidal.passes.burst_problem import BurstProblem
    >>> p = BurstProblem(("a", "b"), ((), (0,)), np.array([[100., 60.], [80., 40.]]),
    ...                  np.zeros((2, 2)), np.array([8., 8.]), (1, 2), batch=4,
    ...                  bytes_per_us=1e3, latency_us=1.0)
    >>> evaluate_plan(p, np.array([1, 1]), set()).time            # both on 2 GPUs
    100.0
    >>> round(evaluate_plan(p, np.array([0, 1]), set()).time, 3)   # a on 1, then moved
    142.032
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from tidal.ir.comm_cost import gradient_buckets, ring_allreduce_us
from tidal.passes.burst_problem import Block, BurstProblem, Chain

def _eval_chain(p: BurstProblem, chain: Chain, ks: np.ndarray, par: set, terms: list) -> float:
    t = 0.0
    for i in chain.layers:
        if i in chain.blocks:
            t += _eval_block(p, chain.blocks[i], ks, par, terms)
        t += terms[i]
    return t


def _eval_block(p: BurstProblem, blk: Block, ks: np.ndarray, par: set, terms: list) -> float:
    kf, kj = ks[blk.fork], ks[blk.join]
    serial, par_t = 0.0, 0.0
    for b, br in enumerate(blk.branches):
        if br is None:
            serial += p.comm(blk.fork)[kf, kj]
            continue
        kind = "disjoint" if (blk.join, b) in par else "overlap"
        t = _eval_chain(p, br, ks, par, terms)
        t += p.comm(br.layers[-1], kind)[ks[br.layers[-1]], kj]
        if kind == "disjoint":
            par_t = max(par_t, t)
        else:
            serial += t
    return max(serial, par_t)


@dataclass(frozen=True, eq=False)
class PlanEval:
    """A plan's predicted ``time``, each layer's incoming communication (``comm``) and the sync
    time it adds to the iteration (``sync``: in full, or under overlap the part of its share of
    a bucket that runs after backward has ended) and, under overlap, each layer's ``budget``:
    how long before the end of backward its gradients start moving (or would, were the layer
    synced), the time behind which its all-reduce hides."""

    time: float
    comm: np.ndarray
    sync: np.ndarray
    budget: Optional[np.ndarray] = None


def evaluate_plan(p: BurstProblem, ks: np.ndarray, par: set,
                  offset: Optional[np.ndarray] = None) -> PlanEval:
    """:class:`PlanEval` of a plan (``offset``: each layer's first rank, if known; see the
    module docstring for an example)."""
    comm = np.zeros(len(p.names))
    src, dst = p.chain_edges
    comm[dst] = p.comm_all()[src, ks[src], ks[dst]]
    for first, fork, key in p.branch_entries:  # a branch's first layer reads the fork
        comm[first] = p.comm(fork, "disjoint" if key in par else "overlap")[ks[fork], ks[first]]
    ar = np.arange(len(ks))
    if p.overlap is not None:
        return _overlap_eval(p, ks, assign_ranks(p, ks, par) if offset is None else offset, par,
                             comm)
    sync = p.sync[ar, ks]
    terms = (comm + p.comp[ar, ks] + sync).tolist()
    return PlanEval(_eval_chain(p, p.top, ks, par, terms), comm, sync)


def evaluate(problem: BurstProblem, counts: Sequence[int],
             parallel: Iterable[tuple[int, int]] = ()) -> tuple[float, np.ndarray]:
    """Predicted iteration time (µs) of a plan given as count *indices* per layer and the
    ``(join index, branch index)`` pairs run on GPUs of their own, and each layer's incoming
    communication time. An independent re-computation of the time model the search uses; for a
    problem with ``overlap``, the time of the execution :class:`OverlapSync` describes."""
    e = evaluate_plan(problem, np.asarray(counts, dtype=np.int64), set(parallel))
    return e.time, e.comm


def _backward(p: BurstProblem, chain: Chain, ks: np.ndarray, par: set, back: list,
              ends: list, t: float) -> float:
    """Walk ``chain``'s backward from time ``t``: layers in reverse order, each taking
    ``back[i]``; a block's branches on the fork's GPUs one after another, those on GPUs of their
    own beside them. Records when each layer's backward ends (``ends``); returns the end."""
    for i in reversed(chain.layers):
        t += back[i]
        ends[i] = t
        if i in chain.blocks:
            blk = chain.blocks[i]
            kf, kj = ks[blk.fork], ks[blk.join]
            serial = last = t
            for b in reversed(range(len(blk.branches))):
                br = blk.branches[b]
                if br is None:  # a skip connection: the fork's gradient arrives
                    serial += p.comm(blk.fork)[kf, kj] / 2
                    continue
                own = (blk.join, b) in par
                out = p.comm(br.layers[-1], "disjoint" if own else "overlap")[
                    ks[br.layers[-1]], kj] / 2
                if own:
                    last = max(last, _backward(p, br, ks, par, back, ends, t + out))
                else:
                    serial = _backward(p, br, ks, par, back, ends, serial + out)
            t = max(serial, last)
    return t


def _sync_buckets(p: BurstProblem, ks: np.ndarray, offset: np.ndarray
                  ) -> list[tuple[int, int, list[int]]]:
    """``(first rank, GPUs, layers in backward order)`` of each gradient bucket of a plan under
    :class:`~tidal.passes.burst_problem.OverlapSync`, in issue order, by the one bucket rule
    (``tidal.ir.comm_cost.gradient_buckets``, as the runtime's ``tidal.ir.burst_sync`` cuts
    them): layers in backward order keyed by their GPU set, so a run ends wherever the set
    changes (a layer on another set, one GPU included, ends it; a layer without parameters on
    the same set does not); a layer on one GPU syncs nothing."""
    ov = p.overlap
    offset, gpus, nbytes = offset.tolist(), p.counts[ks].tolist(), ov.param_bytes.tolist()
    items = [((offset[i], gpus[i]), i, nbytes[i] if gpus[i] > 1 else 0.0)
             for i in range(len(ks) - 1, -1, -1)]
    return [(o, g, layers) for (o, g), layers in gradient_buckets(items, ov.bucket_bytes)]


def _overlap_eval(p: BurstProblem, ks: np.ndarray, offset: np.ndarray, par: set,
                  comm: np.ndarray) -> PlanEval:
    """:func:`evaluate_plan` under :class:`OverlapSync`: the critical path of transfers and
    compute, plus what the last all-reduce runs past the end of backward. Each rank's
    communication stream takes the buckets one after another in issue order."""
    ov, L = p.overlap, len(ks)
    ar = np.arange(L)
    time = _eval_chain(p, p.top, ks, par, (comm + p.comp[ar, ks]).tolist())
    ends = [0.0] * L
    tb = _backward(p, p.top, ks, par, (ov.bwd[ar, ks] + comm / 2).tolist(), ends, 0.0)
    free = np.zeros(p.gpus)  # when each rank's communication stream is next free
    sync, start = np.zeros(L), np.full(L, np.nan)
    last, first_rank = tb, []  # (issued, ended) of the buckets on rank 0
    for o, g, layers in _sync_buckets(p, ks, offset):
        nbytes = float(ov.param_bytes[layers].sum())
        d = ring_allreduce_us(nbytes, g, p.bytes_per_us, p.latency_us)
        issued = max(ends[i] for i in layers)
        s = max(issued, float(free[o:o + g].max()))
        free[o:o + g] = s + d
        last = max(last, s + d)
        if o == 0:
            first_rank.append((issued, s + d))
        for i in layers:  # each layer's share of the bucket, in order
            di = d * float(ov.param_bytes[i]) / nbytes
            start[i] = s
            sync[i] = max(0.0, min(di, s + di - tb))
            s += di
    end = np.array(ends)
    if first_rank:  # a layer not synced would wait for rank 0's stream as it is then
        issued, ended = np.array(first_rank).T
        queued = np.where(issued[None, :] <= end[:, None], ended[None, :], 0.0).max(axis=1)
    else:
        queued = np.zeros(L)
    wait = np.where(np.isnan(start), np.maximum(end, queued), start)
    return PlanEval(time + last - tb, comm, sync, np.maximum(tb - wait, 0.0))


def assign_ranks(p: BurstProblem, counts: np.ndarray, parallel: set) -> np.ndarray:
    """First rank of each layer: serial layers start at their parent's offset; the branches of a
    block on GPUs of their own come after the GPUs the branches that stay use.

    >>> import numpy as np
    >>> from tidal.passes.burst_problem import BurstProblem
    >>> p = BurstProblem(("fork", "x", "y", "join"), ((), (0,), (0,), (1, 2)), np.ones((4, 3)),
    ...                  np.zeros((4, 3)), np.ones(4), (1, 2, 4), 4, 1e3, 1.0)
    >>> assign_ranks(p, np.array([2, 1, 1, 2]), {(3, 1)}).tolist()  # branch y on GPUs 2, 3
    [0, 0, 2, 0]
    """
    offset = [0] * len(p.names)
    gpus = p.counts[np.asarray(counts)].tolist()

    def walk(chain: Chain, base: int) -> int:
        """Place ``chain`` from rank ``base``; return how many GPUs it spans."""
        span = 0
        for i in chain.layers:
            offset[i] = base
            if gpus[i] > span:
                span = gpus[i]
        for blk in chain.blocks.values():
            used = 0  # GPUs of the branches that run one after another (fork/join run apart)
            for b, br in enumerate(blk.branches):
                if br is not None and (blk.join, b) not in parallel:
                    used = max(used, walk(br, base))
            nxt = base + used
            for b, br in enumerate(blk.branches):
                if br is not None and (blk.join, b) in parallel:
                    nxt += walk(br, nxt)
            span = max(span, nxt - base)
        return span

    walk(p.top, 0)
    return np.array(offset, dtype=np.int64)


def amplification(p: BurstProblem, ks: np.ndarray, ev: PlanEval, amp_min_us: float
                  ) -> np.ndarray:
    """Each layer's GPU-sec amplification ``(comm + comp + sync) * g / comp(i, 1)`` (0 for a
    layer whose one-GPU time is at most ``amp_min_us``: not checked).

    >>> import numpy as np
    >>> from tidal.passes.burst_problem import BurstProblem
    >>> p = BurstProblem(("a",), ((),), np.array([[100., 60.]]), np.zeros((1, 2)),
    ...                  np.ones(1), (1, 2), 2, 1e3, 1.0)
    >>> ks = np.array([1])
    >>> amplification(p, ks, evaluate_plan(p, ks, set()), amp_min_us=0.0).tolist()
    [1.2]
    """
    c1 = p.comp[:, 0]
    t = ev.comm + p.comp[np.arange(len(ks)), ks] + ev.sync
    return np.where(c1 <= amp_min_us, 0.0, t * p.counts[ks] / np.maximum(c1, 1e-12))


